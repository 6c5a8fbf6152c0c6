package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/client-go/rest"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// startEngine starts the dataplane on the real kernel as the config says.
func startEngine(cfg *config.Config, host config.Host, log *slog.Logger) (*dataplane.Engine, error) {
	ecfg, err := engineConfig(cfg, host, log)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, in := range cfg.Interfaces {
		names = append(names, in.Name)
	}
	pins, err := pinDir(cfg.BPFFSDir, log)
	if err != nil {
		return nil, err
	}
	// The XDP flow table holds one reply tuple per tracked connection,
	// with room for the tuples of ended ones not yet deleted: under churn
	// (a flood evicting flows as fast as they come) deletions lag behind
	// evictions, so the room is generous.
	xo := xdp.Options{MaxFrontends: cfg.XDPTables.MaxFrontends, MaxAddrs: cfg.XDPTables.MaxAddresses,
		MaxFlows: flowTableSize(cfg.Conntrack.MaxEntries), PinDir: pins}
	ko := dataplane.KernelOptions{Interfaces: names, Tables: xo, Log: log}
	if cfg.LocalClients.Enabled {
		if ecfg.LocalClientsCgroup = cfg.LocalClients.Cgroup; ecfg.LocalClientsCgroup == "" {
			if ecfg.LocalClientsCgroup, err = cgroup2Root(); err != nil {
				return nil, fmt.Errorf("localClients: %w", err)
			}
		}
		ko.LocalClients = &socklb.Options{MaxFrontends: cfg.XDPTables.MaxFrontends}
	}
	if ecfg.Kernel, err = dataplane.NewKernel(ko); err != nil {
		return nil, err
	}
	return dataplane.Start(ecfg)
}

// cgroup2Root finds where the cgroup v2 hierarchy is mounted
// (/sys/fs/cgroup on a unified system, /sys/fs/cgroup/unified on a hybrid
// one): its root holds every process on the node.
func cgroup2Root() (string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		// ... mount-point options - fstype source super-options
		pre, post, ok := strings.Cut(line, " - ")
		if !ok || !strings.HasPrefix(post, "cgroup2 ") {
			continue
		}
		if f := strings.Fields(pre); len(f) >= 5 {
			return f[4], nil
		}
	}
	return "", errors.New("no cgroup2 mount in /proc/self/mountinfo; set localClients.cgroup or localClients.enabled: false")
}

// flowTableSize is the XDP flow table's size for a connection table of n
// flows: twice as many, and at least 64Ki more.
func flowTableSize(n int) int { return max(2*n, n+1<<16) }

// engineConfig maps the configuration onto the dataplane's settings. host
// gives the CPUs of interfaces that name none.
func engineConfig(cfg *config.Config, host config.Host, log *slog.Logger) (dataplane.EngineConfig, error) {
	ct := cfg.Conntrack
	e := dataplane.EngineConfig{
		BatchSize: cfg.BatchSize, BusyPoll: cfg.BusyPoll, Log: log,
		SNATPorts:          cfg.Masquerade.Ports,
		ReserveSNATPorts:   cfg.Masquerade.ReservePorts,
		ExceptionInterface: cfg.ExceptionInterface,
		StateDir:           cfg.StateDir,
		KeepState:          true,
		Conntrack: conntrack.Config{Capacity: ct.MaxEntries, Timeouts: ct.Timeouts,
			FragmentCapacity: ct.FragmentMaxEntries, FragmentTimeout: ct.FragmentTimeout},
		SYNGuard: dataplane.SYNGuardConfig{Disabled: !ct.SYNGuard},
	}
	if len(cfg.NodePortAddresses) > 0 {
		// kube-proxy serves NodePorts on localhost only when
		// nodePortAddresses lets the loopback address in.
		e.NoLocalhostNodePorts = true
		for _, p := range cfg.NodePortAddresses {
			if p.Contains(netip.MustParseAddr("127.0.0.1")) {
				e.NoLocalhostNodePorts = false
			}
		}
	}
	if b := cfg.Benchmark; b.IOFloor { // benchmarking only: every frame forwarded untranslated
		e.IOFloor = &dataplane.IOFloor{Peers: []packet.Addr{packet.AddrFromNetip(b.IOFloorPeer)}}
	}
	switch a := cfg.Masquerade.Address; {
	case a.Is4():
		e.SNATAddress4 = packet.AddrFromNetip(a)
	case a.Is6():
		return e, fmt.Errorf("masquerade.address: %s: an IPv4 address only; IPv6 flows are masqueraded to the IPv6 address of the interface they leave by", a)
	}
	for _, in := range cfg.Interfaces {
		// The engine takes nil Queues as every queue, and pins the worker
		// of the i-th queue to CPUs[i%len(CPUs)], as the config means.
		cpus := in.CPUs
		if cpus == nil {
			cpus = host.CPUs // every CPU the process may run on
		}
		e.Interfaces = append(e.Interfaces, dataplane.InterfaceConfig{Name: in.Name, Queues: in.Queues, CPUs: cpus,
			Mode: in.XDPMode, Socket: in.Socket})
	}
	return e, nil
}

// bpfFSMagic is statfs(2)'s f_type of a bpffs.
const bpfFSMagic = 0xcafe4a11

// pinDir makes sure dir is on a bpffs, mounting one at /sys/fs/bpf when
// dir is under it and nothing is mounted there (as on nodes whose init
// system does not). Without a bpffs the XDP programs cannot outlive the
// process: it says so and returns "" (no pinning) rather than fail.
func pinDir(dir string, log *slog.Logger) (string, error) {
	if dir == "" {
		return "", nil
	}
	onBPFFS := func(p string) bool {
		var st unix.Statfs_t
		return unix.Statfs(p, &st) == nil && uint32(st.Type) == bpfFSMagic
	}
	parent := filepath.Dir(dir)
	if !onBPFFS(parent) && parent == "/sys/fs/bpf" {
		if err := unix.Mount("bpffs", parent, "bpf", 0, ""); err != nil {
			log.Warn("no bpffs: XDP programs will not outlive a restart", "dir", parent, "err", err)
			return "", nil
		}
		log.Info("mounted a bpffs", "dir", parent)
	}
	if !onBPFFS(parent) {
		log.Warn("not on a bpffs: XDP programs will not outlive a restart", "bpffsDir", dir)
		return "", nil
	}
	return dir, nil
}

// nodePortListenAddrs are the addresses healthCheckNodePorts listen on:
// those of the served interfaces inside nodePortAddresses, or all.
func nodePortListenAddrs(cfg *config.Config, e *dataplane.Engine) []netip.Addr {
	if len(cfg.NodePortAddresses) == 0 {
		return nil
	}
	var out []netip.Addr
	for _, a := range e.NodeAddresses() {
		for _, p := range cfg.NodePortAddresses {
			if p.Contains(a.Netip()) {
				out = append(out, a.Netip())
				break
			}
		}
	}
	return out
}

// The pod's service account, which rest.InClusterConfig reads too.
const (
	serviceAccountToken = "/var/run/secrets/kubernetes.io/serviceaccount/token"
	serviceAccountCA    = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
)

// restConfig is the API client's configuration: the kubeconfig's, or the
// pod's service account, with apiServer, when set, as the server. Without
// a kubeconfig, apiServer replaces the in-cluster address, the kubernetes
// Service's ClusterIP, which needs a proxy (this one) to reach the API
// server; the credentials stay the service account's.
func restConfig(k *config.Kubernetes) (*rest.Config, error) {
	var rc *rest.Config
	if k.APIServer != "" && k.Kubeconfig == "" {
		if _, err := os.Stat(serviceAccountToken); err != nil {
			return nil, fmt.Errorf("apiServer without kubeconfig needs the pod's service account token: %w", err)
		}
		rc = &rest.Config{Host: k.APIServer, BearerTokenFile: serviceAccountToken,
			TLSClientConfig: rest.TLSClientConfig{CAFile: serviceAccountCA}}
	} else {
		var err error
		if rc, err = kubesource.RESTConfig(k.Kubeconfig, k.QPS, k.Burst); err != nil {
			return nil, err
		}
		if k.APIServer != "" {
			rc.Host = k.APIServer
		}
	}
	rc.QPS, rc.Burst, rc.UserAgent = k.QPS, k.Burst, "xdproxy"
	return rc, nil
}

// Cleanup removes everything xdproxy leaves for its next start: the pinned
// XDP programs and tables (which detaches the programs), the state files,
// the SNAT ports it reserved, the tmpfs xdproxy mount-state-dir mounted,
// the exception link and the admin socket. Run it where xdproxy ran, with
// xdproxy stopped (xdproxy cleanup).
func Cleanup(cfg *config.Config) error {
	var errs []error
	if cfg.BPFFSDir != "" {
		// The socket programs' pins live in a subdirectory (KernelOptions).
		errs = append(errs, socklb.RemovePins(filepath.Join(cfg.BPFFSDir, "socklb")), xdp.RemovePins(cfg.BPFFSDir))
	}
	if cfg.StateDir != "" {
		errs = append(errs, dataplane.ReleaseReservedPorts(cfg.StateDir))
		if err := dataplane.RemoveState(cfg.StateDir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		if err := os.Remove(filepath.Join(cfg.StateDir, lastModelFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		// Last, once its files are gone: the tmpfs xdproxy
		// mount-state-dir made there, if any.
		if _, err := conntrack.UnmountStateDir(cfg.StateDir); err != nil {
			errs = append(errs, err)
		}
	}
	if cfg.ExceptionInterface != "" {
		errs = append(errs, dataplane.RemoveExceptionLink(cfg.ExceptionInterface))
	}
	if err := os.Remove(cfg.AdminSocket); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// MountStateDir mounts a tmpfs with huge pages at the config's state
// directory and says what is there (xdproxy mount-state-dir, run before
// xdproxy run; see conntrack.MountStateDir for why, and for what it leaves
// alone).
func MountStateDir(cfg *config.Config) (string, error) {
	if cfg.StateDir == "" {
		return "", errors.New("the config has no stateDir")
	}
	m, err := conntrack.MountStateDir(cfg.StateDir)
	if err != nil {
		return "", err
	}
	s := fmt.Sprintf("%s: %s", cfg.StateDir, m)
	if !m.HugePages() {
		s += "; files there get 4 KiB pages, not huge ones"
	}
	return s, nil
}
