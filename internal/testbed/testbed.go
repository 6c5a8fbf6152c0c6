package testbed

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"testing"

	"github.com/vishvananda/netns"
)

// Prefix starts the name of every namespace a Testbed creates.
const Prefix = "xdpt-"

// Interface names; each is unique inside its namespace.
const (
	ClientIface     = "c0"  // client, faces the node
	NodeClientIface = "n0"  // node, faces the client
	NodeLANIface    = "n1"  // node, faces the backend LAN
	LANNodePort     = "ln"  // lan, bridge port of the node's n1
	LANBridge       = "br0" // lan
	BackendIface    = "b0"  // every backend, faces the LAN
)

// ClusterIPRange is where tests put Service addresses. The client's default
// route via the node covers it; nothing in the topology owns it.
var ClusterIPRange = netip.MustParsePrefix("198.19.0.0/16")

// Addresses of the topology.
var (
	ClientAddr      = netip.MustParseAddr("198.18.0.2")
	NodeClientAddr  = netip.MustParseAddr("198.18.0.1")
	NodeLANAddr     = netip.MustParseAddr("198.18.1.1")
	ClientAddr6     = netip.MustParseAddr("2001:db8:18::2")
	NodeClientAddr6 = netip.MustParseAddr("2001:db8:18::1")
	NodeLANAddr6    = netip.MustParseAddr("2001:db8:18:1::1")
	ClusterIPRange6 = netip.MustParsePrefix("2001:db8:19::/64")
)

// BackendAddr returns the IPv4 address of backend i (0-based): 198.18.1.(11+i).
func BackendAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{198, 18, 1, byte(11 + i)}) }

// BackendAddr6 returns the IPv6 address of backend i: 2001:db8:18:1::(11+i) in hex digits.
func BackendAddr6(i int) netip.Addr {
	return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 0x18, 0, 1, 15: byte(0x11 + i)})
}

// MaxBackends keeps backend addresses inside 198.18.1.11-198.18.1.254.
const MaxBackends = 244

// Options shape a Testbed. The zero value gives three backends, one queue per
// veth, the default MTU and no tuning.
type Options struct {
	Backends int // number of backend namespaces; 0 means 3
	Queues   int // rx and tx queues on both veth pairs of the node (n0/c0, n1/ln); 0 means 1
	MTU      int // MTU of every veth and the bridge; 0 keeps the kernel default
	IPv6     bool

	// Tuning, keyed by interface name. BackendIface applies to every
	// backend. Threaded maps an interface to the CPU its NAPI kthreads are
	// pinned to (see SetThreadedNAPI for when those threads exist); RPS maps
	// an interface to a hex CPU mask for all its rx queues; GRO lists
	// interfaces whose GRO is turned on.
	Threaded map[string]int
	RPS      map[string]string
	GRO      []string
}

// Host describes one end of the topology: the namespace, its interface and
// addresses. Addr6 is invalid unless Options.IPv6 was set.
type Host struct {
	NS      string
	Iface   string
	IfIndex int
	MAC     net.HardwareAddr
	Addr    netip.Addr
	Addr6   netip.Addr
}

// Testbed is a live topology. Its methods are safe for concurrent use.
type Testbed struct {
	opts     Options
	id       string
	client   Host
	nodeC    Host // n0
	nodeL    Host // n1
	lan      string
	backends []Host

	mu      sync.Mutex
	closed  bool
	servers []*server
}

// New builds the topology. On error everything it made is removed again.
func New(opts Options) (*Testbed, error) {
	if err := startedAsServer(); err != nil {
		return nil, err
	}
	if opts.Backends == 0 {
		opts.Backends = 3
	}
	if opts.Backends < 0 || opts.Backends > MaxBackends {
		return nil, fmt.Errorf("testbed: %d backends, want 1..%d", opts.Backends, MaxBackends)
	}
	if opts.Queues == 0 {
		opts.Queues = 1
	}
	if opts.Queues < 0 || opts.Queues > 64 {
		return nil, fmt.Errorf("testbed: %d queues, want 1..64", opts.Queues)
	}
	id, err := newID()
	if err != nil {
		return nil, err
	}
	tb := &Testbed{opts: opts, id: id, lan: id + "-lan"}
	tb.client = Host{NS: id + "-client", Iface: ClientIface, Addr: ClientAddr}
	tb.nodeC = Host{NS: id + "-node", Iface: NodeClientIface, Addr: NodeClientAddr}
	tb.nodeL = Host{NS: id + "-node", Iface: NodeLANIface, Addr: NodeLANAddr}
	if opts.IPv6 {
		tb.client.Addr6, tb.nodeC.Addr6, tb.nodeL.Addr6 = ClientAddr6, NodeClientAddr6, NodeLANAddr6
	}
	for i := range opts.Backends {
		h := Host{NS: fmt.Sprintf("%s-b%d", id, i), Iface: BackendIface, Addr: BackendAddr(i)}
		if opts.IPv6 {
			h.Addr6 = BackendAddr6(i)
		}
		tb.backends = append(tb.backends, h)
	}
	if err := tb.build(); err != nil {
		return nil, errors.Join(err, tb.Close())
	}
	if err := tb.tune(); err != nil {
		return nil, errors.Join(err, tb.Close())
	}
	return tb, nil
}

// newID names a new testbed: Prefix, our PID and random hex digits.
func newID() (string, error) {
	var suffix [3]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s%d-%s", Prefix, os.Getpid(), hex.EncodeToString(suffix[:])), nil
}

// NewForTest builds a Testbed and closes it when the test ends. Without
// root it fails the test (skips it under -short), and it fails it when the
// topology cannot be built.
func NewForTest(t testing.TB, opts Options) *Testbed {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("testbed needs root (network namespaces)")
		}
		t.Fatal("testbed needs root (network namespaces); make test runs as root")
	}
	tb, err := New(opts)
	if err != nil {
		t.Fatalf("testbed: %v", err)
	}
	t.Cleanup(func() {
		if err := tb.Close(); err != nil {
			t.Errorf("testbed close: %v", err)
		}
	})
	return tb
}

// ID is the common prefix of this Testbed's namespace names.
func (tb *Testbed) ID() string { return tb.id }

// ClientNS names the client's namespace.
func (tb *Testbed) ClientNS() string { return tb.client.NS }

// NodeNS names the node's namespace, where xdproxy runs.
func (tb *Testbed) NodeNS() string { return tb.nodeC.NS }

// LANNS names the namespace that holds the backends' bridge.
func (tb *Testbed) LANNS() string { return tb.lan }

// BackendNS names the namespace of backend i.
func (tb *Testbed) BackendNS(i int) string { return tb.backends[i].NS }

// Namespaces lists every namespace of the Testbed.
func (tb *Testbed) Namespaces() []string {
	ns := []string{tb.client.NS, tb.nodeC.NS, tb.lan}
	for _, b := range tb.backends {
		ns = append(ns, b.NS)
	}
	return ns
}

// Client is the client's c0.
func (tb *Testbed) Client() Host { return tb.client }

// NodeClientSide is the node's n0, facing the client.
func (tb *Testbed) NodeClientSide() Host { return tb.nodeC }

// NodeLANSide is the node's n1, facing the backends.
func (tb *Testbed) NodeLANSide() Host { return tb.nodeL }

// Backend is backend i's b0.
func (tb *Testbed) Backend(i int) Host { return tb.backends[i] }

// NumBackends says how many backends there are.
func (tb *Testbed) NumBackends() int { return len(tb.backends) }

// BackendName is what backend i's servers answer with: "backend-<i>".
func BackendName(i int) string { return fmt.Sprintf("backend-%d", i) }

// Command returns an unstarted "ip netns exec ns args..." command.
func (tb *Testbed) Command(ns string, args ...string) *exec.Cmd { return CommandIn(ns, args...) }

// Start starts cmd in ns without "ip netns exec"'s sysfs mount; see
// StartIn.
func (tb *Testbed) Start(ns string, cmd *exec.Cmd) error { return StartIn(ns, cmd) }

// Exec runs args in ns; see ExecIn.
func (tb *Testbed) Exec(ns string, args ...string) ([]byte, error) { return ExecIn(ns, args...) }

// CommandIn returns "ip netns exec ns args..." for any named namespace.
func CommandIn(ns string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
}

// ExecIn runs args in ns and returns its combined output; a failure's error
// includes that output.
func ExecIn(ns string, args ...string) ([]byte, error) {
	out, err := CommandIn(ns, args...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s: %v: %w: %s", ns, args, err, bytes.TrimSpace(out))
	}
	return out, nil
}

// Do runs fn on a goroutine locked to an OS thread that has entered ns.
func (tb *Testbed) Do(ns string, fn func() error) error { return DoIn(ns, fn) }

// DoIn is Do for any named namespace.
func DoIn(ns string, fn func() error) error {
	target, err := netns.GetFromName(ns)
	if err != nil {
		return fmt.Errorf("testbed: namespace %s: %w", ns, err)
	}
	defer target.Close()
	return doAt(target, fn)
}

func doAt(target netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		err = fn()
		// A thread that cannot go back must not run other goroutines: leaving
		// it locked makes the runtime end it with this goroutine.
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// Close stops the servers and deletes every namespace. It is idempotent.
func (tb *Testbed) Close() error {
	tb.mu.Lock()
	if tb.closed {
		tb.mu.Unlock()
		return nil
	}
	tb.closed = true
	servers := tb.servers
	tb.servers = nil
	tb.mu.Unlock()

	var errs []error
	stopServers(servers)
	for _, ns := range tb.Namespaces() {
		if err := deleteNamespace(ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
