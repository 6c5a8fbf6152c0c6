package dataplane

import (
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
)

// TestSYNGuardFollowsTheFlood: new flows overrunning the connection table
// turn the XDP program's SYN guard on; it stays on while the program keeps
// dropping first SYNs at the flood's rate, and goes off once that has been
// calm for SYNGuardConfig.Calm.
func TestSYNGuardFollowsTheFlood(t *testing.T) {
	fn := startFakeNode(t, 1, func(c *EngineConfig) {
		c.SYNGuard = SYNGuardConfig{Trigger: 100, Calm: 400 * time.Millisecond, Interval: 20 * time.Millisecond}
	})
	guard := func() xdp.SYNGuard {
		fn.k.tables.mu.Lock()
		defer fn.k.tables.mu.Unlock()
		return fn.k.tables.synGuard
	}
	time.Sleep(100 * time.Millisecond)
	if fn.e.SYNGuardOn() || guard().On {
		t.Fatal("SYN guard on without a flood")
	}

	// A flood of half-open flows: more than the table holds.
	ct := fn.e.Conntrack()
	now := MonotonicNow()
	vip := addr("198.19.0.10")
	for i := range int(ct.Stats().Capacity) + 1000 {
		src := packet.AddrFrom4([4]byte{203, 0, byte(i >> 16), byte(i >> 8)})
		orig := packet.Tuple{Src: src, Dst: vip, SrcPort: uint16(1024 + i%60000), DstPort: 80, Proto: packet.ProtoTCP}
		tr := orig
		tr.Dst = addr("198.18.1.11")
		ct.Insert(orig, tr, 0, 1, now)
	}
	if st := ct.Stats(); st.EvictedUnassured+st.FullDrops < 100 {
		t.Fatalf("the flood overran nothing: %+v", st)
	}
	await(t, "the SYN guard on", func() bool { return fn.e.SYNGuardOn() })
	g := guard()
	if !g.On || g.MinRetry != synGuardMinRetry || g.Window != synGuardWindow {
		t.Fatalf("program's guard %+v, want on with the retransmission window", g)
	}

	// The flood goes on, now dropped by the program: the guard stays.
	onSince := time.Now()
	for time.Since(onSince) < time.Second {
		fn.k.tables.mu.Lock()
		fn.k.tables.counters.SYNGuardDropped += 500
		fn.k.tables.mu.Unlock()
		time.Sleep(10 * time.Millisecond)
		if !fn.e.SYNGuardOn() {
			t.Fatalf("the guard went off %v into a flood it still drops", time.Since(onSince))
		}
	}
	calmFrom := time.Now()
	await(t, "the SYN guard off", func() bool { return !fn.e.SYNGuardOn() })
	if d := time.Since(calmFrom); d < 300*time.Millisecond {
		t.Errorf("the guard went off %v after the flood, before Calm (400ms)", d)
	}
	if guard().On {
		t.Error("the program's guard is still on")
	}
}

// TestSYNGuardIgnoresOtherProtocols: new UDP flows that overrun the
// connection table (a node's DNS churn, a UDP flood) leave the guard off;
// new TCP flows that find the same table full turn it on.
func TestSYNGuardIgnoresOtherProtocols(t *testing.T) {
	fn := startFakeNode(t, 1, func(c *EngineConfig) {
		c.SYNGuard = SYNGuardConfig{Trigger: 100, Calm: 400 * time.Millisecond, Interval: 20 * time.Millisecond}
	})
	ct := fn.e.Conntrack()
	vip := addr("198.19.0.10")
	flood := func(proto packet.Proto, from int) {
		now := MonotonicNow()
		for i := range int(ct.Stats().Capacity) + 1000 {
			j := from + i
			src := packet.AddrFrom4([4]byte{203, byte(j >> 24), byte(j >> 16), byte(j >> 8)})
			orig := packet.Tuple{Src: src, Dst: vip, SrcPort: uint16(1024 + j%60000), DstPort: 53, Proto: proto}
			tr := orig
			tr.Dst = addr("198.18.1.11")
			ct.Insert(orig, tr, 0, 1, now)
		}
	}
	flood(packet.ProtoUDP, 0)
	if st := ct.Stats(); st.EvictedUnassured+st.FullDrops < 100 || st.TCPOverruns != 0 {
		t.Fatalf("the UDP flood: %+v; want it to overrun the table and no TCP insert counted", st)
	}
	time.Sleep(200 * time.Millisecond) // ten readings of the counters
	if fn.e.SYNGuardOn() {
		t.Fatal("the SYN guard turned on for a flood of UDP flows")
	}

	flood(packet.ProtoTCP, 1<<24)
	if st := ct.Stats(); st.TCPOverruns < 100 {
		t.Fatalf("the TCP flood overran nothing: %+v", st)
	}
	await(t, "the SYN guard on", func() bool { return fn.e.SYNGuardOn() })
}

// TestSYNGuardDisabled: a disabled guard never turns on.
func TestSYNGuardDisabled(t *testing.T) {
	fn := startFakeNode(t, 1, func(c *EngineConfig) {
		c.SYNGuard = SYNGuardConfig{Disabled: true, Trigger: 1, Interval: 10 * time.Millisecond}
	})
	ct := fn.e.Conntrack()
	now := MonotonicNow()
	for i := range int(ct.Stats().Capacity) + 1000 {
		orig := packet.Tuple{Src: packet.AddrFrom4([4]byte{203, 0, byte(i >> 8), byte(i)}), Dst: addr("198.19.0.10"),
			SrcPort: 1024, DstPort: 80, Proto: packet.ProtoTCP}
		tr := orig
		tr.Dst = addr("198.18.1.11")
		ct.Insert(orig, tr, 0, 1, now)
	}
	time.Sleep(100 * time.Millisecond)
	if fn.e.SYNGuardOn() {
		t.Error("a disabled SYN guard turned on")
	}
}
