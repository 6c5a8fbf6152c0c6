package dataplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
	"k8s.io/apimachinery/pkg/util/wait"
)

// These tests run the engine and its workers on the fake kernel: no
// privileges, real Processor, real conntrack, real worker loop. Run them
// with -race (make test does).

// fakeNode is two interfaces, n0 towards clients and n1 towards backends,
// with the exception link, on a fake kernel.
type fakeNode struct {
	k      *fakeKernel
	e      *Engine
	n0, n1 Link
	kEnd   Link // the exception link's kernel end
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startFakeNode(t testing.TB, queues int, tweak func(*EngineConfig)) *fakeNode {
	t.Helper()
	return startFakeNodeOn(t, newFakeKernel(), queues, tweak)
}

// await waits for cond, failing the test after a few seconds.
func await(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if wait.PollUntilContextTimeout(context.Background(), 2*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil }) != nil {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// inject delivers frame on queue q of l and waits until a worker took it.
func (fn *fakeNode) inject(t *testing.T, l Link, q int, frame []byte) {
	t.Helper()
	var s *fakeSocket
	await(t, "a socket with a full fill ring", func() bool {
		s = fn.k.socket(l.Index, q)
		return s != nil && s.Inject(frame)
	})
}

// sent waits for n frames transmitted on l's sockets and returns them.
func (fn *fakeNode) sent(t *testing.T, l Link, n int) [][]byte {
	t.Helper()
	var got [][]byte
	await(t, fmt.Sprintf("transmitted frames on %s (counters %+v)", l.Name, fn.counters()), func() bool {
		for q := range l.Queues {
			if s := fn.k.socket(l.Index, q); s != nil {
				got = append(got, s.Sent()...)
			}
		}
		return len(got) >= n
	})
	return got
}

func (fn *fakeNode) counters() Snapshot {
	var s Snapshot
	for _, w := range fn.e.Workers() {
		s.Add(w.Counters.Snapshot())
	}
	return s
}

func TestWorkerForwardsBothWays(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	syn := frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), 46000, 80, packet.TCPSyn, nil)
	fn.inject(t, fn.n0, 0, syn)
	out := fn.sent(t, fn.n1, 1)[0]
	p := parse(t, out)
	if p.Src != podA || (p.Dst != addr("198.18.1.11") && p.Dst != addr("198.18.1.12")) || p.DstPort != 8080 {
		t.Fatalf("forwarded %v, want podA -> a web backend:8080", p.Tuple())
	}
	if !bytes.Equal(out[0:6], []byte{2, 0xb, 0, 0, 0, 1}) || !bytes.Equal(out[6:12], fn.n1.MAC) {
		t.Errorf("MACs %x -> %x, want the next hop's and n1's", out[6:12], out[0:6])
	}
	reply := p.Tuple().Reverse()
	if !fn.k.tables.hasFlow(xdp.FlowKey(reply)) {
		t.Fatalf("reply tuple %v not published to the XDP flow table", reply)
	}
	back := frame(t, packet.ProtoTCP, reply.Src, reply.Dst, reply.SrcPort, reply.DstPort, packet.TCPSyn|packet.TCPAck, nil)
	fn.inject(t, fn.n1, 0, back)
	bp := parse(t, fn.sent(t, fn.n0, 1)[0])
	if bp.Src != addr("198.19.0.10") || bp.SrcPort != 80 || bp.Dst != podA || bp.DstPort != 46000 {
		t.Fatalf("reply sent as %v, want 198.19.0.10:80 -> podA:46000", bp.Tuple())
	}
	c := fn.counters()
	if c.Forwarded != 2 || c.Copied != 2 || c.NewFlows != 1 {
		t.Errorf("counters %+v: want 2 forwarded, 2 copied across ports, 1 new flow", c)
	}
}

// TestMasqueradedFlowPublishesItsReply: a masqueraded flow's reply comes to
// a node address and a SNAT port; the XDP program claims it only by its
// exact tuple, which the worker must publish like any other.
func TestMasqueradedFlowPublishesItsReply(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, outside, addr("198.19.0.20"), 5000, 53, 0, []byte("q")))
	p := parse(t, fn.sent(t, fn.n1, 1)[0])
	if p.Src != nodeAddr || p.SrcPort < 61000 {
		t.Fatalf("masqueraded as %v, want from %v and a port in 61000-65535", p.Tuple(), nodeAddr)
	}
	if !fn.k.tables.hasFlow(xdp.FlowKey(p.Tuple().Reverse())) {
		t.Fatalf("reply %v of a masqueraded flow not published", p.Tuple().Reverse())
	}
}

// TestNotOursGoesToTheKernel: a frame that reached a worker but belongs
// to no service and no flow (the flow ended between the XDP lookup and
// ours) is handed to the kernel unchanged, with the kernel end's MAC, and
// counted under its reason.
func TestNotOursGoesToTheKernel(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	f := frame(t, packet.ProtoTCP, addr("198.18.1.11"), podA, 8080, 46001, packet.TCPAck, []byte("late"))
	fn.inject(t, fn.n1, 0, f)
	got := fn.sent(t, fn.kEnd.withXdproxyEnd(fn.k), 1)[0]
	if !bytes.Equal(got[0:6], fn.kEnd.MAC) {
		t.Errorf("destination MAC %x, want the kernel end's %x", got[0:6], fn.kEnd.MAC)
	}
	if !bytes.Equal(got[6:], f[6:]) {
		t.Errorf("frame changed on its way to the kernel")
	}
	c := fn.counters()
	if c.ToKernel != 1 || c.ByReason["pass_no_service"] != 1 {
		t.Errorf("counters %+v: want 1 to the kernel, counted pass_no_service", c)
	}
}

// withXdproxyEnd returns the exception link's other end, where xdproxy's
// socket transmits.
func (l Link) withXdproxyEnd(k *fakeKernel) Link {
	x, _ := k.Link(xdproxyEndName(l.Name))
	return x
}

func TestNoExceptionLinkDropsAndCounts(t *testing.T) {
	fn := startFakeNode(t, 1, func(c *EngineConfig) { c.ExceptionInterface = "" })
	fn.inject(t, fn.n1, 0, frame(t, packet.ProtoTCP, addr("198.18.1.11"), podA, 8080, 46001, packet.TCPAck, nil))
	await(t, "the drop", func() bool { return fn.counters().ByReason["drop_no_kernel_path"] == 1 })
}

// TestUnresolvedNeighbourGoesThroughTheKernel: a translated frame whose
// next hop has no neighbour entry yet goes to the kernel, which holds it
// while it resolves the neighbour; it is not dropped. Without an exception
// link it is dropped and counted.
func TestUnresolvedNeighbourGoesThroughTheKernel(t *testing.T) {
	backends := []packet.Addr{addr("198.18.1.11"), addr("198.18.1.12"), addr("198.18.1.13")}
	for _, exception := range []bool{true, false} {
		fn := startFakeNode(t, 1, func(c *EngineConfig) {
			if !exception {
				c.ExceptionInterface = ""
			}
		})
		for _, b := range backends {
			fn.k.resolver.setUnresolved(b)
		}
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 5300, 53, 0, []byte("q")))
		if !exception {
			await(t, "the drop", func() bool { return fn.counters().ByReason["drop_neighbor_unresolved"] == 1 })
			continue
		}
		got := fn.sent(t, fn.kEnd.withXdproxyEnd(fn.k), 1)[0]
		p := parse(t, got)
		if !slices.Contains(backends, p.Dst) || p.Src != podA || !bytes.Equal(got[0:6], fn.kEnd.MAC) {
			t.Errorf("sent %v to %x, want podA -> a backend, to the kernel end's MAC %x", p.Tuple(), got[0:6], fn.kEnd.MAC)
		}
		// The worker adds its batch's counters after transmitting.
		await(t, "the batch's counters", func() bool { return fn.counters().RxFrames == 1 })
		c := fn.counters()
		if c.Unresolved != 1 || c.ViaKernel != 1 || c.Forwarded != 1 || len(c.ByReason) != 0 {
			t.Errorf("counters %+v: want 1 forwarded through the kernel for want of a neighbour, no drop", c)
		}
		if !fn.k.tables.hasFlow(xdp.FlowKey(p.Tuple().Reverse())) {
			t.Errorf("reply tuple %v not published", p.Tuple().Reverse())
		}
		// A masqueraded flow still takes the address of the interface
		// it leaves by (n1), not the node's first (n0's).
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, outside, addr("198.19.0.20"), 5301, 53, 0, []byte("q")))
		if p := parse(t, fn.sent(t, fn.kEnd.withXdproxyEnd(fn.k), 1)[0]); p.Src != nodeAddr {
			t.Errorf("masqueraded as %v, want from n1's %v", p.Tuple(), nodeAddr)
		}
	}
}

// TestTxFullIsCountedAndLeaksNothing: the egress ring takes 2 frames per
// batch; the rest are dropped as drop_tx_full and their frames return to
// the free stacks.
func TestTxFullIsCountedAndLeaksNothing(t *testing.T) {
	k := newFakeKernel()
	k.faults.txRingSlots = 2
	fn := startFakeNodeOn(t, k, 1, func(c *EngineConfig) { c.BatchSize = 16 })
	in := fn.k.socket(fn.n0.Index, 0)
	in.setHold(true)
	for i := range 8 {
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), uint16(6000+i), 53, 0, nil))
	}
	in.setHold(false) // one batch of 8
	await(t, "8 frames handled", func() bool { return fn.counters().RxFrames == 8 })
	c := fn.counters()
	sent := len(fn.k.socket(fn.n1.Index, 0).Sent())
	if c.TxFrames != uint64(sent) || c.ByReason["drop_tx_full"] != uint64(8-sent) || sent == 8 {
		t.Errorf("sent %d, counters %+v: want the frames that did not fit counted drop_tx_full", sent, c)
	}
	await(t, "no frames held", func() bool {
		return in.Held() == 0 && fn.k.socket(fn.n1.Index, 0).Held() == 0
	})
}

func startFakeNodeOn(t testing.TB, k *fakeKernel, queues int, tweak func(*EngineConfig)) *fakeNode {
	t.Helper()
	fn := &fakeNode{k: k}
	fn.n0 = k.addLink("n0", queues, "198.18.0.1")
	fn.n1 = k.addLink("n1", queues, nodeAddr.String())
	sc := afxdp.DefaultConfig()
	cfg := EngineConfig{
		Kernel: k,
		Interfaces: []InterfaceConfig{
			{Name: "n0", Mode: xdp.Native, Socket: sc},
			{Name: "n1", Mode: xdp.Native, Socket: sc},
		},
		ExceptionInterface: "xdpx0",
		Conntrack:          conntrack.Config{Capacity: 4096},
		SNATPorts:          conntrack.PortRange{First: 61000, Last: 65535},
		LinkCheckInterval:  time.Hour,
		Log:                quietLog(),
	}
	if tweak != nil {
		tweak(&cfg)
	}
	e, err := Start(cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	fn.e = e
	fn.kEnd, _ = k.Link("xdpx0")
	for _, a := range []packet.Addr{podA, outside} {
		k.resolver.set(a, NextHop{Ifindex: fn.n0.Index, Dst: [6]byte{2, 0xc, 0, 0, 0, 1}, Src: macOf(fn.n0.MAC)})
	}
	for _, a := range []string{"198.18.1.11", "198.18.1.12", "198.18.1.13"} {
		k.resolver.set(addr(a), NextHop{Ifindex: fn.n1.Index, Dst: [6]byte{2, 0xb, 0, 0, 0, 1}, Src: macOf(fn.n1.MAC)})
	}
	if err := e.Publish(service.Compile(testModel(), service.CompileOptions{
		ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}})); err != nil {
		t.Fatal(err)
	}
	return fn
}

// TestFlowTableFullUndoesTheFlow: when the XDP flow table refuses a new
// flow's reply tuple, the flow could not work (its replies would reach
// the kernel); it is taken out of conntrack and counted.
func TestFlowTableFullUndoesTheFlow(t *testing.T) {
	k := newFakeKernel()
	k.faults.flowRoom = 1
	fn := startFakeNodeOn(t, k, 1, nil)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7000, 53, 0, nil))
	await(t, "first flow", func() bool { return fn.counters().NewFlows == 1 })
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7001, 53, 0, nil))
	await(t, "the refusal", func() bool { return fn.counters().ByReason["drop_flow_table_full"] == 1 })
	now := MonotonicNow()
	second := packet.Tuple{Src: podA, Dst: addr("198.19.0.20"), SrcPort: 7001, DstPort: 53, Proto: packet.ProtoUDP}
	if _, _, ok := fn.e.Conntrack().Lookup(second, now); ok {
		t.Error("the flow whose reply could not be published is still tracked")
	}
	first := second
	first.SrcPort = 7000
	if _, _, ok := fn.e.Conntrack().Lookup(first, now); !ok {
		t.Error("the first flow is gone")
	}
	if c := fn.counters(); c.FlowPublishErrors != 1 {
		t.Errorf("FlowPublishErrors %d, want 1", c.FlowPublishErrors)
	}
}

// TestEveryQueueServedAndFollowed: with queues left out of the config,
// every queue gets a worker; ethtool -L up adds workers; SetChannels down
// lets go of the queues first (the kernel refuses otherwise), and the
// interface is healthy all along.
func TestEveryQueueServedAndFollowed(t *testing.T) {
	fn := startFakeNode(t, 4, nil)
	served := func(name string) []int {
		for _, s := range fn.e.Interfaces() {
			if s.Name == name {
				return s.Served
			}
		}
		return nil
	}
	if got := served("n0"); !slices.Equal(got, []int{0, 1, 2, 3}) {
		t.Fatalf("n0 served %v, want all 4 queues", got)
	}
	if len(fn.e.Workers()) != 9 {
		t.Fatalf("%d workers, want 8 and the exception link's", len(fn.e.Workers()))
	}
	// Traffic on queue 3 works.
	fn.inject(t, fn.n0, 3, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7100, 53, 0, nil))
	fn.sent(t, fn.n1, 1)

	if err := fn.k.setQueues("n0", 2); err == nil {
		t.Fatal("the fake kernel let ethtool -L remove queues with sockets (it must refuse, as Linux does)")
	}
	if err := fn.e.SetChannels("n0", 2); err != nil {
		t.Fatal(err)
	}
	if got := served("n0"); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("after SetChannels 2: served %v", got)
	}
	if err := fn.e.Healthy(); err != nil {
		t.Fatalf("unhealthy after shrinking: %v", err)
	}
	if err := fn.k.setQueues("n0", 4); err != nil { // ethtool -L back up
		t.Fatal(err)
	}
	await(t, "queues 2 and 3 served again", func() bool { return slices.Equal(served("n0"), []int{0, 1, 2, 3}) })
	fn.inject(t, fn.n0, 2, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7101, 53, 0, nil))
	fn.sent(t, fn.n1, 1)
	if err := fn.e.Healthy(); err != nil {
		t.Fatal(err)
	}
}

// TestInterfaceRecreated: deleting the NIC makes the engine unhealthy;
// creating it again (a new ifindex) attaches again without a restart.
func TestInterfaceRecreated(t *testing.T) {
	fn := startFakeNode(t, 2, nil)
	fn.k.deleteLink("n1")
	await(t, "unhealthy", func() bool { return fn.e.Healthy() != nil })
	if err := fn.e.Healthy(); !strings.Contains(err.Error(), "n1") {
		t.Errorf("health %v does not name n1", err)
	}
	n1 := fn.k.addLink("n1", 2, nodeAddr.String())
	await(t, "healthy again", func() bool { return fn.e.Healthy() == nil })
	for _, a := range []string{"198.18.1.11", "198.18.1.12", "198.18.1.13"} {
		fn.k.resolver.set(addr(a), NextHop{Ifindex: n1.Index, Dst: [6]byte{2, 0xb, 0, 0, 0, 1}, Src: macOf(n1.MAC)})
	}
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7200, 53, 0, nil))
	fn.sent(t, n1, 1)
}

func TestExplicitQueuesMustCoverTheInterface(t *testing.T) {
	k := newFakeKernel()
	k.addLink("n0", 2, "198.18.0.1")
	_, err := Start(EngineConfig{Kernel: k, Log: quietLog(), Conntrack: conntrack.Config{Capacity: 1024},
		Interfaces: []InterfaceConfig{{Name: "n0", Queues: []int{0}, Socket: afxdp.DefaultConfig()}}})
	if err == nil || !strings.Contains(err.Error(), "queues [1] of 2 are not served") {
		t.Fatalf("Start with queue 1 of 2 unserved: %v", err)
	}
	_, err = Start(EngineConfig{Kernel: newFakeKernel(), Log: quietLog(), Conntrack: conntrack.Config{Capacity: 1024},
		Interfaces: []InterfaceConfig{{Name: "missing", Socket: afxdp.DefaultConfig()}}})
	if err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("Start on a missing interface: %v", err)
	}
}

func TestMixedFrameSizesRefused(t *testing.T) {
	k := newFakeKernel()
	k.addLink("a", 1, "198.18.0.1")
	k.addLink("b", 1, "198.18.1.1")
	big := afxdp.DefaultConfig()
	big.FrameSize = 4096
	_, err := Start(EngineConfig{Kernel: k, Log: quietLog(), Conntrack: conntrack.Config{Capacity: 1024},
		Interfaces: []InterfaceConfig{{Name: "a", Socket: afxdp.DefaultConfig()}, {Name: "b", Socket: big}}})
	if err == nil || !strings.Contains(err.Error(), "frame size") {
		t.Fatalf("mixed frame sizes: %v", err)
	}
}

// TestMTUOverFrameSizeIsAProblem: an interface whose longest frames do not
// fit a UMEM frame (the kernel would drop them, unseen) is not fully
// served: /healthz fails naming the MTU, until the MTU fits again.
func TestMTUOverFrameSizeIsAProblem(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	if err := fn.e.Healthy(); err != nil {
		t.Fatalf("unhealthy at the start: %v", err)
	}
	fn.k.setMTU("n1", 2000) // 2018-byte frames; 1792 fit a 2048-byte frame
	await(t, "the MTU to be a problem", func() bool {
		err := fn.e.Healthy()
		return err != nil && strings.Contains(err.Error(), "n1: MTU 2000") && strings.Contains(err.Error(), "lower the MTU to 1774")
	})
	fn.k.setMTU("n1", 1774)
	await(t, "the problem to go", func() bool { return fn.e.Healthy() == nil })
}

// TestPublishFailureIsReturnedAndRetried: a table the XDP maps refuse is
// an error for the caller, and the next Publish programs the maps again
// even if the table is unchanged.
func TestPublishFailureIsReturnedAndRetried(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	tbl := service.Compile(testModel(), service.CompileOptions{})
	before := fn.e.Services().Load()
	fn.k.faults.setTables = 1
	if err := fn.e.Publish(tbl); err == nil {
		t.Fatal("Publish succeeded although SetTables failed")
	}
	if fn.e.Services().Load() != before {
		t.Error("a failed Publish left its table in the workers' hands")
	}
	sets := fn.k.tables.sets
	if err := fn.e.Publish(tbl); err != nil {
		t.Fatal(err)
	}
	if fn.k.tables.sets != sets+1 || fn.e.Services().Load() != tbl {
		t.Errorf("the maps were not programmed again after a failure")
	}
}

// TestReconcileRestoresAndRemovesTuples: the flow reconciler deletes
// tuples of flows conntrack no longer has and writes back the tuples of
// live flows missing from the map.
func TestReconcileRestoresAndRemovesTuples(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7300, 53, 0, nil))
	p := parse(t, fn.sent(t, fn.n1, 1)[0])
	live := xdp.FlowKey(p.Tuple().Reverse())
	stale := xdp.FlowKey{Src: addr("198.18.1.13"), Dst: podA, SrcPort: 5353, DstPort: 9999, Proto: packet.ProtoUDP}
	fn.k.tables.mu.Lock()
	delete(fn.k.tables.flows, live)
	fn.k.tables.flows[stale] = true
	fn.k.tables.mu.Unlock()
	before := fn.e.FlowTableStats()
	removed, restored, err := fn.e.reconcileOnce()
	if err != nil || removed != 1 || restored != 1 {
		t.Fatalf("reconcile: removed %d, restored %d, %v; want 1 and 1", removed, restored, err)
	}
	if !fn.k.tables.hasFlow(live) || fn.k.tables.hasFlow(stale) {
		t.Error("the flow map does not match conntrack after reconciling")
	}
	// The pass's findings are the map's pressure, for the metrics.
	fn.k.tables.mu.Lock()
	inMap := len(fn.k.tables.flows)
	fn.k.tables.mu.Unlock()
	if st := fn.e.FlowTableStats(); st.Entries != inMap || st.Removed != before.Removed+1 || st.Restored != before.Restored+1 {
		t.Errorf("flow table stats %+v after a pass that removed 1 and restored 1 (before %+v), %d tuples in the map", st, before, inMap)
	}
}

// The reconciler's passes cost at most 1% of a core on a large table (10%
// when asked for early), and come every 10 s on a small one.
func TestReconcilePaceFollowsPassCost(t *testing.T) {
	for _, c := range []struct {
		took, periodic, early time.Duration
	}{
		{0, reconcileInterval, time.Second},
		{20 * time.Millisecond, reconcileInterval, time.Second},
		{400 * time.Millisecond, 40 * time.Second, 4 * time.Second},
		{time.Hour, reconcileIntervalMax, reconcileIntervalMax},
	} {
		periodic, early := reconcileDelays(c.took)
		if periodic != c.periodic || early != c.early {
			t.Errorf("after a pass of %v: next periodic %v, early %v; want %v and %v", c.took, periodic, early, c.periodic, c.early)
		}
	}
}

// A pass asked for early (a refused write, a lost deletion) runs within
// about a second, and its duration shows in FlowTableStats.
func TestReconcileAskedEarlyRuns(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	stale := xdp.FlowKey{Src: addr("198.18.1.13"), Dst: podA, SrcPort: 5353, DstPort: 9999, Proto: packet.ProtoUDP}
	fn.k.tables.mu.Lock()
	fn.k.tables.flows[stale] = true
	fn.k.tables.mu.Unlock()
	fn.e.reconcileSoon()
	deadline := time.Now().Add(5 * time.Second)
	for fn.k.tables.hasFlow(stale) {
		if time.Now().After(deadline) {
			t.Fatal("a pass asked for early did not remove a stale tuple within 5 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for fn.e.FlowTableStats().LastPass == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the pass's duration is not in FlowTableStats")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestTupleTakenAgainIsNotDeleted: a new flow that takes an ended flow's
// reply tuple between the janitor's (or the reconciler's) finding it gone
// and the delete keeps its tuple in the XDP flow table: its replies still
// reach xdproxy.
func TestTupleTakenAgainIsNotDeleted(t *testing.T) {
	for _, by := range []string{"janitor", "reconciler"} {
		t.Run(by, func(t *testing.T) {
			fn := startFakeNode(t, 1, nil)
			query := frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7600, 53, 0, nil)
			fn.inject(t, fn.n0, 0, query)
			p := parse(t, fn.sent(t, fn.n1, 1)[0])
			reply := xdp.FlowKey(p.Tuple().Reverse())
			tables := fn.k.tables
			if by == "reconciler" {
				// Gone from conntrack while its tuple stays in the map
				// (a deletion the janitor lost): the reconciler's case.
				fn.e.Conntrack().DeleteByBackend(p.Dst, p.DstPort, packet.ProtoUDP)
				await(t, "the janitor's delete", func() bool { return !tables.hasFlow(reply) })
				tables.mu.Lock()
				tables.flows[reply] = true
				tables.mu.Unlock()
			}
			// The hook runs on the deleting goroutine (the janitor's):
			// it reports instead of failing the test from there.
			var once sync.Once
			retook := make(chan error, 1)
			deleted := make(chan struct{})
			tables.mu.Lock()
			tables.beforeDelete = func(keys []xdp.FlowKey) {
				if !slices.Contains(keys, reply) {
					return
				}
				// The client asks again from the same port: a new
				// flow, the same reply tuple, written before the delete.
				once.Do(func() { retook <- fn.askAgain(query) })
			}
			tables.afterDelete = func(keys []xdp.FlowKey) {
				if slices.Contains(keys, reply) {
					close(deleted)
				}
			}
			tables.mu.Unlock()
			if by == "janitor" {
				if n := fn.e.Conntrack().DeleteByBackend(p.Dst, p.DstPort, packet.ProtoUDP); n != 1 {
					t.Fatalf("deleted %d flows, want 1", n)
				}
			} else if removed, _, err := fn.e.reconcileOnce(); err != nil || removed != 0 {
				t.Fatalf("reconcile: removed %d, %v; want 0: the tuple was written back", removed, err)
			}
			select {
			case err := <-retook:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the tuple was never deleted")
			}
			<-deleted
			if _, _, live := fn.e.Conntrack().Lookup(packet.Tuple(reply), MonotonicNow()); !live {
				t.Fatal("the second query made no flow")
			}
			await(t, "the taken tuple back in the flow table", func() bool { return tables.hasFlow(reply) })
		})
	}
}

// askAgain injects frame on n0 and waits for one frame sent on n1, without
// a *testing.T: it may run on a goroutine other than the test's.
func (fn *fakeNode) askAgain(frame []byte) error {
	deadline := time.Now().Add(5 * time.Second)
	for s := fn.k.socket(fn.n0.Index, 0); s == nil || !s.Inject(frame); s = fn.k.socket(fn.n0.Index, 0) {
		if time.Now().After(deadline) {
			return errors.New("could not inject the second query")
		}
		time.Sleep(time.Millisecond)
	}
	for {
		if s := fn.k.socket(fn.n1.Index, 0); s != nil && len(s.Sent()) > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the second query was not forwarded")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestEndedFlowLeavesTheFlowTable: when conntrack drops a flow, its reply
// tuple leaves the XDP flow table soon after, so a later connection with
// the same tuple that is not xdproxy's reaches the kernel.
func TestEndedFlowLeavesTheFlowTable(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7400, 53, 0, nil))
	p := parse(t, fn.sent(t, fn.n1, 1)[0])
	reply := xdp.FlowKey(p.Tuple().Reverse())
	if !fn.k.tables.hasFlow(reply) {
		t.Fatal("reply tuple not published")
	}
	if n := fn.e.Conntrack().DeleteByBackend(p.Dst, p.DstPort, packet.ProtoUDP); n != 1 {
		t.Fatalf("deleted %d flows, want 1", n)
	}
	await(t, "the tuple to leave the flow table", func() bool { return !fn.k.tables.hasFlow(reply) })
}

// TestPublishDeletesFlowsOfRemovedUDPEndpoints: a Publish that takes
// several UDP endpoints away at once deletes their flows, reply tuples
// included, and keeps the flows to the same address on another port and
// TCP flows to the same endpoint.
func TestPublishDeletesFlowsOfRemovedUDPEndpoints(t *testing.T) {
	fn := startFakeNode(t, 1, nil)
	opts := service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}}
	// UDP services u0-u3, one endpoint each; u2's and u3's stay.
	eps := []struct {
		addr string
		port uint16
	}{{"198.18.1.11", 8080}, {"198.18.1.12", 7002}, {"198.18.1.11", 7003}, {"198.18.1.13", 5353}}
	model := func(keep int) *service.Model {
		m := testModel()
		for i, ep := range eps {
			sp := service.ServicePort{Name: service.PortName{Namespace: "default", Name: fmt.Sprint("u", i)}, Proto: packet.ProtoUDP,
				ClusterIPs: []packet.Addr{addr(fmt.Sprint("198.19.3.", i))}, Port: 53}
			if i >= keep {
				sp.Endpoints = []service.Endpoint{{Addr: addr(ep.addr), Port: ep.port, Ready: true, Serving: true, NodeName: "node-1"}}
			}
			m.Ports = append(m.Ports, sp)
		}
		return m
	}
	if err := fn.e.Publish(service.Compile(model(0), opts)); err != nil {
		t.Fatal(err)
	}
	var replies []xdp.FlowKey
	for i := range eps {
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr(fmt.Sprint("198.19.3.", i)), uint16(7100+i), 53, 0, nil))
		p := parse(t, fn.sent(t, fn.n1, 1)[0])
		if p.Dst != addr(eps[i].addr) || p.DstPort != eps[i].port {
			t.Fatalf("flow %d went to %v, want %s:%d", i, p.Tuple(), eps[i].addr, eps[i].port)
		}
		replies = append(replies, xdp.FlowKey(p.Tuple().Reverse()))
	}
	// A TCP flow to u0's endpoint, 198.18.1.11:8080 (a web backend).
	tcp := packet.Tuple{Src: podA, Dst: addr("198.19.0.10"), SrcPort: 7200, DstPort: 80, Proto: packet.ProtoTCP}
	tcpTr := packet.Tuple{Src: podA, Dst: addr("198.18.1.11"), SrcPort: 7200, DstPort: 8080, Proto: packet.ProtoTCP}
	if _, res := fn.e.Conntrack().Insert(tcp, tcpTr, conntrack.DNAT, 1, MonotonicNow()); res != conntrack.Inserted {
		t.Fatal(res)
	}
	before := fn.e.Conntrack().Stats().Deleted
	if err := fn.e.Publish(service.Compile(model(2), opts)); err != nil {
		t.Fatal(err)
	}
	if d := fn.e.Conntrack().Stats().Deleted - before; d != 2 {
		t.Errorf("deleted %d flows, want the 2 to u0's and u1's endpoints", d)
	}
	await(t, "the removed endpoints' tuples to leave the flow table", func() bool {
		return !fn.k.tables.hasFlow(replies[0]) && !fn.k.tables.hasFlow(replies[1])
	})
	now := MonotonicNow()
	for i, r := range replies {
		_, _, ok := fn.e.Conntrack().Lookup(packet.Tuple(r), now)
		if kept := i >= 2; ok != kept || fn.k.tables.hasFlow(r) != kept {
			t.Errorf("flow to %s:%d: tracked %v, tuple published %v; want %v", eps[i].addr, eps[i].port, ok, fn.k.tables.hasFlow(r), kept)
		}
	}
	if _, _, ok := fn.e.Conntrack().Lookup(tcp, now); !ok {
		t.Error("the TCP flow to a removed UDP endpoint's address and port was deleted")
	}
}

// startReservingSNAT starts an engine on a fake node whose SNAT ports,
// 40000-49999, lie in the ephemeral range and are to be reserved, with a
// state directory for the record of the reservation.
func startReservingSNAT(t *testing.T) (*Engine, *fakeKernel, string) {
	t.Helper()
	k := newFakeKernel()
	k.addLink("n0", 1, "198.18.0.1")
	dir := t.TempDir()
	e, err := Start(EngineConfig{Kernel: k, Log: quietLog(), Conntrack: conntrack.Config{Capacity: 1024},
		Interfaces: []InterfaceConfig{{Name: "n0", Socket: afxdp.DefaultConfig()}},
		SNATPorts:  conntrack.PortRange{First: 40000, Last: 49999}, ReserveSNATPorts: true, StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	return e, k, dir
}

// TestSNATPortsMustNotOverlapEphemeral: SNAT ports inside the kernel's
// ephemeral range are refused, naming both ranges, unless reserving them
// is allowed; the default range works on a stock node.
func TestSNATPortsMustNotOverlapEphemeral(t *testing.T) {
	k := newFakeKernel()
	_, err := Start(EngineConfig{Kernel: k, Log: quietLog(), Conntrack: conntrack.Config{Capacity: 1024},
		SNATPorts: conntrack.PortRange{First: 32768, Last: 60999}})
	if err == nil || !strings.Contains(err.Error(), "32768-60999 overlaps net.ipv4.ip_local_port_range 32768-60999") {
		t.Fatalf("overlapping SNAT range: %v", err)
	}
	e, k, dir := startReservingSNAT(t)
	e.Close()
	if want := (conntrack.PortRange{First: 40000, Last: 49999}); len(k.reserved) != 1 || k.reserved[0] != want {
		t.Errorf("reserved %v, want [%v]", k.reserved, want)
	}
	// What it added is recorded, for xdproxy cleanup.
	if b, err := os.ReadFile(filepath.Join(dir, reservedPortsFile)); err != nil || string(b) != "40000-49999\n" {
		t.Errorf("recorded reservation %q, %v", b, err)
	}
	startFakeNode(t, 1, nil) // 61000-65535 on 32768-60999: fine
}

// TestSNATPortsWatched: an ephemeral range widened over the SNAT ports
// after start makes the engine unhealthy, naming both ranges, until it is
// narrowed again; with reservePorts, ports someone took out of the
// reserved list are reserved again.
func TestSNATPortsWatched(t *testing.T) {
	fn := startFakeNode(t, 1, nil) // SNAT 61000-65535, ephemeral 32768-60999
	fn.e.recheckSNATPorts()
	if err := fn.e.Healthy(); err != nil {
		t.Fatalf("healthy at start: %v", err)
	}
	fn.k.mu.Lock()
	fn.k.ephemeral = conntrack.PortRange{First: 32768, Last: 65535}
	fn.k.mu.Unlock()
	fn.e.recheckSNATPorts()
	if err := fn.e.Healthy(); err == nil || !strings.Contains(err.Error(), "61000-65535 now overlaps net.ipv4.ip_local_port_range 32768-65535") {
		t.Fatalf("after the ephemeral range grew over the SNAT ports: %v", err)
	}
	fn.k.mu.Lock()
	fn.k.ephemeral = conntrack.PortRange{First: 32768, Last: 60999}
	fn.k.mu.Unlock()
	fn.e.recheckSNATPorts()
	if err := fn.e.Healthy(); err != nil {
		t.Fatalf("after the ephemeral range shrank back: %v", err)
	}

	e, k, dir := startReservingSNAT(t)
	defer e.Close()
	record := filepath.Join(dir, reservedPortsFile)
	if err := os.Remove(record); err != nil {
		t.Fatal(err)
	}
	k.mu.Lock()
	k.reserved = []conntrack.PortRange{{First: 8080, Last: 8080}} // another agent rewrote the list
	k.mu.Unlock()
	e.recheckSNATPorts()
	got, _ := k.ReservedPorts()
	if !portsCovered(got, conntrack.PortRange{First: 40000, Last: 49999}) {
		t.Errorf("reserved %v after the SNAT ports were taken out: not reserved again", got)
	}
	// What the check added, xdproxy cleanup must find to take out.
	if b, err := os.ReadFile(record); err != nil || string(b) != "40000-49999\n" {
		t.Errorf("the reservation made again is not recorded: %q, %v", b, err)
	}
	if err := e.Healthy(); err != nil {
		t.Errorf("unhealthy after reserving again: %v", err)
	}
}

func TestPortsCovered(t *testing.T) {
	r := func(a, b uint16) conntrack.PortRange { return conntrack.PortRange{First: a, Last: b} }
	for _, c := range []struct {
		ranges []conntrack.PortRange
		want   conntrack.PortRange
		ok     bool
	}{
		{nil, r(1, 1), false},
		{[]conntrack.PortRange{r(40000, 44999), r(45000, 49999)}, r(40000, 49999), true},
		{[]conntrack.PortRange{r(40000, 44999), r(45001, 49999)}, r(40000, 49999), false},
		{[]conntrack.PortRange{r(30000, 65535)}, r(61000, 65535), true},
		{[]conntrack.PortRange{r(61000, 65534)}, r(61000, 65535), false},
	} {
		if got := portsCovered(c.ranges, c.want); got != c.ok {
			t.Errorf("portsCovered(%v, %v) = %v, want %v", c.ranges, c.want, got, c.ok)
		}
	}
	got, err := parsePortList("8080,40000-49999\n")
	if want := []conntrack.PortRange{r(8080, 8080), r(40000, 49999)}; err != nil || !slices.Equal(got, want) {
		t.Errorf("parsePortList: %v, %v; want %v", got, err, want)
	}
	if got, err := parsePortList("\n"); err != nil || len(got) != 0 {
		t.Errorf("parsePortList of an empty list: %v, %v", got, err)
	}
	if _, err := parsePortList("1-x"); err == nil {
		t.Error("parsePortList accepted a bad entry")
	}
}

// TestStateSurvivesRestart: with a state directory, a second engine
// adopts the first one's connection and affinity tables; a masqueraded
// flow's reply is translated by the new process exactly as by the old.
func TestStateSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	k := newFakeKernel()
	keep := func(c *EngineConfig) { c.StateDir, c.KeepState = dir, true }
	fn := startFakeNodeOn(t, k, 1, keep)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, outside, addr("198.19.0.20"), 5000, 53, 0, []byte("q")))
	out := parse(t, fn.sent(t, fn.n1, 1)[0])
	if err := fn.e.Close(); err != nil {
		t.Fatal(err)
	}

	// The next generation, on the same kernel (whose pinned tables
	// still hold the reply tuple).
	k.links = map[string]Link{}
	fn2 := startFakeNodeOn(t, k, 1, keep)
	if got := fn2.e.Conntrack().Restored(); !got.Restored || got.Flows != 1 {
		t.Fatalf("restored %+v, want the one flow", got)
	}
	r := out.Tuple().Reverse()
	fn2.inject(t, fn2.n1, 0, frame(t, packet.ProtoUDP, r.Src, r.Dst, r.SrcPort, r.DstPort, 0, []byte("a")))
	back := parse(t, fn2.sent(t, fn2.n0, 1)[0])
	if back.Src != addr("198.19.0.20") || back.SrcPort != 53 || back.Dst != outside || back.DstPort != 5000 {
		t.Fatalf("reply after restart sent as %v, want 198.19.0.20:53 -> %v:5000", back.Tuple(), outside)
	}
	fn2.e.Close()
	// Without KeepState the files go.
	fn3 := startFakeNodeOn(t, newFakeKernel(), 1, func(c *EngineConfig) { c.StateDir = dir })
	fn3.e.Close()
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("state files left after a close without KeepState: %v", entries)
	}
}

// TestLocalClientsGetLocalOriginBackends: with local clients on, every TCP
// and UDP frontend reaches the socket programs with the backends the table
// gives local-origin traffic, NodePorts also on 127.0.0.1, and a service
// without endpoints rejects.
func TestLocalClientsGetLocalOriginBackends(t *testing.T) {
	k := newFakeKernel()
	k.local = &fakeLocalClients{}
	fn := startFakeNodeOn(t, k, 1, func(c *EngineConfig) { c.LocalClientsCgroup = "/sys/fs/cgroup/unified/test" })
	if k.local.cgroup != "/sys/fs/cgroup/unified/test" {
		t.Fatalf("attached to %q", k.local.cgroup)
	}
	// The programs' counters reach the metrics and admin stats.
	if c, ok, err := fn.e.LocalClientCounters(); !ok || err != nil || c.Translated == 0 {
		t.Errorf("local client counters %+v, %v, %v; want the fake's count of SetFrontends", c, ok, err)
	}
	byKey := map[string]socklb.Frontend{}
	for _, f := range k.local.frontends {
		byKey[fmt.Sprintf("%v:%d/%v", f.Addr, f.Port, f.Proto)] = f
	}
	web := byKey["198.19.0.10:80/TCP"]
	if len(web.Backends) != 2 {
		t.Errorf("web cluster IP has backends %v, want both endpoints", web.Backends)
	}
	if np := byKey["127.0.0.1:30080/TCP"]; len(np.Backends) != 2 {
		t.Errorf("localhost NodePort missing or empty: %+v (frontends %v)", np, k.local.frontends)
	}
	if np := byKey[nodeAddr.String()+":30080/TCP"]; len(np.Backends) != 2 {
		t.Errorf("node-address NodePort missing or empty: %+v", np)
	}
	if e := byKey["198.19.0.30:80/TCP"]; !e.Reject || len(e.Backends) != 0 {
		t.Errorf("service without endpoints: %+v, want reject", e)
	}
	// With nodePortAddresses leaving out the loopback address, no
	// NodePort on 127.0.0.1.
	k2 := newFakeKernel()
	k2.local = &fakeLocalClients{}
	startFakeNodeOn(t, k2, 1, func(c *EngineConfig) {
		c.LocalClientsCgroup, c.NoLocalhostNodePorts = "/sys/fs/cgroup/unified/test", true
	})
	for _, f := range k2.local.frontends {
		if f.Addr == localhostAddr {
			t.Errorf("a localhost frontend %v:%d although localhost NodePorts are off", f.Addr, f.Port)
		}
	}
	// externalTrafficPolicy Local: local-origin clients use every
	// endpoint, not only this node's (kube-proxy's short circuit).
	if lb := byKey["198.19.1.40:80/TCP"]; len(lb.Backends) != 1 {
		t.Errorf("LB IP of a Local service: %+v, want its (remote) endpoint for a local client", lb)
	}
}
