package config

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/xdproxy/xdproxy/control/k8sconv"
	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// Config is a validated configuration with every default applied: what
// Load and Parse return. Its values are parsed; nothing needs checking or
// parsing again.
type Config struct {
	// NodeName is this node's name as the API server knows it; endpoints
	// with the same nodeName are local.
	NodeName string
	// NodeZone is the node's topology zone, used when no API server
	// provides the Node object.
	NodeZone   string
	Interfaces []Interface
	// ExceptionInterface names the veth pair xdproxy creates to hand
	// frames back to the kernel.
	ExceptionInterface string
	Services           Services
	// ClusterCIDRs are the pod CIDRs, masked. ClusterIP traffic from
	// outside them is masqueraded, as in kube-proxy.
	ClusterCIDRs []netip.Prefix
	// NodePortAddresses are the CIDRs whose node addresses accept
	// NodePorts, masked; empty means every address of the interfaces.
	NodePortAddresses []netip.Prefix
	Masquerade        Masquerade
	Conntrack         Conntrack
	// Scheduler is the backend selection of services that do not choose
	// one with the xdproxy.io/scheduler annotation.
	Scheduler      service.Scheduler
	MetricsAddress netip.AddrPort
	HealthzAddress netip.AddrPort
	AdminSocket    string
	// StateDir holds state that survives a restart (the connection
	// tracking table's file).
	StateDir string
	// BPFFSDir is where XDP links and maps are pinned (on a bpf file
	// system).
	BPFFSDir string
	// LocalClients is the translation at the socket of the service
	// connections of pods and host processes, which never cross a NIC.
	LocalClients LocalClients
	// BusyPoll makes workers spin on empty rings instead of sleeping in
	// poll() while their queue has traffic: lower latency, a full core
	// per busy worker. A worker whose queue is quiet for IdleWait sleeps.
	BusyPoll bool
	// BatchSize is the number of frames a worker handles per batch.
	BatchSize int
	XDPTables XDPTables
	// Benchmark holds settings for benchmarking only.
	Benchmark Benchmark
}

// Benchmark holds settings for benchmarking only: with them xdproxy is no
// longer a service proxy.
type Benchmark struct {
	// IOFloor forwards every frame untranslated: the same sockets and
	// worker loop, with only the MAC addresses rewritten for the next hop
	// towards IOFloorPeer. It measures the I/O cost under xdproxy's own.
	IOFloor bool
	// IOFloorPeer is the address whose next hop IOFloor forwards to; set
	// exactly when IOFloor is.
	IOFloorPeer netip.Addr
}

// Interface is one NIC (or veth) that xdproxy attaches to.
type Interface struct {
	Name string
	// Queues are the RX queues to serve, one worker each; nil means every
	// RX queue the NIC has, followed as its channel count changes.
	Queues []int
	// CPUs are where the workers run: the worker of the i-th served queue
	// runs on CPUs[i % len(CPUs)] (see WorkerCPU). nil means every CPU the
	// process may run on.
	CPUs     []int
	XDPMode  xdp.Mode
	BindMode afxdp.BindMode
	// Socket sizes each queue's AF_XDP socket; Socket.Mode is BindMode.
	Socket afxdp.Config
}

// WorkerCPU returns the CPU of the worker of the n-th served queue:
// CPUs[n % len(CPUs)], or usable[n % len(usable)] when CPUs is nil (usable
// being the CPUs the process may run on, Host.CPUs). It returns -1 when
// both are empty.
func (in *Interface) WorkerCPU(n int, usable []int) int {
	cpus := in.CPUs
	if cpus == nil {
		cpus = usable
	}
	if len(cpus) == 0 {
		return -1
	}
	return cpus[n%len(cpus)]
}

// LocalClients configures the translation at the socket (cgroup BPF
// programs) of the service connections of clients on the node.
type LocalClients struct {
	Enabled bool
	// Cgroup is the cgroup v2 whose processes (and their descendants')
	// connections are translated; empty means the root of the cgroup2
	// mount, which holds every pod and host process.
	Cgroup string
}

// Services says where services come from: exactly one of File and
// Kubernetes is set.
type Services struct {
	// File is a file of Service and EndpointSlice manifests.
	File       string
	Kubernetes *Kubernetes
}

// Kubernetes configures the API-server source.
type Kubernetes struct {
	// Kubeconfig is a kubeconfig path; empty means the pod's service
	// account.
	Kubeconfig string
	// APIServer is "https://host:port" of the API server, used instead of
	// the kubeconfig's server or the in-cluster kubernetes Service (whose
	// ClusterIP only works once a proxy, this one, programs it). Empty:
	// the kubeconfig's or the in-cluster address.
	APIServer     string
	QPS           float32
	Burst         int
	MinSyncPeriod time.Duration
	MaxSyncPeriod time.Duration
	// ProxyName is the service.kubernetes.io/service-proxy-name this
	// proxy answers to; services naming any other proxy are skipped.
	ProxyName string
}

// Masquerade configures SNAT.
type Masquerade struct {
	// Address is the source address of masqueraded traffic; the zero Addr
	// means the address of the egress interface.
	Address netip.Addr
	// Ports are the SNAT source ports.
	Ports conntrack.PortRange
	// All masquerades every service flow (kube-proxy's masqueradeAll).
	All bool
	// ReservePorts: when Ports overlap the kernel's ephemeral ports
	// (net.ipv4.ip_local_port_range), add Ports to
	// net.ipv4.ip_local_reserved_ports instead of refusing to start.
	ReservePorts bool
}

// Conntrack configures connection tracking.
type Conntrack struct {
	MaxEntries int
	// Timeouts has every field set.
	Timeouts conntrack.Timeouts
	// FragmentTimeout and FragmentMaxEntries bound the fragment
	// translations remembered; zero takes nat/conntrack's defaults (it
	// does not export them).
	FragmentTimeout    time.Duration
	FragmentMaxEntries int
	// SYNGuard lets the XDP program drop first SYNs while a flood of new
	// connections overruns the table (see dataplane.SYNGuardConfig).
	SYNGuard bool
}

// XDPTables sizes the XDP program's maps, which the kernel allocates up
// front.
type XDPTables struct {
	// MaxFrontends bounds frontends (service IP:port pairs, NodePorts on
	// every node address included).
	MaxFrontends int
	// MaxAddresses bounds distinct addresses: VIPs, endpoints and node
	// addresses together.
	MaxAddresses int
}

// Defaults of the fields that the file leaves out and that no lower package
// defines. The others come from their packages: afxdp.DefaultConfig for
// sockets, xdp.Default* for the XDP maps and the connection table,
// conntrack.KubeProxyTimeouts, kubesource.Default* for the API client and
// k8sconv.DefaultProxyName.
const (
	DefaultExceptionInterface = "xdpx0"
	DefaultScheduler          = service.Random
	DefaultMetricsAddress     = "127.0.0.1:10249"
	DefaultHealthzAddress     = "0.0.0.0:10256"
	DefaultAdminSocket        = "/run/xdproxy/admin.sock"
	DefaultStateDir           = "/run/xdproxy"
	DefaultBPFFSDir           = "/sys/fs/bpf/xdproxy"
	// DefaultBatchSize is also dataplane.Worker's (unexported) default.
	DefaultBatchSize = 64
	// DefaultMaxEntries sizes the connection table like the XDP flow map
	// that mirrors it.
	DefaultMaxEntries = xdp.DefaultMaxFlows
)

// DefaultPorts are the SNAT ports: the ones Linux never hands out as
// ephemeral ports on a stock node (ip_local_port_range 32768-60999), so
// masqueraded flows and the node's own connections cannot collide.
var DefaultPorts = conntrack.PortRange{First: 61000, Last: 65535}

// DefaultTimeouts are the connection tracking timeouts a node has under
// kube-proxy: netfilter's, with kube-proxy's TCP ESTABLISHED 24h and
// CLOSE_WAIT 1h.
var DefaultTimeouts = conntrack.KubeProxyTimeouts

// Limits of the values the file may hold.
const (
	maxQueue       = 1023
	minMaxEntries  = 1024
	maxTableSize   = 1 << 24
	maxBatchSize   = 1024
	minPorts       = 64
	maxIfNameLen   = 15  // IFNAMSIZ - 1
	maxUnixPathLen = 107 // sizeof(sun_path) - 1
)

// Options adapt a file to the node it is used on.
type Options struct {
	// Host is the machine the file is for; nil means ThisHost().
	Host *Host
	// NodeName, when not empty, replaces the file's nodeName, so that one
	// file serves every node (xdproxy run --node-name, kube-proxy's
	// --hostname-override).
	NodeName string
}

// Load reads, defaults and validates the file at path for this host.
func Load(path string) (*Config, error) { return LoadWith(path, Options{}) }

// LoadWith is Load with options.
func LoadWith(path string, o Options) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	c, err := ParseWith(b, o)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes, defaults and validates a configuration for this host.
func Parse(b []byte) (*Config, error) { return ParseWith(b, Options{}) }

// ParseWith is Parse with options. Every problem is reported at once, as
// an Errors value (errors.As finds it), unless the file is not YAML at all.
func ParseWith(b []byte, o Options) (*Config, error) {
	var h Host
	if o.Host != nil {
		h = *o.Host
	} else {
		var err error
		if h, err = ThisHost(); err != nil {
			return nil, err
		}
	}
	var f fileV1alpha1
	if err := decode(b, &f); err != nil {
		return nil, err
	}
	if o.NodeName != "" {
		f.NodeName = o.NodeName
	}
	var errs Errors
	c := f.convert(h, &errs)
	if len(errs) > 0 {
		return nil, errs
	}
	return c, nil
}

// FieldError is one problem with one field.
type FieldError struct {
	// Field is the path of the field in the file:
	// "interfaces[0].cpus[1]".
	Field string
	// Problem says what is wrong: "CPU 7 does not exist (this machine has
	// CPUs 0-1)".
	Problem string
}

func (e FieldError) Error() string { return e.Field + ": " + e.Problem }

// Errors is every problem found in a file, in the order of the file's
// fields. Its message is the one problem, or a count and one problem per
// line.
type Errors []FieldError

func (e Errors) Error() string {
	if len(e) == 1 {
		return e[0].Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d problems:", len(e))
	for _, fe := range e {
		b.WriteString("\n\t" + fe.Error())
	}
	return b.String()
}

func (e *Errors) add(field, format string, args ...any) {
	*e = append(*e, FieldError{field, fmt.Sprintf(format, args...)})
}

// orDefault returns *p, or def when the file leaves the field out.
func orDefault[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

func orDefaultDuration(p *duration, def time.Duration) time.Duration {
	if p == nil {
		return def
	}
	return p.Duration
}

// convert parses, defaults and validates f field by field, in the file's
// order, then checks the rules that span fields.
func (f *fileV1alpha1) convert(h Host, errs *Errors) *Config {
	c := &Config{NodeName: f.NodeName, NodeZone: f.NodeZone, BusyPoll: f.BusyPoll}
	if c.NodeName == "" {
		errs.add("nodeName", "required")
	} else if p := validation.IsDNS1123Subdomain(c.NodeName); len(p) > 0 {
		errs.add("nodeName", "%q is not a node name: %s", c.NodeName, strings.Join(p, "; "))
	}
	if p := validation.IsValidLabelValue(c.NodeZone); len(p) > 0 {
		errs.add("nodeZone", "%q is not a zone label value: %s", c.NodeZone, strings.Join(p, "; "))
	}

	if len(f.Interfaces) == 0 {
		errs.add("interfaces", "at least one interface is required")
	}
	firstFrame := -1 // the first interface with a valid frame size
	for i := range f.Interfaces {
		in, frameOK := f.Interfaces[i].convert(fmt.Sprintf("interfaces[%d]", i), h, errs)
		for j := range i {
			if in.Name != "" && in.Name == c.Interfaces[j].Name {
				errs.add(fmt.Sprintf("interfaces[%d].name", i), "%q listed twice", in.Name)
				break
			}
		}
		if fs := in.Socket.FrameSize; frameOK {
			if firstFrame < 0 {
				firstFrame = i
			} else if first := c.Interfaces[firstFrame].Socket.FrameSize; fs != first {
				errs.add(fmt.Sprintf("interfaces[%d].frameSize", i),
					"%d differs from interfaces[%d].frameSize %d; every interface must use the same frame size", fs, firstFrame, first)
			}
		}
		c.Interfaces = append(c.Interfaces, in)
	}

	c.ExceptionInterface = f.ExceptionInterface
	if c.ExceptionInterface == "" {
		c.ExceptionInterface = DefaultExceptionInterface
	}
	if checkIfName("exceptionInterface", c.ExceptionInterface, errs) {
		for i, in := range c.Interfaces {
			if in.Name == c.ExceptionInterface {
				errs.add("exceptionInterface", "%q is also interfaces[%d].name; name a device xdproxy may create", in.Name, i)
			}
		}
	}

	c.Services = f.Services.convert(errs)

	for s := range strings.SplitSeq(f.ClusterCIDR, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if p, err := netip.ParsePrefix(s); err != nil {
			errs.add("clusterCIDR", "%q is not a CIDR", s)
		} else {
			c.ClusterCIDRs = append(c.ClusterCIDRs, p.Masked())
		}
	}
	for i, s := range f.NodePortAddresses {
		if p, err := netip.ParsePrefix(s); err != nil {
			errs.add(fmt.Sprintf("nodePortAddresses[%d]", i), "%q is not a CIDR", s)
		} else {
			c.NodePortAddresses = append(c.NodePortAddresses, p.Masked())
		}
	}

	c.Masquerade = f.Masquerade.convert(errs)
	c.Conntrack = f.Conntrack.convert(errs)

	c.Scheduler = DefaultScheduler
	if f.Scheduler != "" {
		if s, ok := schedulers[f.Scheduler]; ok {
			c.Scheduler = s
		} else {
			errs.add("scheduler", "%q: want random, roundrobin or maglev", f.Scheduler)
		}
	}

	c.MetricsAddress = addrPort("metricsAddress", f.MetricsAddress, DefaultMetricsAddress, errs)
	c.HealthzAddress = addrPort("healthzAddress", f.HealthzAddress, DefaultHealthzAddress, errs)
	if c.MetricsAddress.IsValid() && c.MetricsAddress == c.HealthzAddress && c.MetricsAddress.Port() != 0 {
		errs.add("healthzAddress", "%s is also metricsAddress", c.HealthzAddress)
	}

	c.AdminSocket = f.AdminSocket
	if c.AdminSocket == "" {
		c.AdminSocket = DefaultAdminSocket
	}
	if n := len(c.AdminSocket); n > maxUnixPathLen {
		errs.add("adminSocket", "%q is %d bytes long; a unix socket path holds at most %d", c.AdminSocket, n, maxUnixPathLen)
	}
	c.StateDir = absDir("stateDir", f.StateDir, DefaultStateDir, errs)
	c.BPFFSDir = absDir("bpffsDir", f.BPFFSDir, DefaultBPFFSDir, errs)
	c.LocalClients.Enabled = f.LocalClients.Enabled == nil || *f.LocalClients.Enabled
	if c.LocalClients.Enabled {
		c.LocalClients.Cgroup = absDir("localClients.cgroup", f.LocalClients.Cgroup, "", errs)
	} else if f.LocalClients.Cgroup != "" {
		errs.add("localClients.cgroup", "set while localClients.enabled is false")
	}

	c.BatchSize = orDefault(f.BatchSize, DefaultBatchSize)
	if c.BatchSize < 1 || c.BatchSize > maxBatchSize {
		errs.add("batchSize", "%d out of range 1-%d", c.BatchSize, maxBatchSize)
	}
	c.XDPTables = XDPTables{
		MaxFrontends: tableSize("xdpTables.maxFrontends", f.XDPTables.MaxFrontends, xdp.DefaultMaxFrontends, errs),
		MaxAddresses: tableSize("xdpTables.maxAddresses", f.XDPTables.MaxAddresses, xdp.DefaultMaxAddrs, errs),
	}
	c.Benchmark = f.Benchmark.convert(errs)
	return c
}

func (f *fileBenchmark) convert(errs *Errors) Benchmark {
	b := Benchmark{IOFloor: f.IOFloor}
	if f.IOFloorPeer != "" {
		if a, err := netip.ParseAddr(f.IOFloorPeer); err != nil || a.Zone() != "" {
			errs.add("benchmark.ioFloorPeer", "%q is not an IP address", f.IOFloorPeer)
		} else {
			b.IOFloorPeer = a.Unmap()
		}
	}
	switch {
	case b.IOFloor && f.IOFloorPeer == "":
		errs.add("benchmark.ioFloorPeer", "required with ioFloor: the address whose next hop every frame goes to")
	case !b.IOFloor && f.IOFloorPeer != "":
		errs.add("benchmark.ioFloorPeer", "set while benchmark.ioFloor is false")
	}
	return b
}

var (
	schedulers = map[string]service.Scheduler{"random": service.Random, "roundrobin": service.RoundRobin, "maglev": service.Maglev}
	xdpModes   = map[string]xdp.Mode{"auto": xdp.Auto, "native": xdp.Native, "generic": xdp.Generic}
	bindModes  = map[string]afxdp.BindMode{"auto": afxdp.Auto, "copy": afxdp.Copy, "zerocopy": afxdp.ZeroCopy}
)

// convert also says whether the frame size is valid, for the comparison of
// frame sizes across interfaces.
func (f *fileInterface) convert(path string, h Host, errs *Errors) (_ Interface, frameOK bool) {
	in := Interface{Name: f.Name, XDPMode: xdp.Auto, BindMode: afxdp.Auto}
	checkIfName(path+".name", f.Name, errs)

	if f.Queues != nil {
		if len(f.Queues) == 0 {
			errs.add(path+".queues", "empty; leave it out to serve every RX queue")
		}
		in.Queues = make([]int, 0, len(f.Queues))
	}
	for j, q := range f.Queues {
		field := fmt.Sprintf("%s.queues[%d]", path, j)
		switch {
		case q < 0 || q > maxQueue:
			errs.add(field, "%d out of range 0-%d", q, maxQueue)
		case slices.Contains(f.Queues[:j], q):
			errs.add(field, "queue %d listed twice", q)
		}
		in.Queues = append(in.Queues, q)
	}

	if f.CPUs != nil {
		if len(f.CPUs) == 0 {
			errs.add(path+".cpus", "empty; leave it out to use every CPU xdproxy may run on")
		}
		in.CPUs = make([]int, 0, len(f.CPUs))
	}
	for j, cpu := range f.CPUs {
		field := fmt.Sprintf("%s.cpus[%d]", path, j)
		if cpu < 0 {
			errs.add(field, "%d is not a CPU number", cpu)
		} else if p := h.checkCPU(cpu); p != "" {
			errs.add(field, "%s", p)
		}
		in.CPUs = append(in.CPUs, cpu)
	}

	if f.XDPMode != "" {
		if m, ok := xdpModes[f.XDPMode]; ok {
			in.XDPMode = m
		} else {
			errs.add(path+".xdpMode", "%q: want native, generic or auto", f.XDPMode)
		}
	}
	if f.BindMode != "" {
		if m, ok := bindModes[f.BindMode]; ok {
			in.BindMode = m
		} else {
			errs.add(path+".bindMode", "%q: want copy, zerocopy or auto", f.BindMode)
		}
	}

	d := afxdp.DefaultConfig()
	in.Socket = afxdp.Config{
		NumFrames:          orDefault(f.NumFrames, d.NumFrames),
		FrameSize:          orDefault(f.FrameSize, d.FrameSize),
		FillRingSize:       orDefault(f.FillRingSize, d.FillRingSize),
		CompletionRingSize: orDefault(f.CompletionRingSize, d.CompletionRingSize),
		RxRingSize:         orDefault(f.RxRingSize, d.RxRingSize),
		TxRingSize:         orDefault(f.TxRingSize, d.TxRingSize),
		Mode:               in.BindMode,
		NeedWakeup:         true,
	}
	bad := checkSocket(path, in.Socket, errs)
	return in, !bad["FrameSize"]
}

// socketFields maps afxdp.Config's field names, which its Validate errors
// start with, to the file's.
var socketFields = map[string]string{
	"NumFrames": "numFrames", "FrameSize": "frameSize", "FillRingSize": "fillRingSize",
	"CompletionRingSize": "completionRingSize", "RxRingSize": "rxRingSize", "TxRingSize": "txRingSize",
	"Mode": "bindMode",
}

var socketFieldNames = func() *strings.Replacer {
	var r []string
	for g, f := range socketFields {
		r = append(r, g, f)
	}
	return strings.NewReplacer(r...)
}()

// checkSocket reports every problem afxdp.Config.Validate finds in sc, each
// under the file's field path. Validate stops at the first problem, so each
// reported field is replaced by a value Validate accepts and the check runs
// again, until it passes or names a field a second time. It returns the
// fields reported, by their afxdp.Config names.
func checkSocket(path string, sc afxdp.Config, errs *Errors) (reported map[string]bool) {
	reported = map[string]bool{}
	for range len(socketFields) + 1 {
		err := sc.Validate()
		if err == nil {
			return reported
		}
		msg := strings.TrimPrefix(err.Error(), afxdp.ErrInvalidConfig.Error()+": ")
		goName, problem, _ := strings.Cut(msg, " ")
		field, ok := socketFields[goName]
		if !ok || reported[goName] {
			if !ok {
				errs.add(path, "%s", msg)
			}
			return reported
		}
		reported[goName] = true
		errs.add(path+"."+field, "%s", socketFieldNames.Replace(problem))
		d := afxdp.DefaultConfig()
		switch goName {
		case "NumFrames":
			// Big enough for every ring, so that the rings are not also
			// reported as larger than a number of frames that is wrong.
			sc.NumFrames = d.NumFrames
			for _, r := range []int{sc.FillRingSize, sc.CompletionRingSize, sc.RxRingSize, sc.TxRingSize} {
				if r > sc.NumFrames && r&(r-1) == 0 {
					sc.NumFrames = r
				}
			}
		case "FrameSize":
			sc.FrameSize = d.FrameSize
		case "FillRingSize":
			sc.FillRingSize = 1
		case "CompletionRingSize":
			sc.CompletionRingSize = 1
		case "RxRingSize":
			sc.RxRingSize = 1
		case "TxRingSize":
			sc.TxRingSize = 1
		case "Mode":
			sc.Mode = afxdp.Auto
		}
	}
	return reported
}

// checkIfName checks a network device name the way the kernel's
// dev_valid_name does, and reports whether it is valid.
func checkIfName(field, name string, errs *Errors) bool {
	switch {
	case name == "":
		errs.add(field, "required")
	case len(name) > maxIfNameLen:
		errs.add(field, "%q is longer than %d characters", name, maxIfNameLen)
	case name == "." || name == ".." || strings.ContainsAny(name, "/: \t\n\v\f\r\x00"):
		errs.add(field, "%q is not a valid interface name", name)
	default:
		return true
	}
	return false
}

func (f *fileServices) convert(errs *Errors) Services {
	s := Services{File: f.File}
	switch {
	case f.File == "" && f.Kubernetes == nil:
		errs.add("services", "set either file or kubernetes")
	case f.File != "" && f.Kubernetes != nil:
		errs.add("services", "set only one of file and kubernetes")
	}
	fk := f.Kubernetes
	if fk == nil {
		return s
	}
	const p = "services.kubernetes."
	k := &Kubernetes{
		Kubeconfig:    fk.Kubeconfig,
		APIServer:     strings.TrimSuffix(fk.APIServer, "/"),
		QPS:           orDefault(fk.QPS, float32(kubesource.DefaultQPS)),
		Burst:         orDefault(fk.Burst, kubesource.DefaultBurst),
		MinSyncPeriod: orDefaultDuration(fk.MinSyncPeriod, kubesource.DefaultMinSyncPeriod),
		MaxSyncPeriod: orDefaultDuration(fk.MaxSyncPeriod, kubesource.DefaultMaxSyncPeriod),
		ProxyName:     fk.ProxyName,
	}
	if fk.APIServer != "" && !isAPIServerURL(fk.APIServer) {
		errs.add(p+"apiServer", "%q: want https://host:port", fk.APIServer)
	}
	if !(k.QPS > 0) {
		errs.add(p+"qps", "%v must be positive", k.QPS)
	}
	if k.Burst < 1 {
		errs.add(p+"burst", "%d must be at least 1", k.Burst)
	}
	if k.MinSyncPeriod < 0 {
		errs.add(p+"minSyncPeriod", "%v must not be negative", k.MinSyncPeriod)
	}
	if k.MaxSyncPeriod <= 0 {
		errs.add(p+"maxSyncPeriod", "%v must be positive", k.MaxSyncPeriod)
	} else if k.MinSyncPeriod > k.MaxSyncPeriod {
		errs.add(p+"minSyncPeriod", "%v is longer than maxSyncPeriod %v", k.MinSyncPeriod, k.MaxSyncPeriod)
	}
	if k.ProxyName == "" {
		k.ProxyName = k8sconv.DefaultProxyName
	} else if v := validation.IsValidLabelValue(k.ProxyName); len(v) > 0 {
		errs.add(p+"proxyName", "%q is not a label value: %s", k.ProxyName, strings.Join(v, "; "))
	}
	s.Kubernetes = k
	return s
}

// isAPIServerURL accepts https://host:port and nothing more (a trailing
// slash aside).
func isAPIServerURL(s string) bool {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "https" || u.User != nil || u.RawQuery != "" || u.Fragment != "" ||
		u.Opaque != "" || (u.Path != "" && u.Path != "/") {
		return false
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || host == "" {
		return false
	}
	n, err := strconv.ParseUint(port, 10, 16)
	return err == nil && n > 0
}

func (f *fileMasquerade) convert(errs *Errors) Masquerade {
	m := Masquerade{Ports: DefaultPorts, All: f.All, ReservePorts: f.ReservePorts}
	if f.Address != "" {
		if a, err := netip.ParseAddr(f.Address); err != nil || a.Zone() != "" {
			errs.add("masquerade.address", "%q is not an IP address", f.Address)
		} else {
			m.Address = a.Unmap()
		}
	}
	if f.PortRange != "" {
		if r, err := parsePortRange(f.PortRange); err != nil {
			errs.add("masquerade.portRange", "%v", err)
		} else {
			m.Ports = r
		}
	}
	return m
}

// parsePortRange reads "min-max", inclusive.
func parsePortRange(s string) (conntrack.PortRange, error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		return conntrack.PortRange{}, fmt.Errorf("%q: want min-max", s)
	}
	l, err1 := strconv.ParseUint(strings.TrimSpace(a), 10, 16)
	h, err2 := strconv.ParseUint(strings.TrimSpace(b), 10, 16)
	if err1 != nil || err2 != nil || l == 0 || l > h {
		return conntrack.PortRange{}, fmt.Errorf("%q: want min-max with 1 <= min <= max <= 65535", s)
	}
	if h-l+1 < minPorts {
		return conntrack.PortRange{}, fmt.Errorf("%q holds fewer than %d ports", s, minPorts)
	}
	return conntrack.PortRange{First: uint16(l), Last: uint16(h)}, nil
}

func (f *fileConntrack) convert(errs *Errors) Conntrack {
	c := Conntrack{MaxEntries: orDefault(f.MaxEntries, DefaultMaxEntries), SYNGuard: f.SYNGuard == nil || *f.SYNGuard}
	if c.MaxEntries < minMaxEntries {
		errs.add("conntrack.maxEntries", "%d is below the minimum of %d", c.MaxEntries, minMaxEntries)
	} else if c.MaxEntries > conntrack.MaxCapacity {
		errs.add("conntrack.maxEntries", "%d is above the maximum of %d", c.MaxEntries, conntrack.MaxCapacity)
	}
	timeout := func(name string, p *duration, def time.Duration) time.Duration {
		if p == nil {
			return def
		}
		if p.Duration <= 0 {
			errs.add("conntrack."+name, "%v must be positive", p.Duration)
		}
		return p.Duration
	}
	t := &c.Timeouts
	*t = DefaultTimeouts // fields the file cannot set keep their defaults
	for _, x := range []struct {
		name string
		p    *duration
		v    *time.Duration
	}{
		{"tcpSynSentTimeout", f.TCPSynSent, &t.TCPSynSent},
		{"tcpSynRecvTimeout", f.TCPSynRecv, &t.TCPSynRecv},
		{"tcpEstablishedTimeout", f.TCPEstablished, &t.TCPEstablished},
		{"tcpFinWaitTimeout", f.TCPFinWait, &t.TCPFinWait},
		{"tcpCloseWaitTimeout", f.TCPCloseWait, &t.TCPCloseWait},
		{"tcpLastAckTimeout", f.TCPLastAck, &t.TCPLastAck},
		{"tcpTimeWaitTimeout", f.TCPTimeWait, &t.TCPTimeWait},
		{"tcpCloseTimeout", f.TCPClose, &t.TCPClose},
		{"udpTimeout", f.UDPUnreplied, &t.UDPUnreplied},
		{"udpStreamTimeout", f.UDPReplied, &t.UDPReplied},
		{"icmpTimeout", f.ICMP, &t.ICMPEcho},
	} {
		*x.v = timeout(x.name, x.p, *x.v)
	}
	c.FragmentTimeout = timeout("fragmentTimeout", f.FragmentTimeout, 0)
	if f.FragmentMaxEntries != nil {
		c.FragmentMaxEntries = *f.FragmentMaxEntries
		if c.FragmentMaxEntries < 1 {
			errs.add("conntrack.fragmentMaxEntries", "%d must be at least 1", c.FragmentMaxEntries)
		}
	}
	return c
}

func addrPort(field, s, def string, errs *Errors) netip.AddrPort {
	if s == "" {
		s = def
	}
	a, err := netip.ParseAddrPort(s)
	if err != nil {
		errs.add(field, "%q is not host:port (%v)", s, err)
	}
	return a
}

func absDir(field, s, def string, errs *Errors) string {
	if s == "" {
		return def
	}
	if !filepath.IsAbs(s) {
		errs.add(field, "%q is not an absolute path", s)
	}
	return filepath.Clean(s)
}

func tableSize(field string, p *int, def int, errs *Errors) int {
	n := orDefault(p, def)
	if n < 1 || n > maxTableSize {
		errs.add(field, "%d out of range 1-%d", n, maxTableSize)
	}
	return n
}
