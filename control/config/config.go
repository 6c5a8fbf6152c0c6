package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// Config is the whole configuration file.
type Config struct {
	// NodeName is this node's name as the API server knows it; endpoints
	// with the same nodeName are local.
	NodeName string `json:"nodeName"`
	// NodeZone is the node's topology zone, used when no API server
	// provides the Node object.
	NodeZone   string      `json:"nodeZone,omitempty"`
	Interfaces []Interface `json:"interfaces"`
	Services   Services    `json:"services"`
	// ClusterCIDR lists the pod CIDRs (comma separated for dual-stack).
	// ClusterIP traffic from outside them is masqueraded, as in kube-proxy.
	ClusterCIDR string `json:"clusterCIDR,omitempty"`
	// NodePortAddresses are the CIDRs whose node addresses accept
	// NodePorts; empty means every address of the xdproxy interfaces.
	NodePortAddresses []string   `json:"nodePortAddresses,omitempty"`
	Masquerade        Masquerade `json:"masquerade"`
	Conntrack         Conntrack  `json:"conntrack"`
	// Scheduler is the default backend selection: random (kube-proxy's),
	// roundrobin or maglev.
	Scheduler      string `json:"scheduler,omitempty"`
	MetricsAddress string `json:"metricsAddress,omitempty"`
	HealthzAddress string `json:"healthzAddress,omitempty"`
	AdminSocket    string `json:"adminSocket,omitempty"`
	// BusyPoll makes workers spin on empty rings instead of sleeping in
	// poll(): lower latency, one full core per worker.
	BusyPoll bool `json:"busyPoll,omitempty"`
	// BatchSize is the number of frames a worker handles per batch.
	BatchSize int `json:"batchSize,omitempty"`
	// XDPTables sizes the XDP program's maps, which the kernel allocates
	// up front.
	XDPTables XDPTables `json:"xdpTables,omitempty"`
}

// XDPTables sizes the XDP program's maps. Zero fields take the defaults.
type XDPTables struct {
	// MaxFrontends bounds frontends (service IP:port pairs, NodePorts on
	// every node address included).
	MaxFrontends int `json:"maxFrontends,omitempty"`
	// MaxBackends bounds distinct endpoint IP:port pairs.
	MaxBackends int `json:"maxBackends,omitempty"`
	// MaxAddresses bounds distinct addresses: VIPs, endpoints and node
	// addresses together.
	MaxAddresses int `json:"maxAddresses,omitempty"`
}

// Interface is one NIC (or veth) that xdproxy attaches to.
type Interface struct {
	Name string `json:"name"`
	// Queues are the RX queue indexes to serve; one worker each.
	Queues []int `json:"queues"`
	// CPUs pins each queue's worker: CPUs[i] for Queues[i].
	CPUs []int `json:"cpus"`
	// XDPMode is native, generic or auto (native, falling back to generic).
	XDPMode            string `json:"xdpMode,omitempty"`
	FrameSize          int    `json:"frameSize,omitempty"`
	NumFrames          int    `json:"numFrames,omitempty"`
	RxRingSize         int    `json:"rxRingSize,omitempty"`
	TxRingSize         int    `json:"txRingSize,omitempty"`
	FillRingSize       int    `json:"fillRingSize,omitempty"`
	CompletionRingSize int    `json:"completionRingSize,omitempty"`
	// ZeroCopy asks for zero-copy binding (copy, zerocopy or auto).
	BindMode string `json:"bindMode,omitempty"`
}

// Services says where services come from: exactly one of File and
// Kubernetes.
type Services struct {
	File       string      `json:"file,omitempty"`
	Kubernetes *Kubernetes `json:"kubernetes,omitempty"`
}

// Kubernetes configures the API-server source.
type Kubernetes struct {
	// Kubeconfig is a kubeconfig path; empty means in-cluster config.
	Kubeconfig    string   `json:"kubeconfig,omitempty"`
	QPS           float32  `json:"qps,omitempty"`
	Burst         int      `json:"burst,omitempty"`
	MinSyncPeriod Duration `json:"minSyncPeriod,omitempty"`
	MaxSyncPeriod Duration `json:"maxSyncPeriod,omitempty"`
	// ProxyName is the service.kubernetes.io/service-proxy-name this
	// proxy answers to; services naming any other proxy are skipped.
	ProxyName string `json:"proxyName,omitempty"`
}

// Masquerade configures SNAT.
type Masquerade struct {
	// Address is the source address of masqueraded traffic; empty means
	// the first address of the egress interface.
	Address string `json:"address,omitempty"`
	// PortRange is "min-max", inclusive.
	PortRange string `json:"portRange,omitempty"`
	// All masquerades every service flow (kube-proxy's masqueradeAll).
	All bool `json:"all,omitempty"`
}

// Conntrack configures connection tracking.
type Conntrack struct {
	MaxEntries          int      `json:"maxEntries,omitempty"`
	TCPSynSent          Duration `json:"tcpSynSentTimeout,omitempty"`
	TCPSynRecv          Duration `json:"tcpSynRecvTimeout,omitempty"`
	TCPEstablished      Duration `json:"tcpEstablishedTimeout,omitempty"`
	TCPFinWait          Duration `json:"tcpFinWaitTimeout,omitempty"`
	TCPCloseWait        Duration `json:"tcpCloseWaitTimeout,omitempty"`
	TCPLastAck          Duration `json:"tcpLastAckTimeout,omitempty"`
	TCPTimeWait         Duration `json:"tcpTimeWaitTimeout,omitempty"`
	TCPClose            Duration `json:"tcpCloseTimeout,omitempty"`
	UDPUnreplied        Duration `json:"udpTimeout,omitempty"`
	UDPReplied          Duration `json:"udpStreamTimeout,omitempty"`
	ICMP                Duration `json:"icmpTimeout,omitempty"`
	FragmentTimeout     Duration `json:"fragmentTimeout,omitempty"`
	FragmentTableMaxLen int      `json:"fragmentMaxEntries,omitempty"`
}

// Duration is a time.Duration written as a Go duration string ("30s").
type Duration struct{ time.Duration }

// UnmarshalJSON accepts "1m30s" or a number of seconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("not a duration: %q", s)
		}
		d.Duration = v
		return nil
	}
	var secs float64
	if err := json.Unmarshal(b, &secs); err != nil {
		return fmt.Errorf("not a duration: %s", b)
	}
	d.Duration = time.Duration(secs * float64(time.Second))
	return nil
}

// MarshalJSON writes the duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// Load reads, defaults and validates the file at path.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	c, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes, defaults and validates a configuration.
func Parse(b []byte) (*Config, error) {
	var c Config
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return nil, fmt.Errorf("decoding: %w", cleanYAMLError(err))
	}
	c.applyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

func cleanYAMLError(err error) error {
	s := strings.TrimPrefix(err.Error(), "error unmarshaling JSON: while decoding JSON: ")
	return errors.New(s)
}

// Defaults for fields the file leaves out.
const (
	DefaultFrameSize      = 2048
	DefaultNumFrames      = 4096
	DefaultRingSize       = 2048
	DefaultPortRange      = "32768-60999"
	DefaultMaxConntrack   = 262144
	DefaultBatchSize      = 64
	DefaultMetricsAddress = "127.0.0.1:10249"
	DefaultHealthzAddress = "0.0.0.0:10256"
	DefaultAdminSocket    = "/run/xdproxy/admin.sock"
)

func (c *Config) applyDefaults() {
	for i := range c.Interfaces {
		in := &c.Interfaces[i]
		def := func(v *int, d int) {
			if *v == 0 {
				*v = d
			}
		}
		def(&in.FrameSize, DefaultFrameSize)
		def(&in.NumFrames, DefaultNumFrames)
		def(&in.RxRingSize, DefaultRingSize)
		def(&in.TxRingSize, DefaultRingSize)
		def(&in.FillRingSize, DefaultRingSize)
		def(&in.CompletionRingSize, DefaultRingSize)
		if in.XDPMode == "" {
			in.XDPMode = "auto"
		}
		if in.BindMode == "" {
			in.BindMode = "auto"
		}
		if len(in.Queues) == 0 {
			in.Queues = []int{0}
		}
	}
	if c.Masquerade.PortRange == "" {
		c.Masquerade.PortRange = DefaultPortRange
	}
	if c.Conntrack.MaxEntries == 0 {
		c.Conntrack.MaxEntries = DefaultMaxConntrack
	}
	if c.Scheduler == "" {
		c.Scheduler = "random"
	}
	if c.MetricsAddress == "" {
		c.MetricsAddress = DefaultMetricsAddress
	}
	if c.HealthzAddress == "" {
		c.HealthzAddress = DefaultHealthzAddress
	}
	if c.AdminSocket == "" {
		c.AdminSocket = DefaultAdminSocket
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if k := c.Services.Kubernetes; k != nil {
		if k.QPS == 0 {
			k.QPS = 50
		}
		if k.Burst == 0 {
			k.Burst = 100
		}
		if k.MinSyncPeriod.Duration == 0 {
			k.MinSyncPeriod.Duration = time.Second
		}
		if k.MaxSyncPeriod.Duration == 0 {
			k.MaxSyncPeriod.Duration = time.Hour
		}
		if k.ProxyName == "" {
			k.ProxyName = "xdproxy"
		}
	}
}

// fieldErrors collects "field: problem" messages.
type fieldErrors []string

func (e *fieldErrors) add(field, format string, args ...any) {
	*e = append(*e, field+": "+fmt.Sprintf(format, args...))
}

func isPow2(n int) bool { return n > 0 && n&(n-1) == 0 }

// Validate checks every field and reports all problems at once.
func (c *Config) Validate() error {
	var errs fieldErrors
	if c.NodeName == "" {
		errs.add("nodeName", "required")
	}
	if len(c.Interfaces) == 0 {
		errs.add("interfaces", "at least one interface is required")
	}
	seenIf := map[string]bool{}
	for i, in := range c.Interfaces {
		f := fmt.Sprintf("interfaces[%d]", i)
		if in.Name == "" {
			errs.add(f+".name", "required")
		} else if len(in.Name) > 15 {
			errs.add(f+".name", "%q is longer than 15 characters", in.Name)
		} else if seenIf[in.Name] {
			errs.add(f+".name", "%q listed twice", in.Name)
		}
		seenIf[in.Name] = true
		if len(in.CPUs) != len(in.Queues) {
			errs.add(f+".cpus", "%d CPUs for %d queues; name one CPU per queue", len(in.CPUs), len(in.Queues))
		}
		seenQ := map[int]bool{}
		for j, q := range in.Queues {
			if q < 0 || q > 1023 {
				errs.add(fmt.Sprintf("%s.queues[%d]", f, j), "%d out of range 0-1023", q)
			}
			if seenQ[q] {
				errs.add(fmt.Sprintf("%s.queues[%d]", f, j), "queue %d listed twice", q)
			}
			seenQ[q] = true
		}
		for j, cpu := range in.CPUs {
			if cpu < 0 || cpu >= 4096 {
				errs.add(fmt.Sprintf("%s.cpus[%d]", f, j), "%d is not a CPU number", cpu)
			}
		}
		switch in.XDPMode {
		case "native", "generic", "auto":
		default:
			errs.add(f+".xdpMode", "%q: want native, generic or auto", in.XDPMode)
		}
		switch in.BindMode {
		case "copy", "zerocopy", "auto":
		default:
			errs.add(f+".bindMode", "%q: want copy, zerocopy or auto", in.BindMode)
		}
		if in.FrameSize != 2048 && in.FrameSize != 4096 {
			errs.add(f+".frameSize", "%d: want 2048 or 4096", in.FrameSize)
		}
		for _, r := range []struct {
			name string
			v    int
		}{{"numFrames", in.NumFrames}, {"rxRingSize", in.RxRingSize}, {"txRingSize", in.TxRingSize},
			{"fillRingSize", in.FillRingSize}, {"completionRingSize", in.CompletionRingSize}} {
			if !isPow2(r.v) {
				errs.add(f+"."+r.name, "%d is not a power of two", r.v)
			} else if r.name != "numFrames" && r.v > in.NumFrames {
				errs.add(f+"."+r.name, "%d is larger than numFrames (%d)", r.v, in.NumFrames)
			}
		}
	}
	switch {
	case c.Services.File == "" && c.Services.Kubernetes == nil:
		errs.add("services", "set either file or kubernetes")
	case c.Services.File != "" && c.Services.Kubernetes != nil:
		errs.add("services", "set only one of file and kubernetes")
	}
	if k := c.Services.Kubernetes; k != nil {
		if k.QPS < 0 {
			errs.add("services.kubernetes.qps", "must not be negative")
		}
		if k.Burst < 0 {
			errs.add("services.kubernetes.burst", "must not be negative")
		}
		if k.MinSyncPeriod.Duration > k.MaxSyncPeriod.Duration {
			errs.add("services.kubernetes.minSyncPeriod", "%v is longer than maxSyncPeriod %v", k.MinSyncPeriod, k.MaxSyncPeriod)
		}
	}
	if _, err := c.ClusterCIDRs(); err != nil {
		errs.add("clusterCIDR", "%v", err)
	}
	for i, s := range c.NodePortAddresses {
		if _, err := netip.ParsePrefix(s); err != nil {
			errs.add(fmt.Sprintf("nodePortAddresses[%d]", i), "%q is not a CIDR", s)
		}
	}
	if c.Masquerade.Address != "" {
		if _, err := netip.ParseAddr(c.Masquerade.Address); err != nil {
			errs.add("masquerade.address", "%q is not an IP address", c.Masquerade.Address)
		}
	}
	if _, _, err := c.PortRange(); err != nil {
		errs.add("masquerade.portRange", "%v", err)
	}
	if c.Conntrack.MaxEntries < 1024 {
		errs.add("conntrack.maxEntries", "%d is below the minimum of 1024", c.Conntrack.MaxEntries)
	}
	switch c.Scheduler {
	case "random", "roundrobin", "maglev":
	default:
		errs.add("scheduler", "%q: want random, roundrobin or maglev", c.Scheduler)
	}
	for _, t := range []struct {
		name string
		v    int
	}{{"maxFrontends", c.XDPTables.MaxFrontends}, {"maxBackends", c.XDPTables.MaxBackends}, {"maxAddresses", c.XDPTables.MaxAddresses}} {
		if t.v < 0 || t.v > 1<<24 {
			errs.add("xdpTables."+t.name, "%d out of range 0-16777216", t.v)
		}
	}
	if c.BatchSize < 1 || c.BatchSize > 1024 {
		errs.add("batchSize", "%d out of range 1-1024", c.BatchSize)
	}
	for _, a := range []struct{ name, v string }{{"metricsAddress", c.MetricsAddress}, {"healthzAddress", c.HealthzAddress}} {
		if _, err := netip.ParseAddrPort(a.v); err != nil {
			errs.add(a.name, "%q is not host:port (%v)", a.v, err)
		}
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}

// ClusterCIDRs parses ClusterCIDR.
func (c *Config) ClusterCIDRs() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range strings.Split(c.ClusterCIDR, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR", s)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// PortRange parses Masquerade.PortRange.
func (c *Config) PortRange() (lo, hi uint16, err error) {
	a, b, ok := strings.Cut(c.Masquerade.PortRange, "-")
	if !ok {
		return 0, 0, fmt.Errorf("%q: want min-max", c.Masquerade.PortRange)
	}
	l, err1 := strconv.ParseUint(strings.TrimSpace(a), 10, 16)
	h, err2 := strconv.ParseUint(strings.TrimSpace(b), 10, 16)
	if err1 != nil || err2 != nil || l == 0 || l > h {
		return 0, 0, fmt.Errorf("%q: want min-max with 1 <= min <= max <= 65535", c.Masquerade.PortRange)
	}
	if h-l+1 < 64 {
		return 0, 0, fmt.Errorf("%q holds fewer than 64 ports", c.Masquerade.PortRange)
	}
	return uint16(l), uint16(h), nil
}
