package topo

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// Interface names. FeedTxIface and FeedRedirIface are the generator
// side's second veth pair, made only with Options.FeedPair (bench/feed's
// NIC-shaped feed): the generator transmits on FeedTxIface, and an XDP
// program on FeedRedirIface redirects every frame into GenIface, so that
// NodeInIface receives XDP frames as from a NIC.
const (
	GenIface       = "g0"
	NodeInIface    = "n0"
	NodeOutIface   = "n1"
	SinkIface      = "s0"
	FeedTxIface    = "gx"
	FeedRedirIface = "gr"
)

// Addresses.
var (
	GenAddr     = netip.MustParseAddr("198.18.0.2")
	NodeInAddr  = netip.MustParseAddr("198.18.0.1")
	NodeOutAddr = netip.MustParseAddr("198.18.1.1")
	// SinkAddrs are the sink's addresses; the benchmark's services use
	// them as endpoints.
	SinkAddrs = []netip.Addr{netip.MustParseAddr("198.18.1.2"), netip.MustParseAddr("198.18.1.3")}
	// PodCIDR holds the generator and its flows' sources.
	PodCIDR = netip.MustParsePrefix("198.18.0.0/24")
	// FlowSource is the source address of flow 0.
	FlowSource = netip.MustParseAddr("198.18.0.16")
	// ServiceCIDR holds the services' cluster IPs.
	ServiceCIDR = netip.MustParsePrefix("198.19.0.0/16")
)

// Plan places the work: the generator (and the sink's receive work) on
// GenCPU, everything the path under test does on ForwardCPU.
type Plan struct {
	GenCPU     int
	ForwardCPU int
}

// Mask is the hex CPU mask of cpu, for rps_cpus.
func Mask(cpu int) string { return strconv.FormatUint(1<<uint(cpu), 16) }

// Topology is a live topology.
type Topology struct {
	ID                   string
	Gen, Node, Sink      string // namespace names
	GenMAC, NodeInMAC    net.HardwareAddr
	NodeOutMAC, SinkMAC  net.HardwareAddr
	GenIndex, SinkIndex  int
	NodeInIdx, NodeOutIx int
	// FeedTxIndex and FeedRedirIndex are the ifindexes of FeedTxIface and
	// FeedRedirIface in the generator namespace (0 without FeedPair).
	FeedTxIndex, FeedRedirIndex int
	closed                      bool
}

// Options shape a Topology.
type Options struct {
	// Queues per veth; 0 means 1.
	Queues int
	// FeedPair adds the veth pair FeedTxIface <-> FeedRedirIface inside
	// the generator namespace (no addresses: it only carries the
	// generator's frames to the XDP program that redirects them).
	FeedPair bool
}

// New builds the topology; on error nothing is left behind.
func New(opts Options) (*Topology, error) {
	if opts.Queues == 0 {
		opts.Queues = 1
	}
	var suffix [3]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return nil, err
	}
	id := fmt.Sprintf("%s%d-%s", testbed.Prefix, os.Getpid(), hex.EncodeToString(suffix[:]))
	t := &Topology{ID: id, Gen: id + "-gen", Node: id + "-node", Sink: id + "-sink"}
	if err := t.build(opts); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	return t, nil
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("topo: %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func (t *Topology) build(o Options) error {
	q := strconv.Itoa(o.Queues)
	steps := [][]string{
		{"ip", "netns", "add", t.Gen}, {"ip", "netns", "add", t.Node}, {"ip", "netns", "add", t.Sink},
		{"ip", "-n", t.Gen, "link", "add", GenIface, "numtxqueues", q, "numrxqueues", q, "type", "veth",
			"peer", "name", NodeInIface, "netns", t.Node, "numtxqueues", q, "numrxqueues", q},
		{"ip", "-n", t.Node, "link", "add", NodeOutIface, "numtxqueues", q, "numrxqueues", q, "type", "veth",
			"peer", "name", SinkIface, "netns", t.Sink, "numtxqueues", q, "numrxqueues", q},
		{"ip", "-n", t.Gen, "addr", "add", GenAddr.String() + "/24", "dev", GenIface},
		{"ip", "-n", t.Node, "addr", "add", NodeInAddr.String() + "/24", "dev", NodeInIface},
		{"ip", "-n", t.Node, "addr", "add", NodeOutAddr.String() + "/24", "dev", NodeOutIface},
	}
	for _, a := range SinkAddrs {
		steps = append(steps, []string{"ip", "-n", t.Sink, "addr", "add", a.String() + "/24", "dev", SinkIface})
	}
	if o.FeedPair {
		steps = append(steps,
			[]string{"ip", "-n", t.Gen, "link", "add", FeedTxIface, "numtxqueues", q, "numrxqueues", q, "type", "veth",
				"peer", "name", FeedRedirIface, "numtxqueues", q, "numrxqueues", q},
			// No IPv6 (link-local addresses, router solicitations): the
			// pair carries the generator's frames and nothing else.
			[]string{"ip", "netns", "exec", t.Gen, "sysctl", "-q", "-w", "net.ipv6.conf." + FeedTxIface + ".disable_ipv6=1",
				"net.ipv6.conf." + FeedRedirIface + ".disable_ipv6=1"},
			[]string{"ip", "-n", t.Gen, "link", "set", FeedTxIface, "up"},
			[]string{"ip", "-n", t.Gen, "link", "set", FeedRedirIface, "up"})
	}
	for _, ns := range []string{t.Gen, t.Node, t.Sink} {
		steps = append(steps, []string{"ip", "-n", ns, "link", "set", "lo", "up"})
	}
	steps = append(steps,
		[]string{"ip", "-n", t.Gen, "link", "set", GenIface, "up"},
		[]string{"ip", "-n", t.Node, "link", "set", NodeInIface, "up"},
		[]string{"ip", "-n", t.Node, "link", "set", NodeOutIface, "up"},
		[]string{"ip", "-n", t.Sink, "link", "set", SinkIface, "up"},
		[]string{"ip", "-n", t.Gen, "route", "add", "default", "via", NodeInAddr.String()},
		[]string{"ip", "-n", t.Sink, "route", "add", "default", "via", NodeOutAddr.String()},
		[]string{"ip", "netns", "exec", t.Node, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
			"net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
			"net.ipv4.conf." + NodeInIface + ".rp_filter=0", "net.ipv4.conf." + NodeOutIface + ".rp_filter=0"},
	)
	for _, s := range steps {
		if err := run(s...); err != nil {
			return err
		}
	}
	var err error
	if t.GenMAC, t.GenIndex, err = linkInfo(t.Gen, GenIface); err != nil {
		return err
	}
	if t.NodeInMAC, t.NodeInIdx, err = linkInfo(t.Node, NodeInIface); err != nil {
		return err
	}
	if t.NodeOutMAC, t.NodeOutIx, err = linkInfo(t.Node, NodeOutIface); err != nil {
		return err
	}
	if t.SinkMAC, t.SinkIndex, err = linkInfo(t.Sink, SinkIface); err != nil {
		return err
	}
	if o.FeedPair {
		if _, t.FeedTxIndex, err = linkInfo(t.Gen, FeedTxIface); err != nil {
			return err
		}
		if _, t.FeedRedirIndex, err = linkInfo(t.Gen, FeedRedirIface); err != nil {
			return err
		}
	}
	neigh := [][]string{
		{"ip", "-n", t.Gen, "neigh", "replace", NodeInAddr.String(), "lladdr", t.NodeInMAC.String(), "dev", GenIface, "nud", "permanent"},
		{"ip", "-n", t.Node, "neigh", "replace", GenAddr.String(), "lladdr", t.GenMAC.String(), "dev", NodeInIface, "nud", "permanent"},
		{"ip", "-n", t.Sink, "neigh", "replace", NodeOutAddr.String(), "lladdr", t.NodeOutMAC.String(), "dev", SinkIface, "nud", "permanent"},
	}
	for _, a := range SinkAddrs {
		neigh = append(neigh, []string{"ip", "-n", t.Node, "neigh", "replace", a.String(), "lladdr", t.SinkMAC.String(), "dev", NodeOutIface, "nud", "permanent"})
	}
	for _, s := range neigh {
		if err := run(s...); err != nil {
			return err
		}
	}
	return nil
}

func linkInfo(ns, iface string) (net.HardwareAddr, int, error) {
	var mac net.HardwareAddr
	var idx int
	err := testbed.DoIn(ns, func() error {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			return err
		}
		mac, idx = l.Attrs().HardwareAddr, l.Attrs().Index
		return nil
	})
	if err != nil {
		return nil, 0, fmt.Errorf("topo: %s/%s: %w", ns, iface, err)
	}
	return mac, idx, nil
}

// Namespaces lists the namespace names.
func (t *Topology) Namespaces() []string { return []string{t.Gen, t.Node, t.Sink} }

// Command returns "ip netns exec ns args...".
func (t *Topology) Command(ns string, args ...string) *exec.Cmd {
	return testbed.CommandIn(ns, args...)
}

// Exec runs args in ns; the error carries the output.
func (t *Topology) Exec(ns string, args ...string) ([]byte, error) {
	return testbed.ExecIn(ns, args...)
}

// ExecInput runs args in ns with stdin from in, killing it after timeout
// (0: no limit).
func (t *Topology) ExecInput(ns string, in []byte, timeout time.Duration, args ...string) error {
	ctx := context.Background()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns}, args...)...)
	cmd.Stdin = bytes.NewReader(in)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		return fmt.Errorf("topo: %s: %v did not finish in %v", ns, args, timeout)
	}
	if err != nil {
		return fmt.Errorf("topo: %s: %v: %w: %s", ns, args, err, bytes.TrimSpace(out))
	}
	return nil
}

// Close kills what still runs in the namespaces and deletes them.
func (t *Topology) Close() error {
	if t.closed {
		return nil
	}
	t.closed = true
	var errs []error
	for _, ns := range t.Namespaces() {
		if _, err := os.Stat("/run/netns/" + ns); err != nil {
			continue
		}
		killIn(ns)
		if err := run("ip", "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// CloseAll deletes every namespace this process created, for a signal
// handler: Close is per topology and needs the Topology value.
func CloseAll() {
	entries, _ := os.ReadDir("/run/netns")
	prefix := fmt.Sprintf("%s%d-", testbed.Prefix, os.Getpid())
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			killIn(e.Name())
			_ = run("ip", "netns", "del", e.Name())
		}
	}
}

func killIn(ns string) {
	out, err := exec.Command("ip", "netns", "pids", ns).Output()
	if err != nil {
		return
	}
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	time.Sleep(20 * time.Millisecond)
}

// SetRPS steers the backlog work of every rx queue of iface to cpu.
func (t *Topology) SetRPS(ns, iface string, cpu int) error {
	_, err := t.Exec(ns, "sh", "-c", fmt.Sprintf("for q in /sys/class/net/%s/queues/rx-*; do echo %s > $q/rps_cpus || exit 1; done", iface, Mask(cpu)))
	return err
}

// SetThreaded turns threaded NAPI on for iface and returns the PIDs of its
// NAPI kthreads. The kernel's netdev netlink dump of NAPI instances skips
// a device whose NAPI ids are above those of the device dumped before it
// (seen on 6.18), so the kthreads are also found as the "napi/<iface>-<id>"
// threads that appeared when threaded mode was switched on here.
func (t *Topology) SetThreaded(ns, iface string) ([]int, error) {
	before := napiThreadsByName(iface)
	if _, err := t.Exec(ns, "sh", "-c", fmt.Sprintf("echo 1 > /sys/class/net/%s/threaded", iface)); err != nil {
		return nil, err
	}
	seen := map[int]bool{}
	if wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, time.Second, true, func(context.Context) (bool, error) {
		if pids, err := NAPIThreads(ns, iface); err == nil {
			for _, p := range pids {
				seen[p] = true
			}
		}
		for p := range napiThreadsByName(iface) {
			if !before[p] {
				seen[p] = true
			}
		}
		return len(seen) > 0, nil
	}) != nil {
		return nil, fmt.Errorf("%w: %s/%s", ErrNoNAPI, ns, iface)
	}
	var pids []int
	for p := range seen {
		pids = append(pids, p)
	}
	sort.Ints(pids)
	return pids, nil
}

// napiThreadsByName finds kernel threads named "napi/<iface>-<id>".
func napiThreadsByName(iface string) map[int]bool {
	out := map[int]bool{}
	dirs, _ := os.ReadDir("/proc")
	prefix := "napi/" + iface + "-"
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile("/proc/" + d.Name() + "/comm")
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(comm)), prefix) {
			out[pid] = true
		}
	}
	return out
}

// Pin pins threads to cpu.
func Pin(cpu int, pids ...int) error {
	var set unix.CPUSet
	set.Set(cpu)
	for _, pid := range pids {
		if err := unix.SchedSetaffinity(pid, &set); err != nil {
			return fmt.Errorf("topo: pin thread %d to CPU %d: %w", pid, cpu, err)
		}
	}
	return nil
}

// SetOffload runs "ethtool -K iface feature on|off".
func (t *Topology) SetOffload(ns, iface, feature string, on bool) error {
	v := "off"
	if on {
		v = "on"
	}
	_, err := t.Exec(ns, "ethtool", "-K", iface, feature, v)
	return err
}

// ErrNoNAPI means the interface has no NAPI kthreads: a veth has NAPI only
// while it runs an XDP program or has GRO on.
var ErrNoNAPI = errors.New("topo: no NAPI kthreads (turn threaded NAPI on, attach XDP or turn GRO on first)")

// SetNice sets the nice value of threads (kernel threads included).
func SetNice(nice int, tids ...int) error {
	for _, tid := range tids {
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil {
			return fmt.Errorf("topo: nice %d for thread %d: %w", nice, tid, err)
		}
	}
	return nil
}

// SetFIFO makes threads real-time (SCHED_FIFO at prio, 1-99): they run
// before every ordinary thread of their CPU, so that other work on a
// shared machine cannot take the CPU from them mid-trial. The kernel's
// real-time throttling (sched_rt_runtime_us) still leaves ordinary
// threads a share of each second.
func SetFIFO(prio int, tids ...int) error {
	attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_FIFO, Priority: uint32(prio)}
	for _, tid := range tids {
		if err := unix.SchedSetAttr(tid, &attr, 0); err != nil {
			return fmt.Errorf("topo: SCHED_FIFO %d for thread %d: %w", prio, tid, err)
		}
	}
	return nil
}

// NAPIThreads asks the kernel's netdev family for the kthread PIDs of
// iface's NAPI instances; thread names repeat across namespaces, so names
// cannot tell topologies apart.
func NAPIThreads(ns, iface string) ([]int, error) { return testbed.NAPIThreadsIn(ns, iface) }
