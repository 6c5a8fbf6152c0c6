package conntrack

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

const sec = int64(time.Second)

var (
	client   = packet.MustParseAddr("198.18.0.10")
	client2  = packet.MustParseAddr("198.18.0.11")
	frontend = packet.MustParseAddr("198.18.100.1")
	backend  = packet.MustParseAddr("198.19.0.5")
	backend2 = packet.MustParseAddr("198.19.0.6")
	snatAddr = packet.MustParseAddr("198.18.200.1")
)

func tup(src packet.Addr, sport uint16, dst packet.Addr, dport uint16, p packet.Proto) packet.Tuple {
	return packet.Tuple{Src: src, Dst: dst, SrcPort: sport, DstPort: dport, Proto: p}
}

func newTable(t testing.TB, cfg Config) *Table {
	t.Helper()
	if cfg.Seed == 0 {
		cfg.Seed = 42
	}
	tb, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

func mustInsert(t testing.TB, tb *Table, orig, tr packet.Tuple, flags Flags, svc uint32, now int64) Handle {
	t.Helper()
	h, res := tb.Insert(orig, tr, flags, svc, now)
	if res != Inserted {
		t.Fatalf("Insert(%v -> %v) = %v", orig, tr, res)
	}
	return h
}

func mustLookup(t testing.TB, tb *Table, tu packet.Tuple, now int64) (Flow, Direction) {
	t.Helper()
	f, d, ok := tb.Lookup(tu, now)
	if !ok {
		t.Fatalf("Lookup(%v) missed", tu)
	}
	return f, d
}

func TestInsertLookupBothDirections(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	cases := []struct {
		name       string
		orig, tr   packet.Tuple
		flags      Flags
		replyTuple packet.Tuple
	}{
		{
			name:       "dnat",
			orig:       tup(client, 40000, frontend, 80, packet.ProtoTCP),
			tr:         tup(client, 40000, backend, 8080, packet.ProtoTCP),
			flags:      DNAT,
			replyTuple: tup(backend, 8080, client, 40000, packet.ProtoTCP),
		},
		{
			name:       "dnat+snat",
			orig:       tup(client, 40001, frontend, 53, packet.ProtoUDP),
			tr:         tup(snatAddr, 33000, backend, 5353, packet.ProtoUDP),
			flags:      DNAT | SNAT,
			replyTuple: tup(backend, 5353, snatAddr, 33000, packet.ProtoUDP),
		},
		{
			name:       "ipv6",
			orig:       tup(packet.MustParseAddr("2001:db8::1"), 1234, packet.MustParseAddr("2001:db8::100"), 443, packet.ProtoTCP),
			tr:         tup(packet.MustParseAddr("2001:db8::1"), 1234, packet.MustParseAddr("2001:db8:1::5"), 8443, packet.ProtoTCP),
			flags:      DNAT,
			replyTuple: tup(packet.MustParseAddr("2001:db8:1::5"), 8443, packet.MustParseAddr("2001:db8::1"), 1234, packet.ProtoTCP),
		},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := mustInsert(t, tb, c.orig, c.tr, c.flags, uint32(100+i), 0)
			f, d := mustLookup(t, tb, c.orig, sec)
			if d != Original || f.Rewrite != c.tr || f.Flags != c.flags || f.ServiceID != uint32(100+i) || f.Handle != h {
				t.Errorf("original: got %+v dir %v, want rewrite %v", f, d, c.tr)
			}
			f, d = mustLookup(t, tb, c.replyTuple, sec)
			if want := c.orig.Reverse(); d != Reply || f.Rewrite != want || f.Handle != h {
				t.Errorf("reply: got %+v dir %v, want rewrite %v", f, d, want)
			}
			// The translated tuple itself is not a key, nor is the
			// reverse of the original.
			if c.tr != c.orig {
				if _, _, ok := tb.Lookup(c.tr, sec); ok {
					t.Errorf("translated tuple %v found", c.tr)
				}
			}
			if _, _, ok := tb.Lookup(c.orig.Reverse(), sec); ok && c.orig.Reverse() != c.replyTuple {
				t.Errorf("reverse of the original %v found", c.orig.Reverse())
			}
		})
	}
	if st := tb.Stats(); st.Inserts != 3 || st.Live != 3 {
		t.Errorf("stats %+v", st)
	}
}

func TestInsertRefusesTakenKeys(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	orig := tup(client, 40000, frontend, 80, packet.ProtoTCP)
	tr := tup(client, 40000, backend, 8080, packet.ProtoTCP)
	mustInsert(t, tb, orig, tr, DNAT, 1, 0)
	if _, res := tb.Insert(orig, tup(client, 40000, backend2, 8080, packet.ProtoTCP), DNAT, 1, 0); res != OrigExists {
		t.Errorf("same original: %v, want OrigExists", res)
	}
	// Another frontend leading to the same backend with the same client
	// port: the reply tuple would be ambiguous.
	other := tup(client, 40000, packet.MustParseAddr("198.18.100.2"), 80, packet.ProtoTCP)
	if _, res := tb.Insert(other, tr, DNAT, 2, 0); res != ReplyExists {
		t.Errorf("same reply: %v, want ReplyExists", res)
	}
	// A reply tuple equal to an existing original key is also refused.
	if _, res := tb.Insert(tup(client2, 1, client2, 2, packet.ProtoTCP), orig.Reverse(), 0, 3, 0); res != ReplyExists {
		t.Errorf("reply equal to an original key: %v, want ReplyExists", res)
	}
	// A flow whose reply would be its own original tuple.
	self := tup(client, 5, client, 5, packet.ProtoUDP)
	if _, res := tb.Insert(self, self.Reverse(), 0, 3, 0); res != ReplyExists {
		t.Errorf("self-reply: %v, want ReplyExists", res)
	}
	st := tb.Stats()
	if st.OrigExists != 1 || st.ReplyExists != 3 || st.Inserts != 1 {
		t.Errorf("stats %+v", st)
	}
	if ReplyExists.Reason() != packet.DropNoSNATPort || Full.Reason() != packet.DropConntrackFull || Inserted.Reason() != packet.OK {
		t.Error("InsertResult.Reason mapping")
	}
}

// expiresAt returns when the flow holding tu expires.
func expiresAt(t *testing.T, tb *Table, tu packet.Tuple) int64 {
	t.Helper()
	for fi := range tb.All(0) {
		if fi.Orig == tu {
			return int64(fi.Expires)
		}
	}
	t.Fatalf("flow %v not found by All", tu)
	return 0
}

func TestTCPLifecycleAndTimeouts(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	orig := tup(client, 40000, frontend, 80, packet.ProtoTCP)
	tr := tup(client, 40000, backend, 8080, packet.ProtoTCP)
	h := mustInsert(t, tb, orig, tr, DNAT, 1, 0)
	now := int64(0)
	steps := []struct {
		dir     Direction
		flags   uint8
		want    State
		timeout time.Duration
	}{
		{Original, packet.TCPSyn, TCPSynSent, 120 * time.Second},
		{Original, packet.TCPSyn, TCPSynSent, 120 * time.Second}, // retransmit
		{Reply, packet.TCPSyn | packet.TCPAck, TCPSynRecv, 60 * time.Second},
		{Original, packet.TCPAck, TCPEstablished, 432000 * time.Second},
		{Reply, packet.TCPAck | packet.TCPPsh, TCPEstablished, 432000 * time.Second},
		{Original, packet.TCPFin | packet.TCPAck, TCPFinWait, 120 * time.Second},
		{Original, packet.TCPAck, TCPFinWait, 120 * time.Second}, // the closer's own ACK changes nothing
		{Reply, packet.TCPAck, TCPCloseWait, 60 * time.Second},
		{Reply, packet.TCPFin | packet.TCPAck, TCPLastAck, 30 * time.Second},
		{Original, packet.TCPAck, TCPTimeWait, 120 * time.Second},
		{Original, packet.TCPSyn, TCPSynSent, 120 * time.Second}, // port reuse
		{Reply, packet.TCPRst, TCPClose, 10 * time.Second},
	}
	for i, s := range steps {
		now += 5 * sec
		if _, d := mustLookup(t, tb, orig, now); d != Original {
			t.Fatalf("step %d: direction %v", i, d)
		}
		got, ok := tb.Update(h, s.dir, s.flags, now)
		if !ok || got != s.want {
			t.Fatalf("step %d (%v flags %#x): state %v ok %v, want %v", i, s.dir, s.flags, got, ok, s.want)
		}
		if exp := expiresAt(t, tb, orig); exp != now+int64(s.timeout) {
			t.Fatalf("step %d: expires at %v, want %v", i, time.Duration(exp), time.Duration(now+int64(s.timeout)))
		}
	}
	// CLOSE lives 10 s.
	if _, _, ok := tb.Lookup(orig, now+10*sec-1e6); !ok {
		t.Error("closed flow gone before its 10 s")
	}
	if _, _, ok := tb.Lookup(orig, now+10*sec); ok {
		t.Error("closed flow still found after 10 s")
	}
	if _, _, ok := tb.Lookup(tr.Reverse(), now+10*sec); ok {
		t.Error("closed flow still found by its reply after 10 s")
	}
}

func TestTCPTransitions(t *testing.T) {
	const (
		syn    = packet.TCPSyn
		synack = packet.TCPSyn | packet.TCPAck
		ack    = packet.TCPAck
		fin    = packet.TCPFin | packet.TCPAck
		rst    = packet.TCPRst
	)
	cases := []struct {
		from   State
		closer Direction
		dir    Direction
		flags  uint8
		to     State
	}{
		{TCPNone, Original, Original, syn, TCPSynSent},
		{TCPNone, Original, Original, ack, TCPEstablished}, // loose pick-up
		{TCPSynSent, Original, Reply, synack, TCPSynRecv},
		{TCPSynSent, Original, Original, synack, TCPSynSent}, // SYN/ACK from the client is ignored
		{TCPSynSent, Original, Reply, syn, TCPSynSent},       // simultaneous open not modelled
		{TCPSynSent, Original, Original, ack, TCPSynSent},
		{TCPSynRecv, Original, Reply, ack, TCPSynRecv},
		{TCPSynRecv, Original, Original, ack, TCPEstablished},
		{TCPSynRecv, Original, Original, fin, TCPFinWait},
		{TCPEstablished, Original, Original, syn, TCPEstablished},
		{TCPEstablished, Original, Reply, fin, TCPFinWait},
		{TCPFinWait, Reply, Reply, fin, TCPFinWait},        // FIN retransmitted by the closer
		{TCPFinWait, Reply, Original, fin, TCPLastAck},     // both FINs at once
		{TCPFinWait, Reply, Original, ack, TCPCloseWait},   // the other side acks
		{TCPCloseWait, Reply, Original, fin, TCPLastAck},   // then closes
		{TCPCloseWait, Reply, Reply, fin, TCPCloseWait},    // closer again: nothing new
		{TCPLastAck, Reply, Original, ack, TCPLastAck},     // not the final ACK
		{TCPLastAck, Reply, Reply, ack, TCPTimeWait},       // the closer acks the last FIN
		{TCPTimeWait, Original, Original, syn, TCPSynSent}, // port reuse
		{TCPClose, Original, Original, syn, TCPSynSent},
		{TCPClose, Original, Reply, ack, TCPClose},
		{TCPEstablished, Original, Original, rst, TCPClose},
		{TCPSynSent, Original, Reply, rst | packet.TCPAck, TCPClose},
	}
	for _, c := range cases {
		var status uint8
		if c.closer == Reply {
			status = statusCloserReply
		}
		got, _ := next(c.from, status, c.dir, c.flags, false)
		if got != c.to {
			t.Errorf("%v (closer %v) + %v flags %#x = %v, want %v", c.from, c.closer, c.dir, c.flags, got, c.to)
		}
	}
}

// TestUDPRepliedAndUnreplied follows nf_conntrack_proto_udp: 30 s until a
// reply; a replied flow keeps 30 s until a packet more than 2 s after its
// creation makes it a stream: assured, 120 s.
func TestUDPRepliedAndUnreplied(t *testing.T) {
	type step struct {
		at      int64 // ms since the insert
		dir     Direction
		state   State
		assured bool
		expires int64 // ms since the insert
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"unreplied", []step{
			{0, Original, UDPUnreplied, false, 30000},
			{1500, Original, UDPUnreplied, false, 31500},
			{10000, Original, UDPUnreplied, false, 40000},
		}},
		{"quick answer then quiet", []step{
			{100, Reply, UDPReplied, false, 30100},
			{1900, Original, UDPReplied, false, 31900}, // within 2 s: not a stream
		}},
		{"stream", []step{
			{100, Reply, UDPReplied, false, 30100},
			{2001, Original, UDPReplied, true, 122001},
			{3500, Reply, UDPReplied, true, 123500}, // refreshes under 1 s are skipped: this one is 1.5 s
		}},
		{"late first reply is not yet a stream", []step{
			{5000, Reply, UDPReplied, false, 35000}, // the reply itself does not assure (netfilter sets seen-reply after)
			{5500, Reply, UDPReplied, true, 125500},
		}},
		{"exactly 2 s is not after 2 s", []step{
			{1000, Reply, UDPReplied, false, 31000},
			{2000, Original, UDPReplied, false, 32000},
			{2001, Original, UDPReplied, true, 122001},
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tb := newTable(t, Config{Capacity: 64})
			base := int64(i+1) * 1000 * sec
			q := tup(client, uint16(5000+i), frontend, 53, packet.ProtoUDP)
			h := mustInsert(t, tb, q, tup(client, uint16(5000+i), backend, 53, packet.ProtoUDP), DNAT, 1, base)
			for j, s := range c.steps {
				now := base + s.at*int64(time.Millisecond)
				got, ok := tb.Update(h, s.dir, 0, now)
				if !ok || got != s.state {
					t.Fatalf("step %d: %v %v, want %v", j, got, ok, s.state)
				}
				fi := flowInfo(t, tb, q)
				if fi.Assured != s.assured || fi.SeenReply != (s.state == UDPReplied) {
					t.Errorf("step %d: assured %v seen reply %v, want %v", j, fi.Assured, fi.SeenReply, s.assured)
				}
				if want := time.Duration(base) + time.Duration(s.expires)*time.Millisecond; fi.Expires != want {
					t.Errorf("step %d: expires at %v, want %v", j, fi.Expires, want)
				}
			}
			last := c.steps[len(c.steps)-1]
			end := base + last.expires*int64(time.Millisecond)
			if _, _, ok := tb.Lookup(q, end-1e6); !ok {
				t.Error("flow gone before its deadline")
			}
			if _, _, ok := tb.Lookup(q, end); ok {
				t.Error("flow alive at its deadline")
			}
		})
	}
}

// flowInfo returns the FlowInfo of the flow with original tuple tu.
func flowInfo(t *testing.T, tb *Table, tu packet.Tuple) FlowInfo {
	t.Helper()
	for fi := range tb.All(0) {
		if fi.Orig == tu {
			return fi
		}
	}
	t.Fatalf("flow %v not found by All", tu)
	return FlowInfo{}
}

func TestICMPAndOtherTimeouts(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	echo := tup(client, 77, frontend, 77, packet.ProtoICMP)
	mustInsert(t, tb, echo, tup(client, 77, backend, 77, packet.ProtoICMP), DNAT, 1, 0)
	if exp := expiresAt(t, tb, echo); exp != 30*sec {
		t.Errorf("ICMP echo expires at %v", time.Duration(exp))
	}
	sctp := tup(client, 9, frontend, 9, packet.ProtoSCTP)
	mustInsert(t, tb, sctp, tup(client, 9, backend, 9, packet.ProtoSCTP), DNAT, 1, 0)
	if exp := expiresAt(t, tb, sctp); exp != 600*sec {
		t.Errorf("SCTP expires at %v", time.Duration(exp))
	}
}

func TestConfiguredTimeouts(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64, Timeouts: Timeouts{TCPEstablished: time.Hour, UDPUnreplied: 5 * time.Second}})
	tcp := tup(client, 1, frontend, 80, packet.ProtoTCP)
	h := mustInsert(t, tb, tcp, tup(client, 1, backend, 80, packet.ProtoTCP), DNAT, 1, 0)
	// Picked up mid-stream: ESTABLISHED, but capped at 300 s
	// (TCPUnacknowledged) until the other side answers.
	tb.Update(h, Original, packet.TCPAck, 0)
	if exp := expiresAt(t, tb, tcp); exp != 300*sec {
		t.Errorf("unanswered established expires at %v, want 300s", time.Duration(exp))
	}
	tb.Update(h, Reply, packet.TCPAck, 0)
	if exp := expiresAt(t, tb, tcp); exp != int64(time.Hour) {
		t.Errorf("established expires at %v, want 1h", time.Duration(exp))
	}
	udp := tup(client, 1, frontend, 53, packet.ProtoUDP)
	mustInsert(t, tb, udp, tup(client, 1, backend, 53, packet.ProtoUDP), DNAT, 1, 0)
	if exp := expiresAt(t, tb, udp); exp != 5*sec {
		t.Errorf("UDP expires at %v, want 5s", time.Duration(exp))
	}
	// Unset fields keep the default.
	if tb.timeout[0][TCPSynSent] != 120000 || tb.timeout[1][TCPSynSent] != 120000 {
		t.Errorf("SYN_SENT timeout %d ms", tb.timeout[0][TCPSynSent])
	}
}

func TestKubeProxyTimeouts(t *testing.T) {
	want := DefaultTimeouts
	want.TCPEstablished, want.TCPCloseWait = 24*time.Hour, time.Hour
	if KubeProxyTimeouts != want {
		t.Errorf("KubeProxyTimeouts %+v", KubeProxyTimeouts)
	}
	if DefaultTimeouts.TCPEstablished != 5*24*time.Hour || DefaultTimeouts.TCPCloseWait != time.Minute {
		t.Errorf("DefaultTimeouts changed: %+v", DefaultTimeouts)
	}
	tb := newTable(t, Config{Capacity: 64, Timeouts: KubeProxyTimeouts})
	if tb.timeout[1][TCPEstablished] != 24*3600*1000 || tb.timeout[0][TCPEstablished] != 300*1000 ||
		tb.timeout[1][TCPCloseWait] != 3600*1000 || tb.timeout[1][UDPReplied] != 120*1000 || tb.timeout[0][UDPReplied] != 30*1000 {
		t.Errorf("timeouts %v", tb.timeout)
	}
}

func TestUpdateSkipsSmallRefreshes(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	udp := tup(client, 1, frontend, 53, packet.ProtoUDP)
	h := mustInsert(t, tb, udp, tup(client, 1, backend, 53, packet.ProtoUDP), DNAT, 1, 0)
	tb.Update(h, Original, 0, 900*int64(time.Millisecond))
	if exp := expiresAt(t, tb, udp); exp != 30*sec {
		t.Errorf("a refresh of 0.9 s was written: expires at %v", time.Duration(exp))
	}
	tb.Update(h, Original, 0, 2*sec)
	if exp := expiresAt(t, tb, udp); exp != 32*sec {
		t.Errorf("a refresh of 2 s was skipped: expires at %v", time.Duration(exp))
	}
	// An earlier clock (another worker's) never shortens the deadline.
	tb.Update(h, Original, 0, 0)
	if exp := expiresAt(t, tb, udp); exp != 32*sec {
		t.Errorf("deadline moved back to %v", time.Duration(exp))
	}
}

func TestStaleHandles(t *testing.T) {
	tb := newTable(t, Config{Capacity: 1}) // one entry: every insert reuses it
	a := tup(client, 1, frontend, 80, packet.ProtoTCP)
	ha := mustInsert(t, tb, a, tup(client, 1, backend, 80, packet.ProtoTCP), DNAT, 1, 0)
	if !tb.Delete(ha) {
		t.Fatal("Delete failed")
	}
	if tb.Delete(ha) {
		t.Error("second Delete succeeded")
	}
	if _, ok := tb.Update(ha, Original, packet.TCPSyn, 0); ok {
		t.Error("Update of a deleted flow succeeded")
	}
	b := tup(client, 2, frontend, 80, packet.ProtoTCP)
	hb := mustInsert(t, tb, b, tup(client, 2, backend, 80, packet.ProtoTCP), DNAT, 2, 0)
	if hb.idx != ha.idx || hb.gen == ha.gen {
		t.Fatalf("expected reuse of the entry with a new generation: %+v %+v", ha, hb)
	}
	if _, ok := tb.Update(ha, Original, packet.TCPRst, 0); ok {
		t.Error("old handle updated the new flow")
	}
	if f, _ := mustLookup(t, tb, b, 0); f.State != TCPNone {
		t.Errorf("new flow state %v", f.State)
	}
	if _, ok := tb.Update(Handle{}, Original, 0, 0); ok || tb.Delete(Handle{}) {
		t.Error("zero Handle accepted")
	}
	if _, _, ok := tb.Lookup(a, 0); ok {
		t.Error("deleted flow found")
	}
}

func TestSweep(t *testing.T) {
	var removedFlows sync.Map
	tb := newTable(t, Config{Capacity: 1000, OnRemove: func(orig, reply packet.Tuple) {
		if _, dup := removedFlows.LoadOrStore(orig, reply); dup {
			t.Errorf("OnRemove twice for %v", orig)
		}
	}})
	for i := range 500 {
		orig := tup(client, uint16(1000+i), frontend, 53, packet.ProtoUDP)
		h := mustInsert(t, tb, orig, tup(client, uint16(1000+i), backend, 53, packet.ProtoUDP), DNAT, 1, 0)
		if i%2 == 0 {
			tb.Update(h, Reply, 0, 0)        // replied,
			tb.Update(h, Original, 0, 3*sec) // then a stream: 120 s from 3 s
		}
	}
	removed := 0
	for range 1000 / 64 {
		removed += tb.Sweep(64, 29*sec)
	}
	if removed != 0 {
		t.Fatalf("swept %d live flows", removed)
	}
	removed = 0
	for range (1000 + 63) / 64 {
		removed += tb.Sweep(64, 30*sec)
	}
	if removed != 250 {
		t.Fatalf("swept %d flows at 30 s, want the 250 unreplied", removed)
	}
	removed = 0
	removed += tb.Sweep(5000, 123*sec) // budget larger than the table
	if removed != 250 {
		t.Fatalf("swept %d flows at 123 s, want 250", removed)
	}
	st := tb.Stats()
	if st.Expired != 500 || st.Live != 0 {
		t.Errorf("stats %+v", st)
	}
	if n := tb.Sweep(0, 200*sec); n != 0 {
		t.Errorf("zero budget swept %d", n)
	}
	n := 0
	removedFlows.Range(func(k, v any) bool {
		n++
		o, r := k.(packet.Tuple), v.(packet.Tuple)
		if r != tup(backend, 53, client, o.SrcPort, packet.ProtoUDP) {
			t.Errorf("OnRemove(%v, %v): wrong reply tuple", o, r)
		}
		return true
	})
	if n != 500 {
		t.Errorf("OnRemove called for %d flows, want 500", n)
	}
}

func TestExpiredFlowGivesWayOnInsert(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	orig := tup(client, 1, frontend, 53, packet.ProtoUDP)
	mustInsert(t, tb, orig, tup(client, 1, backend, 53, packet.ProtoUDP), DNAT, 1, 0)
	if _, res := tb.Insert(orig, tup(client, 1, backend2, 53, packet.ProtoUDP), DNAT, 1, 29*sec); res != OrigExists {
		t.Fatalf("live flow: %v", res)
	}
	mustInsert(t, tb, orig, tup(client, 1, backend2, 53, packet.ProtoUDP), DNAT, 1, 31*sec)
	if f, _ := mustLookup(t, tb, orig, 31*sec); f.Rewrite.Dst != backend2 {
		t.Errorf("old translation returned: %v", f.Rewrite)
	}
	if _, _, ok := tb.Lookup(tup(backend, 53, client, 1, packet.ProtoUDP), 31*sec); ok {
		t.Error("reply key of the expired flow still present")
	}
	if st := tb.Stats(); st.ExpiredOnInsert != 1 || st.Live != 1 {
		t.Errorf("stats %+v", st)
	}
}

// TestEvictionTakesARipeFlowAtOnce: a full shard's eviction takes the
// first unassured flow at its cursor that is at least half as old as the
// shard's recent victims, without reading the rest of the window; a
// younger one is passed over for the window's oldest.
func TestEvictionTakesARipeFlowAtOnce(t *testing.T) {
	for _, c := range []struct {
		name        string
		victimAgeMs uint64
		victim      string
	}{
		{"ripe at the cursor", 4000, "g"},    // g, 12 s old, is ripe at 2 s
		{"young at the cursor", 30000, "f1"}, // g is not ripe at 15 s: the window's oldest goes
		{"no victims yet", 0, "f1"},          // the whole window, as before
	} {
		t.Run(c.name, func(t *testing.T) {
			var removed []packet.Tuple
			tb := newTable(t, Config{Capacity: 8, OnRemove: func(orig, _ packet.Tuple) { removed = append(removed, orig) }})
			if len(tb.shards) != 1 {
				t.Fatalf("%d shards, want 1", len(tb.shards))
			}
			flow := func(port uint16) packet.Tuple { return tup(client, port, frontend, 53, packet.ProtoUDP) }
			names := map[packet.Tuple]string{}
			var first Handle
			for i := range 8 { // f0..f7 at 0..7 s, in entries 0..7
				o := flow(uint16(100 + i))
				names[o] = fmt.Sprint("f", i)
				h := mustInsert(t, tb, o, tup(client, uint16(100+i), backend, 53, packet.ProtoUDP), DNAT, 1, int64(i)*sec)
				if i == 0 {
					first = h
				}
			}
			// g takes f0's entry, the first at the cursor, at 8 s.
			tb.Delete(first)
			removed = nil
			names[flow(200)] = "g"
			mustInsert(t, tb, flow(200), tup(client, 200, backend, 53, packet.ProtoUDP), DNAT, 1, 8*sec)
			tb.shards[0].victimAgeMs = c.victimAgeMs
			mustInsert(t, tb, flow(300), tup(client, 300, backend, 53, packet.ProtoUDP), DNAT, 1, 20*sec)
			if len(removed) != 1 || names[removed[0]] != c.victim {
				var got []string
				for _, r := range removed {
					got = append(got, names[r])
				}
				t.Fatalf("evicted %v, want %s", got, c.victim)
			}
		})
	}
}

// TestEarlyDrop checks which flow an insert into a full shard replaces:
// an expired one first, else the oldest flow that is not assured, in any
// state; never an assured flow.
func TestEarlyDrop(t *testing.T) {
	// Each flow is made by a list of (direction, flags, ms after its
	// insert) packets; flow i is inserted at i seconds.
	type pkt struct {
		dir   Direction
		flags uint8
		at    int64
	}
	var (
		synOnly   = []pkt{{Original, packet.TCPSyn, 0}}
		synRecv   = []pkt{{Original, packet.TCPSyn, 0}, {Reply, packet.TCPSyn | packet.TCPAck, 1}}
		handshake = []pkt{{Original, packet.TCPSyn, 0}, {Reply, packet.TCPSyn | packet.TCPAck, 1}, {Original, packet.TCPAck, 2}}
		loose     = []pkt{{Original, packet.TCPAck, 0}}
		looseBoth = []pkt{{Original, packet.TCPAck, 0}, {Reply, packet.TCPAck, 1}}
		closing   = []pkt{{Original, packet.TCPAck, 0}, {Original, packet.TCPFin | packet.TCPAck, 1}} // FIN_WAIT, never assured
		udpQuery  = []pkt{}
		udpQuick  = []pkt{{Reply, 0, 100}}                      // replied within 2 s: not assured
		udpStream = []pkt{{Reply, 0, 100}, {Original, 0, 2500}} // assured
	)
	tcp, udp := packet.ProtoTCP, packet.ProtoUDP
	type flow struct {
		proto   packet.Proto
		pkts    []pkt
		assured bool
	}
	cases := []struct {
		name    string
		flows   []flow
		now     int64 // s, when the fifth flow is inserted
		victim  int   // -1: the insert fails with Full
		kind    string
		counter func(Stats) uint64
	}{
		{"oldest unreplied", []flow{{tcp, handshake, true}, {udp, udpQuery, false}, {tcp, synOnly, false}, {udp, udpQuery, false}}, 10, 1, "unreplied",
			func(s Stats) uint64 { return s.EvictedUnreplied }},
		{"replied but not assured UDP goes first when oldest", []flow{{udp, udpQuick, false}, {udp, udpStream, true}, {udp, udpQuery, false}, {tcp, handshake, true}}, 10, 0, "unassured",
			func(s Stats) uint64 { return s.EvictedUnassured - s.EvictedUnreplied }},
		{"SYN_RECV is unassured", []flow{{tcp, handshake, true}, {tcp, synRecv, false}, {udp, udpStream, true}, {tcp, looseBoth, true}}, 10, 1, "unassured",
			func(s Stats) uint64 { return s.EvictedUnassured }},
		{"closing without handshake is unassured", []flow{{tcp, handshake, true}, {udp, udpStream, true}, {tcp, closing, false}, {tcp, loose, false}}, 10, 2, "unassured",
			func(s Stats) uint64 { return s.EvictedUnassured }},
		{"all assured: full", []flow{{tcp, handshake, true}, {udp, udpStream, true}, {tcp, looseBoth, true}, {tcp, handshake, true}}, 10, -1, "",
			func(s Stats) uint64 { return s.FullDrops }},
		{"expired before unassured", []flow{{udp, udpQuery, false}, {tcp, handshake, true}, {tcp, synOnly, false}, {tcp, handshake, true}}, 32, 0, "expired",
			func(s Stats) uint64 { return s.EvictedExpired }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var removed []packet.Tuple
			tb := newTable(t, Config{Capacity: 4, OnRemove: func(orig, _ packet.Tuple) { removed = append(removed, orig) }})
			orig := func(i int, p packet.Proto) packet.Tuple { return tup(client, uint16(100+i), frontend, 80, p) }
			for i, f := range c.flows {
				o := orig(i, f.proto)
				h := mustInsert(t, tb, o, tup(client, uint16(100+i), backend, 8080, f.proto), DNAT, uint32(i), int64(i)*sec)
				for _, p := range f.pkts {
					if _, ok := tb.Update(h, p.dir, p.flags, int64(i)*sec+p.at*int64(time.Millisecond)); !ok {
						t.Fatalf("flow %d: update failed", i)
					}
				}
				if fi := flowInfo(t, tb, o); fi.Assured != f.assured {
					t.Fatalf("flow %d (%v): assured %v, want %v", i, fi.State, fi.Assured, f.assured)
				}
			}
			st := tb.Stats()
			nAssured := 0
			for _, f := range c.flows {
				if f.assured {
					nAssured++
				}
			}
			if st.Assured != uint64(nAssured) || st.Unassured != uint64(len(c.flows)-nAssured) {
				t.Errorf("stats: %d assured, %d unassured, want %d", st.Assured, st.Unassured, nAssured)
			}
			newFlow := tup(client2, 1, frontend, 80, packet.ProtoUDP)
			_, res := tb.Insert(newFlow, tup(client2, 1, backend, 8080, packet.ProtoUDP), DNAT, 9, c.now*sec)
			if c.victim < 0 {
				if res != Full || len(removed) != 0 {
					t.Fatalf("insert: %v, removed %v; want Full", res, removed)
				}
			} else {
				if res != Inserted {
					t.Fatalf("insert: %v", res)
				}
				if want := orig(c.victim, c.flows[c.victim].proto); len(removed) != 1 || removed[0] != want {
					t.Fatalf("removed %v, want flow %d %v", removed, c.victim, want)
				}
				if _, _, ok := tb.Lookup(removed[0], c.now*sec); ok {
					t.Error("victim still found")
				}
			}
			for i, f := range c.flows {
				if _, _, ok := tb.Lookup(orig(i, f.proto), c.now*sec); !ok && i != c.victim {
					t.Errorf("flow %d lost", i)
				}
			}
			if got := c.counter(tb.Stats()); got != 1 {
				t.Errorf("%s counter %d, want 1: %+v", c.kind, got, tb.Stats())
			}
		})
	}
}

func TestDeleteByBackend(t *testing.T) {
	tb := newTable(t, Config{Capacity: 256})
	for i := range 30 {
		be, port := backend, uint16(53)
		switch i % 3 {
		case 1:
			be = backend2
		case 2:
			port = 5353
		}
		o := tup(client, uint16(1000+i), frontend, 53, packet.ProtoUDP)
		mustInsert(t, tb, o, tup(client, uint16(1000+i), be, port, packet.ProtoUDP), DNAT, 1, 0)
	}
	tcp := tup(client, 999, frontend, 53, packet.ProtoTCP)
	mustInsert(t, tb, tcp, tup(client, 999, backend, 53, packet.ProtoTCP), DNAT, 1, 0)

	if n := tb.DeleteByBackend(backend, 53, packet.ProtoUDP); n != 10 {
		t.Errorf("deleted %d, want 10", n)
	}
	if _, _, ok := tb.Lookup(tcp, 0); !ok {
		t.Error("TCP flow to the same backend port deleted")
	}
	if _, _, ok := tb.Lookup(tup(backend, 53, client, 1000, packet.ProtoUDP), 0); ok {
		t.Error("reply key of a deleted flow found")
	}
	if n := tb.DeleteByBackend(backend, 0, 0); n != 11 {
		t.Errorf("all ports, all protocols: deleted %d, want 11", n)
	}
	if st := tb.Stats(); st.Deleted != 21 || st.Live != 10 {
		t.Errorf("stats %+v", st)
	}
	for fi := range tb.All(0) {
		if fi.Translated.Dst != backend2 {
			t.Errorf("left over %v", fi.Translated)
		}
	}
}

// TestDeleteByBackends: one scan removes what DeleteByBackend would for
// each key, IPv4 and IPv6, by both tuples, with the OnRemove calls and
// counters, and counts each flow for the most specific key.
func TestDeleteByBackends(t *testing.T) {
	var mu sync.Mutex
	gone := map[packet.Tuple]bool{} // reply tuples OnRemove was given
	tb := newTable(t, Config{Capacity: 256, OnRemove: func(_, reply packet.Tuple) {
		mu.Lock()
		defer mu.Unlock()
		gone[reply] = true
	}})
	v6client, v6frontend := packet.MustParseAddr("2001:db8::10"), packet.MustParseAddr("2001:db8::100")
	v6a, v6b := packet.MustParseAddr("2001:db8:1::5"), packet.MustParseAddr("2001:db8:1::6")
	type flow struct{ orig, tr packet.Tuple }
	var flows []flow
	sport := uint16(1000)
	for _, be := range []packet.Addr{backend, backend2, v6a, v6b} {
		c, f := client, frontend
		if !be.Is4() {
			c, f = v6client, v6frontend
		}
		// Three UDP flows to port 53, one to 5353, one TCP to 53.
		for _, d := range []struct {
			port  uint16
			proto packet.Proto
		}{{53, packet.ProtoUDP}, {53, packet.ProtoUDP}, {53, packet.ProtoUDP}, {5353, packet.ProtoUDP}, {53, packet.ProtoTCP}} {
			sport++
			o := tup(c, sport, f, 53, d.proto)
			tr := tup(c, sport, be, d.port, d.proto)
			mustInsert(t, tb, o, tr, DNAT, 1, 0)
			flows = append(flows, flow{o, tr})
		}
	}
	check := func(deleted func(tr packet.Tuple) bool) {
		t.Helper()
		for _, f := range flows {
			_, _, origOK := tb.Lookup(f.orig, 0)
			_, _, replyOK := tb.Lookup(f.tr.Reverse(), 0)
			mu.Lock()
			told := gone[f.tr.Reverse()]
			mu.Unlock()
			if d := deleted(f.tr); origOK == d || replyOK == d || told != d {
				t.Errorf("flow to %v: original found %v, reply found %v, OnRemove %v; want deleted %v", f.tr, origOK, replyOK, told, d)
			}
		}
	}

	keys := map[Backend]int{
		{Addr: backend, Port: 53, Proto: packet.ProtoUDP}: 0,
		{Addr: v6a, Port: 53, Proto: packet.ProtoUDP}:     0,
		{Addr: v6b}: 0, // every port and protocol
		{Addr: packet.MustParseAddr("198.19.0.99"), Port: 53, Proto: packet.ProtoUDP}: 0,
	}
	if n := tb.DeleteByBackends(keys); n != 11 {
		t.Errorf("deleted %d, want 11", n)
	}
	if want := map[Backend]int{
		{Addr: backend, Port: 53, Proto: packet.ProtoUDP}: 3,
		{Addr: v6a, Port: 53, Proto: packet.ProtoUDP}:     3,
		{Addr: v6b}: 5,
		{Addr: packet.MustParseAddr("198.19.0.99"), Port: 53, Proto: packet.ProtoUDP}: 0,
	}; fmt.Sprint(keys) != fmt.Sprint(want) {
		t.Errorf("counts %v, want %v", keys, want)
	}
	check(func(tr packet.Tuple) bool {
		return tr.Dst == v6b || (tr.DstPort == 53 && tr.Proto == packet.ProtoUDP && (tr.Dst == backend || tr.Dst == v6a))
	})

	// backend has UDP 5353 and TCP 53 left: the exact key takes the
	// first, the address-only key the other.
	keys = map[Backend]int{{Addr: backend, Port: 5353, Proto: packet.ProtoUDP}: 0, {Addr: backend}: 0}
	if n := tb.DeleteByBackends(keys); n != 2 || keys[Backend{Addr: backend, Port: 5353, Proto: packet.ProtoUDP}] != 1 || keys[Backend{Addr: backend}] != 1 {
		t.Errorf("deleted %d, counts %v; want 2, 1 each", n, keys)
	}
	if n := tb.DeleteByBackends(nil); n != 0 {
		t.Errorf("no keys deleted %d", n)
	}
	if st := tb.Stats(); st.Deleted != 13 || st.Live != 7 {
		t.Errorf("stats %+v", st)
	}
	check(func(tr packet.Tuple) bool {
		return tr.Dst == v6b || tr.Dst == backend || (tr.DstPort == 53 && tr.Proto == packet.ProtoUDP && tr.Dst == v6a)
	})
}

func TestAllAndCountByState(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	o := tup(client, 1, frontend, 80, packet.ProtoTCP)
	h := mustInsert(t, tb, o, tup(snatAddr, 40000, backend, 8080, packet.ProtoTCP), DNAT|SNAT, 7, 2*sec)
	tb.Update(h, Original, packet.TCPAck, 2*sec)
	mustInsert(t, tb, tup(client, 2, frontend, 53, packet.ProtoUDP), tup(client, 2, backend, 53, packet.ProtoUDP), DNAT, 8, 2*sec)
	mustInsert(t, tb, tup(client, 3, frontend, 53, packet.ProtoUDP), tup(client, 3, backend, 53, packet.ProtoUDP), DNAT, 8, 2*sec)
	tb.Update(h, Reply, packet.TCPAck, 2*sec) // answered: assured
	c := tb.CountByState(3 * sec)
	if c[TCPEstablished] != 1 || c[UDPUnreplied] != 2 || c[TCPNone] != 0 {
		t.Errorf("counts %v", c)
	}
	if c := tb.CountByState(40 * sec); c[UDPUnreplied] != 0 || c[TCPEstablished] != 1 {
		t.Errorf("counts after UDP expiry %v", c)
	}
	st := tb.Stats()
	if st.ByState[TCPEstablished] != 1 || st.ByState[UDPUnreplied] != 2 || st.Assured != 1 || st.Unassured != 2 ||
		st.FillRatio != 3.0/64 || st.Capacity != 64 {
		t.Errorf("stats %+v", st)
	}
	n := 0
	for fi := range tb.All(3 * sec) {
		n++
		if fi.ServiceID == 7 {
			want := FlowInfo{Handle: h, Orig: o, Translated: tup(snatAddr, 40000, backend, 8080, packet.ProtoTCP),
				Flags: DNAT | SNAT, ServiceID: 7, State: TCPEstablished, SeenReply: true, Assured: true,
				Created: 2 * time.Second, Expires: 2*time.Second + 432000*time.Second}
			if fi != want {
				t.Errorf("got %+v\nwant %+v", fi, want)
			}
			if fi.Reply() != tup(backend, 8080, snatAddr, 40000, packet.ProtoTCP) {
				t.Errorf("reply %v", fi.Reply())
			}
		}
	}
	if n != 3 {
		t.Errorf("All yielded %d flows", n)
	}
	for range tb.All(0) {
		break // stopping early must be fine
	}
}

// TestChurnMatchesModel drives random inserts, deletes, expiries and lookups
// through a small table and checks every answer against a map. The small
// index and the churn exercise tombstones, their cleanup and rebuilds.
func TestChurnMatchesModel(t *testing.T) {
	// Long timeouts: expiry is tested elsewhere, here the model ignores it.
	tb := newTable(t, Config{Capacity: 48, Timeouts: Timeouts{TCPSynSent: time.Hour}})
	type model struct {
		orig, tr packet.Tuple
		h        Handle
		assured  bool
	}
	frontends := []packet.Addr{frontend, packet.MustParseAddr("198.18.100.2"), packet.MustParseAddr("198.18.100.3")}
	live := map[packet.Tuple]*model{} // by original tuple
	byReply := map[packet.Tuple]packet.Tuple{}
	rng := rand.New(rand.NewPCG(1, 2))
	now := int64(0)
	check := func(step int) {
		for _, m := range live {
			f, d, ok := tb.Lookup(m.orig, now)
			if !ok || d != Original || f.Rewrite != m.tr {
				t.Fatalf("step %d: lookup %v: %v %+v, model %+v", step, m.orig, ok, f, m)
			}
			f, d, ok = tb.Lookup(m.tr.Reverse(), now)
			if !ok || d != Reply || f.Rewrite != m.orig.Reverse() {
				t.Fatalf("step %d: reply lookup %v: %v %+v", step, m.tr.Reverse(), ok, f)
			}
		}
	}
	steps := 200000
	if raceEnabled {
		steps = 50000
	}
	for step := range steps {
		now += int64(time.Millisecond)
		cport := uint16(rng.IntN(96))
		orig := tup(client, cport, frontends[rng.IntN(len(frontends))], 80, packet.ProtoTCP)
		tr := tup(client, cport, backend, uint16(8000+rng.IntN(2)), packet.ProtoTCP)
		switch op := rng.IntN(8); {
		case op < 3: // insert
			h, res := tb.Insert(orig, tr, DNAT, uint32(cport), now)
			_, origTaken := live[orig]
			_, replyTaken := byReply[tr.Reverse()]
			switch {
			case origTaken:
				if res != OrigExists {
					t.Fatalf("step %d: insert of a taken original returned %v", step, res)
				}
			case replyTaken:
				if res != ReplyExists {
					t.Fatalf("step %d: insert of a taken reply returned %v", step, res)
				}
			case len(live) < tb.Capacity():
				if res != Inserted {
					t.Fatalf("step %d: insert with room returned %v", step, res)
				}
			case res == Inserted:
				// An unreplied flow was dropped: find which.
				dropped := 0
				for k, m := range live {
					if _, _, ok := tb.Lookup(k, now); !ok {
						if m.assured {
							t.Fatalf("step %d: assured flow %v evicted", step, k)
						}
						delete(live, k)
						delete(byReply, m.tr.Reverse())
						dropped++
					}
				}
				if dropped != 1 {
					t.Fatalf("step %d: insert into a full table dropped %d flows", step, dropped)
				}
			case res != Full:
				t.Fatalf("step %d: insert into a full table returned %v", step, res)
			}
			if res == Inserted {
				live[orig] = &model{orig: orig, tr: tr, h: h}
				byReply[tr.Reverse()] = orig
			}
		case op == 3: // delete
			if m, ok := live[orig]; ok {
				if !tb.Delete(m.h) {
					t.Fatalf("step %d: delete of a live flow failed", step)
				}
				delete(live, orig)
				delete(byReply, m.tr.Reverse())
			}
		case op == 4: // traffic both ways: assured
			if m, ok := live[orig]; ok && rng.IntN(4) == 0 {
				tb.Update(m.h, Original, packet.TCPAck, now)
				if s, ok := tb.Update(m.h, Reply, packet.TCPAck, now); !ok || s != TCPEstablished {
					t.Fatalf("step %d: update of a live flow: %v %v", step, s, ok)
				}
				m.assured = true
			}
		default: // lookup both ways
			m, ok := live[orig]
			f, d, found := tb.Lookup(orig, now)
			if ok != found || (found && (d != Original || f.Rewrite != m.tr)) {
				t.Fatalf("step %d: lookup %v: found %v %+v, model %v %+v", step, orig, found, f, ok, m)
			}
			if ok {
				f, d, found = tb.Lookup(m.tr.Reverse(), now)
				if !found || d != Reply || f.Rewrite != m.orig.Reverse() {
					t.Fatalf("step %d: reply lookup: %v %+v", step, found, f)
				}
			}
		}
		if step%10000 == 0 {
			check(step)
		}
	}
	check(-1)
	// Rebuild the index (normally only when tombstones fill it) and check
	// that every flow is still found and the tombstones are gone.
	sh := &tb.shards[0]
	sh.mu.Lock()
	tb.rebuildLocked(sh)
	sh.mu.Unlock()
	if sh.tombs != 0 || sh.used != 2*len(live) {
		t.Errorf("after rebuild: %d tombstones, %d used slots, %d flows", sh.tombs, sh.used, len(live))
	}
	check(-2)
	st := tb.Stats()
	t.Logf("stats %+v", st)
	if int(st.Live) != len(live) {
		t.Errorf("Live %d, model %d", st.Live, len(live))
	}
	if st.Inserts < 10000 || st.ReplyExists == 0 || st.EvictedUnassured == 0 || st.IndexRebuilds < 2 {
		t.Errorf("the test does not churn enough: %+v", st)
	}
}

func TestLargeTableAcrossShards(t *testing.T) {
	tb := newTable(t, Config{Capacity: 100000})
	st := tb.Stats()
	if st.Shards < 2 {
		t.Fatalf("%d shards", st.Shards)
	}
	n := 90000
	if raceEnabled {
		n = 20000
	}
	for i := range n {
		o := tup(packet.AddrFrom4([4]byte{198, 18 + byte(i>>16), byte(i >> 8), byte(i)}), 1000, frontend, 80, packet.ProtoTCP)
		tr := tup(snatAddr, uint16(i%60000+1), backend, 8080, packet.ProtoTCP)
		if i >= 60000 {
			tr.Dst = backend2
		}
		mustInsert(t, tb, o, tr, DNAT|SNAT, uint32(i), 0)
	}
	for i := range n {
		o := tup(packet.AddrFrom4([4]byte{198, 18 + byte(i>>16), byte(i >> 8), byte(i)}), 1000, frontend, 80, packet.ProtoTCP)
		f, d := mustLookup(t, tb, o, 0)
		if d != Original || f.ServiceID != uint32(i) {
			t.Fatalf("flow %d: %+v", i, f)
		}
		f, d = mustLookup(t, tb, f.Rewrite.Reverse(), 0)
		if d != Reply || f.Rewrite != o.Reverse() {
			t.Fatalf("flow %d reply: %+v", i, f)
		}
	}
	if st := tb.Stats(); st.Live != uint64(n) || st.FullDrops != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestNewValidates(t *testing.T) {
	for _, c := range []Config{{}, {Capacity: -1}, {Capacity: MaxCapacity + 1}, {Capacity: 10, EvictionWindow: -1}} {
		if _, err := New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

func TestZeroAllocs(t *testing.T) {
	tb := newTable(t, Config{Capacity: 4096})
	o := tup(client, 1, frontend, 80, packet.ProtoTCP)
	tr := tup(client, 1, backend, 8080, packet.ProtoTCP)
	mustInsert(t, tb, o, tr, DNAT, 1, 0)
	reply := tr.Reverse()
	now := int64(0)
	if a := testing.AllocsPerRun(1000, func() {
		now += sec
		f, d, ok := tb.Lookup(o, now)
		if ok {
			tb.Update(f.Handle, d, packet.TCPAck, now)
		}
		f, d, ok = tb.Lookup(reply, now)
		if ok {
			tb.Update(f.Handle, d, packet.TCPAck, now)
		}
	}); a != 0 {
		t.Errorf("Lookup+Update: %v allocs", a)
	}
	i := 0
	if a := testing.AllocsPerRun(1000, func() {
		i++
		oi := tup(client2, uint16(i), frontend, 80, packet.ProtoTCP)
		h, res := tb.Insert(oi, tup(client2, uint16(i), backend, 8080, packet.ProtoTCP), DNAT, 1, now)
		if res != Inserted {
			t.Fatalf("insert %d: %v", i, res)
		}
		tb.Update(h, Original, packet.TCPSyn, now)
		tb.Sweep(16, now)
	}); a != 0 {
		t.Errorf("Insert: %v allocs", a)
	}
	if a := testing.AllocsPerRun(100, func() {
		i++
		tb.InsertSNAT(tup(client2, uint16(i), frontend, 80, packet.ProtoUDP), tup(snatAddr, 0, backend, 53, packet.ProtoUDP), DNAT, 1, DefaultSNATPorts, now)
	}); a != 0 {
		t.Errorf("InsertSNAT: %v allocs", a)
	}
	// Removals that report to OnRemove: early drops on insert into a
	// full table, expiry by Sweep, Delete.
	var removals atomic.Int64
	full := newTable(t, Config{Capacity: 16, OnRemove: func(orig, reply packet.Tuple) { removals.Add(1) }})
	if a := testing.AllocsPerRun(1000, func() {
		i++
		oi := tup(client2, uint16(i), frontend, 80, packet.ProtoUDP)
		h, res := full.Insert(oi, tup(client2, uint16(i), backend, 8080, packet.ProtoUDP), DNAT, 1, now)
		if res != Inserted {
			t.Fatalf("insert %d: %v", i, res)
		}
		if i%3 == 0 {
			full.Delete(h)
		}
		full.Sweep(4, now-20*sec) // nothing has expired then
		if i%50 == 0 {
			full.Sweep(16, now+31*sec) // everything has
		}
	}); a != 0 {
		t.Errorf("removals with OnRemove: %v allocs", a)
	}
	if st := full.Stats(); st.EvictedUnassured == 0 || st.Deleted == 0 || st.Expired == 0 ||
		uint64(removals.Load()) != st.EvictedUnassured+st.Deleted+st.Expired+st.EvictedExpired {
		t.Errorf("%d OnRemove calls, stats %+v", removals.Load(), st)
	}
	k := FragmentKey{Src: client, Dst: frontend, ID: 9, Proto: packet.ProtoUDP}
	if a := testing.AllocsPerRun(100, func() {
		tb.RememberFragment(k, client, backend, now)
		tb.LookupFragment(k, now)
	}); a != 0 {
		t.Errorf("fragments: %v allocs", a)
	}
}

// Under churn that rebuilds the index again and again (a flood of new
// flows into a full table), inserting and removing allocates nothing once
// each shard has rebuilt once: a rebuild reuses the array the one before
// replaced.
func TestRebuildAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	tb := newTable(t, Config{Capacity: 256, shards: 1, Timeouts: Timeouts{UDPUnreplied: time.Hour}})
	c := rebuildChurn{t: t, tb: tb}
	churn := c.step
	for range 2000 {
		churn()
	}
	before := tb.Stats().IndexRebuilds
	if allocs := testing.AllocsPerRun(5000, churn); allocs != 0 {
		t.Errorf("an insert and a delete allocated %v times on average", allocs)
	}
	if rebuilt := tb.Stats().IndexRebuilds - before; rebuilt < 10 {
		t.Fatalf("only %d rebuilds while measuring", rebuilt)
	}
}

// rebuildChurn inserts flow after flow into a table of 256 and, once 240
// of them are live, deletes the oldest with each insert: that leaves
// tombstones inside probe runs, so the index rebuilds again and again.
type rebuildChurn struct {
	t      testing.TB
	tb     *Table
	window [240]Handle
	j      int
}

func (c *rebuildChurn) step() {
	if c.j >= len(c.window) {
		c.tb.Delete(c.window[c.j%len(c.window)])
	}
	h, res := c.tb.Insert(junkOrig(c.j), junkTranslated(c.j), DNAT, 2, 0)
	if res != Inserted {
		c.t.Fatalf("churn %d: %v", c.j, res)
	}
	c.window[c.j%len(c.window)] = h
	c.j++
}
