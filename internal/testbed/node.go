package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"
)

// Interface names of the node topology (see NewNode).
const (
	NICName   = "eth0" // every host's and every pod's interface
	CNIBridge = "cni0" // the node's bridge for flannel-style pods
)

// Roles of the hosts on the LAN; in the lan namespace, each host's bridge
// port is named after its role.
const (
	RoleNode   = "node"
	RoleNode2  = "node2"
	RoleClient = "client"
)

// Addresses and ranges of the node topology.
var (
	nodeLAN       = netip.MustParsePrefix("198.18.0.0/24")
	nodeAddr      = netip.MustParseAddr("198.18.0.10")
	node2Addr     = netip.MustParseAddr("198.18.0.20")
	lanClientAddr = netip.MustParseAddr("198.18.0.100")
	podCIDR       = netip.MustParsePrefix("10.244.0.0/16")
	nodePodCIDR   = netip.MustParsePrefix("10.244.1.0/24")
	node2PodCIDR  = netip.MustParsePrefix("10.244.2.0/24")
	cniGateway    = netip.MustParsePrefix("10.244.1.129/25") // cni0
	routedGateway = netip.MustParseAddr("169.254.1.1")       // what routed pods see as their gateway
)

// podSpec is a pod of the node topology.
type podSpec struct {
	name      string
	role      string // RoleNode or RoleNode2
	addr      netip.Addr
	hostIface string
	bridged   bool // on cni0, not a /32 route
}

var nodePods = []podSpec{
	{"pod-a", RoleNode, netip.MustParseAddr("10.244.1.10"), "cali-a", false},
	{"pod-b", RoleNode, netip.MustParseAddr("10.244.1.11"), "cali-b", false},
	{"pod-c", RoleNode, netip.MustParseAddr("10.244.1.130"), "veth-c", true},
	{"n2-pod-a", RoleNode2, netip.MustParseAddr("10.244.2.10"), "cali-a", false},
	{"n2-pod-b", RoleNode2, netip.MustParseAddr("10.244.2.11"), "cali-b", false},
}

// NodeOptions shape a NodeBed. The zero value gives four queues on the
// node's NIC, the kernel's default MTU and rp_filter off.
type NodeOptions struct {
	// Queues is the number of rx and tx queues of the node's eth0 and of
	// its peer on the LAN bridge; 0 means 4, at most 64.
	Queues int
	// MTU of every veth and bridge; 0 keeps the kernel's default.
	MTU int
	// RPFilter is net.ipv4.conf.{all,default}.rp_filter on both nodes:
	// 0 off, 1 strict, 2 loose (the default of Debian and Ubuntu nodes).
	RPFilter int
}

// Pod is a pod's namespace, its eth0 (Host) and how it hangs off its node.
type Pod struct {
	Name string // "pod-a"; its servers answer with this name
	Host        // the pod's eth0

	NodeNS      string           // namespace of the node that hosts it
	HostIface   string           // its veth on the node: "cali-a" (routed) or "veth-c" (a port of cni0)
	HostIfIndex int              // of HostIface
	HostMAC     net.HardwareAddr // of HostIface
	Gateway     netip.Addr       // its default gateway: 169.254.1.1 (routed) or 10.244.1.129 (cni0)
	Bridged     bool             // behind cni0 rather than a /32 route on HostIface
}

// NodeBed is a live node topology (see NewNode). Its methods are safe for
// concurrent use.
type NodeBed struct {
	opts   NodeOptions
	id     string
	lan    string
	node   Host
	node2  Host
	client Host
	port   Host // the node's peer on the LAN bridge
	pods   []Pod
	cgroup string

	mu      sync.Mutex
	closed  bool
	servers []*server
}

// NewNode builds the node topology described in the package documentation.
// On error everything it made is removed again.
func NewNode(opts NodeOptions) (*NodeBed, error) {
	if err := startedAsServer(); err != nil {
		return nil, err
	}
	if opts.Queues == 0 {
		opts.Queues = 4
	}
	if opts.Queues < 0 || opts.Queues > 64 {
		return nil, fmt.Errorf("testbed: %d queues, want 1..64", opts.Queues)
	}
	if opts.RPFilter < 0 || opts.RPFilter > 2 {
		return nil, fmt.Errorf("testbed: rp_filter %d, want 0, 1 or 2", opts.RPFilter)
	}
	id, err := newID()
	if err != nil {
		return nil, err
	}
	nb := &NodeBed{opts: opts, id: id, lan: id + "-lan"}
	nb.node = Host{NS: id + "-" + RoleNode, Iface: NICName, Addr: nodeAddr}
	nb.node2 = Host{NS: id + "-" + RoleNode2, Iface: NICName, Addr: node2Addr}
	nb.client = Host{NS: id + "-" + RoleClient, Iface: NICName, Addr: lanClientAddr}
	nb.port = Host{NS: nb.lan, Iface: RoleNode}
	for _, p := range nodePods {
		pod := Pod{
			Name:      p.name,
			Host:      Host{NS: id + "-" + p.name, Iface: NICName, Addr: p.addr},
			HostIface: p.hostIface,
			Gateway:   routedGateway,
			Bridged:   p.bridged,
		}
		if p.role == RoleNode {
			pod.NodeNS = nb.node.NS
		} else {
			pod.NodeNS = nb.node2.NS
		}
		if p.bridged {
			pod.Gateway = cniGateway.Addr()
		}
		nb.pods = append(nb.pods, pod)
	}
	if err := nb.build(); err != nil {
		return nil, errors.Join(err, nb.Close())
	}
	return nb, nil
}

// NewNodeForTest builds a NodeBed and closes it when the test ends. Without
// root it fails the test (skips it under -short), and it fails it when the
// topology cannot be built.
func NewNodeForTest(t testing.TB, opts NodeOptions) *NodeBed {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("testbed needs root (network namespaces)")
		}
		t.Fatal("testbed needs root (network namespaces); make test runs as root")
	}
	nb, err := NewNode(opts)
	if err != nil {
		t.Fatalf("testbed: %v", err)
	}
	t.Cleanup(func() {
		if err := nb.Close(); err != nil {
			t.Errorf("testbed close: %v", err)
		}
	})
	return nb
}

// ID is the common prefix of this NodeBed's namespace and cgroup names.
func (nb *NodeBed) ID() string { return nb.id }

// Namespaces lists every namespace of the NodeBed.
func (nb *NodeBed) Namespaces() []string {
	ns := []string{nb.lan, nb.node.NS, nb.node2.NS, nb.client.NS}
	for _, p := range nb.pods {
		ns = append(ns, p.NS)
	}
	return ns
}

// LANNS names the namespace that holds the LAN bridge (LANBridge).
func (nb *NodeBed) LANNS() string { return nb.lan }

// NodeNS names the node's namespace, where xdproxy runs.
func (nb *NodeBed) NodeNS() string { return nb.node.NS }

// Node2NS names the second node's namespace.
func (nb *NodeBed) Node2NS() string { return nb.node2.NS }

// ClientNS names the off-cluster client's namespace.
func (nb *NodeBed) ClientNS() string { return nb.client.NS }

// Node is the node's NIC, eth0 198.18.0.10/24.
func (nb *NodeBed) Node() Host { return nb.node }

// NIC names the node's NIC (eth0).
func (nb *NodeBed) NIC() string { return nb.node.Iface }

// Queues is the number of rx and tx queues of the node's NIC and of its
// peer on the LAN.
func (nb *NodeBed) Queues() int { return nb.opts.Queues }

// NodeLANPort is the node NIC's peer: the bridge port "node" in the lan
// namespace. It has Queues tx queues; the one it sends a frame on is the
// rx queue the node receives it on.
func (nb *NodeBed) NodeLANPort() Host { return nb.port }

// Node2 is the second node's NIC, eth0 198.18.0.20/24.
func (nb *NodeBed) Node2() Host { return nb.node2 }

// Client is the off-cluster client's eth0, 198.18.0.100/24.
func (nb *NodeBed) Client() Host { return nb.client }

// Pods lists the pods of both nodes.
func (nb *NodeBed) Pods() []Pod { return append([]Pod(nil), nb.pods...) }

// Pod returns the pod called name ("pod-a", "pod-b", "pod-c", "n2-pod-a",
// "n2-pod-b"). It panics for another name.
func (nb *NodeBed) Pod(name string) Pod {
	for _, p := range nb.pods {
		if p.Name == name {
			return p
		}
	}
	panic(fmt.Sprintf("testbed: no pod %q", name))
}

// LANCIDR is the LAN's prefix, 198.18.0.0/24.
func (nb *NodeBed) LANCIDR() netip.Prefix { return nodeLAN }

// PodCIDR is the cluster's pod range, 10.244.0.0/16.
func (nb *NodeBed) PodCIDR() netip.Prefix { return podCIDR }

// NodePodCIDR is the node's share of PodCIDR, 10.244.1.0/24.
func (nb *NodeBed) NodePodCIDR() netip.Prefix { return nodePodCIDR }

// Node2PodCIDR is the second node's share of PodCIDR, 10.244.2.0/24.
func (nb *NodeBed) Node2PodCIDR() netip.Prefix { return node2PodCIDR }

// CNIBridgePrefix is the address and prefix of the node's cni0,
// 10.244.1.129/25.
func (nb *NodeBed) CNIBridgePrefix() netip.Prefix { return cniGateway }

// ServiceCIDR is where tests put Service addresses, 198.19.0.0/16
// (ClusterIPRange). The client routes it via the node.
func (nb *NodeBed) ServiceCIDR() netip.Prefix { return ClusterIPRange }

// Cgroup is the path of the NodeBed's cgroup v2 directory, which stands in
// for the node's root cgroup: attach cgroup BPF programs here. The servers
// of the node's own pods run in it, those of node2's pods and of the
// client do not (they are other machines). Close kills what runs in it and
// removes it.
func (nb *NodeBed) Cgroup() string { return nb.cgroup }

// Command returns an unstarted "ip netns exec ns args..." command. That
// mounts the namespace's own sysfs over /sys; see Start for a process that
// needs /sys/fs/bpf or the cgroup tree.
func (nb *NodeBed) Command(ns string, args ...string) *exec.Cmd { return CommandIn(ns, args...) }

// Exec runs args in ns with "ip netns exec"; see ExecIn.
func (nb *NodeBed) Exec(ns string, args ...string) ([]byte, error) { return ExecIn(ns, args...) }

// Start starts cmd in ns without touching its mounts; see StartIn.
func (nb *NodeBed) Start(ns string, cmd *exec.Cmd) error { return StartIn(ns, cmd) }

// StartInCgroup starts cmd in ns (as Start does) and inside Cgroup from
// its first instruction, so every socket it opens belongs to the cgroup. It
// sets UseCgroupFD and CgroupFD in cmd.SysProcAttr and keeps the rest.
func (nb *NodeBed) StartInCgroup(ns string, cmd *exec.Cmd) error {
	return startInCgroup(ns, nb.cgroup, cmd)
}

// Do runs fn on a goroutine locked to an OS thread that has entered ns;
// see Testbed.Do.
func (nb *NodeBed) Do(ns string, fn func() error) error { return DoIn(ns, fn) }

// Dial opens a connection from inside ns.
func (nb *NodeBed) Dial(ctx context.Context, ns, network, addr string) (net.Conn, error) {
	return dialIn(ctx, ns, network, addr)
}

// HTTPClient returns an HTTP client whose connections are made in ns, with
// keep-alives off.
func (nb *NodeBed) HTTPClient(ns string, timeout time.Duration) *http.Client {
	return httpClientIn(ns, timeout)
}

// Ping sends one ICMP echo request from ns to dst and waits for the reply.
func (nb *NodeBed) Ping(ns string, dst netip.Addr, timeout time.Duration) error {
	return pingIn(ns, dst, timeout)
}

// StartServers starts the test server (HTTP :80, UDP echo :53, stream
// :5001; see package testserver) in every pod of both nodes, answering
// with the pod's name, and in the client (answering "client"), an
// off-cluster server for the node's own outbound connections. The node's
// pods' servers run in Cgroup. It returns when all of them listen; Close
// stops them. The program must call ServeIfRequested first.
func (nb *NodeBed) StartServers() error {
	nb.mu.Lock()
	defer nb.mu.Unlock()
	if nb.closed {
		return errors.New("testbed: closed")
	}
	if len(nb.servers) > 0 {
		return errors.New("testbed: servers already started")
	}
	var specs []serverSpec
	for _, p := range nb.pods {
		spec := serverSpec{ns: p.NS, name: p.Name}
		if p.NodeNS == nb.node.NS {
			spec.cgroup = nb.cgroup
		}
		specs = append(specs, spec)
	}
	specs = append(specs, serverSpec{ns: nb.client.NS, name: RoleClient})
	servers, err := startServers("", specs)
	if err != nil {
		return err
	}
	nb.servers = servers
	return nil
}

// Close stops the servers, kills what runs in the cgroup and removes it,
// and deletes every namespace. It is idempotent.
func (nb *NodeBed) Close() error {
	nb.mu.Lock()
	if nb.closed {
		nb.mu.Unlock()
		return nil
	}
	nb.closed = true
	servers := nb.servers
	nb.servers = nil
	nb.mu.Unlock()

	var errs []error
	stopServers(servers)
	if nb.cgroup != "" {
		if err := removeCgroup(nb.cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	for _, ns := range nb.Namespaces() {
		if err := deleteNamespace(ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
