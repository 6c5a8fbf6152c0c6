package conntrack

import (
	"encoding/binary"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

const (
	syn    = packet.TCPSyn
	synack = packet.TCPSyn | packet.TCPAck
	ack    = packet.TCPAck
	finack = packet.TCPFin | packet.TCPAck
	rst    = packet.TCPRst
	rstack = packet.TCPRst | packet.TCPAck
)

// tcpHeader builds a TCP header with the given options and payload length.
func tcpHeader(flags uint8, seq, ackn uint32, win uint16, opts []byte, payload int) []byte {
	for len(opts)%4 != 0 {
		opts = append(opts, 0)
	}
	b := make([]byte, 20+len(opts)+payload)
	binary.BigEndian.PutUint16(b[0:], 40000)
	binary.BigEndian.PutUint16(b[2:], 80)
	binary.BigEndian.PutUint32(b[4:], seq)
	binary.BigEndian.PutUint32(b[8:], ackn)
	b[12] = byte((20 + len(opts)) / 4 << 4)
	b[13] = flags
	binary.BigEndian.PutUint16(b[14:], win)
	copy(b[20:], opts)
	return b
}

func TestParseTCPSegment(t *testing.T) {
	// A Linux SYN: MSS 1460, SACK permitted, timestamps, NOP, WS 7.
	linuxSyn := []byte{2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7}
	cases := []struct {
		name string
		tcp  []byte
		ok   bool
		want TCPSegment
	}{
		{"linux syn", tcpHeader(syn, 1000, 0, 64240, linuxSyn, 0), true,
			TCPSegment{Flags: syn, Seq: 1000, Window: 64240, WScale: 7, HasWScale: true}},
		{"syn without options", tcpHeader(syn, 1, 0, 1024, nil, 0), true, TCPSegment{Flags: syn, Seq: 1, Window: 1024}},
		{"scale capped at 14", tcpHeader(synack, 5, 2, 100, []byte{3, 3, 15}, 0), true,
			TCPSegment{Flags: synack, Seq: 5, Ack: 2, Window: 100, WScale: 14, HasWScale: true}},
		{"options ignored without SYN", tcpHeader(ack, 7, 9, 300, []byte{3, 3, 7}, 100), true,
			TCPSegment{Flags: ack, Seq: 7, Ack: 9, Window: 300, Len: 100}},
		{"end of options before WS", tcpHeader(syn, 1, 0, 10, []byte{0, 3, 3, 7}, 0), true, TCPSegment{Flags: syn, Seq: 1, Window: 10}},
		{"truncated option", tcpHeader(syn, 1, 0, 10, []byte{1, 1, 1, 3}, 0), true, TCPSegment{Flags: syn, Seq: 1, Window: 10}},
		{"option length 0", tcpHeader(syn, 1, 0, 10, []byte{8, 0, 3, 3, 7}, 0), true, TCPSegment{Flags: syn, Seq: 1, Window: 10}},
		{"option longer than the header", tcpHeader(syn, 1, 0, 10, []byte{8, 30, 3, 3}, 0), true, TCPSegment{Flags: syn, Seq: 1, Window: 10}},
		{"payload", tcpHeader(finack, 1, 2, 3, nil, 1400), true, TCPSegment{Flags: finack, Seq: 1, Ack: 2, Window: 3, Len: 1400}},
		{"short", make([]byte, 19), false, TCPSegment{}},
		{"offset beyond", func() []byte { b := tcpHeader(ack, 1, 1, 1, nil, 0); b[12] = 6 << 4; return b }(), false, TCPSegment{}},
		{"offset below 5", func() []byte { b := tcpHeader(ack, 1, 1, 1, nil, 0); b[12] = 4 << 4; return b }(), false, TCPSegment{}},
	}
	for _, c := range cases {
		got, ok := ParseTCPSegment(c.tcp)
		if ok != c.ok || got != c.want {
			t.Errorf("%s: %+v %v, want %+v %v", c.name, got, ok, c.want, c.ok)
		}
	}
	b := tcpHeader(syn, 1000, 0, 64240, linuxSyn, 0)
	if a := testing.AllocsPerRun(100, func() { ParseTCPSegment(b) }); a != 0 {
		t.Errorf("ParseTCPSegment: %v allocs", a)
	}
}

// seg is one packet of a window test.
type seg struct {
	dir Direction
	TCPSegment
}

func pk(dir Direction, flags uint8, seq, ackn uint32, win uint16, n uint32) seg {
	return seg{dir, TCPSegment{Flags: flags, Seq: seq, Ack: ackn, Window: win, Len: n}}
}

func withWS(s seg, scale uint8) seg {
	s.WScale, s.HasWScale = scale, true
	return s
}

// Client ISN 1000, server ISN 5000, both scaling by 7: the client's window
// is 502<<7 = 64256 bytes, the server's 509<<7 = 65152.
var handshake = []seg{
	withWS(pk(Original, syn, 1000, 0, 64240, 0), 7),
	withWS(pk(Reply, synack, 5000, 1001, 65160, 0), 7),
	pk(Original, ack, 1001, 5001, 502, 0),
	pk(Reply, ack, 5001, 1001, 509, 1000), // 1000 bytes: server's true end 6001, stored 5001 (under the lag)
}

func TestTCPWindowRSTAndFIN(t *testing.T) {
	// Variables, not constants: the sums below wrap around as sequence
	// numbers do.
	var (
		srvEnd   uint32 = 5001 // the server's stored end after the handshake
		cliWin   uint32 = 502 << 7
		srvWin   uint32 = 509 << 7
		cliEnd   uint32 = 1001
		noScaleW uint32 = 502 // the client's window when the server did not offer scaling
		lag      uint32 = winLag
	)
	noScale := append([]seg{}, handshake...)
	noScale[1] = pk(Reply, synack, 5000, 1001, 65160, 0)
	cases := []struct {
		name  string
		setup []seg
		last  seg
		want  UpdateResult
		state State // after last
	}{
		{"rst at the server's end", handshake, pk(Reply, rstack, 6001, 1001, 0, 0), UpdateOK, TCPClose},
		{"rst at the window's top", handshake, pk(Reply, rst, srvEnd+cliWin+lag, 0, 0, 0), UpdateOK, TCPClose},
		{"rst beyond the window", handshake, pk(Reply, rst, srvEnd+cliWin+lag+1, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"rst at the window's bottom", handshake, pk(Reply, rst, srvEnd-cliWin, 0, 0, 0), UpdateOK, TCPClose},
		{"rst below the window", handshake, pk(Reply, rst, srvEnd-cliWin-1, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"blind rst far away", handshake, pk(Reply, rst, 0x80000000, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"client rst in window", handshake, pk(Original, rst, cliEnd+srvWin, 0, 0, 0), UpdateOK, TCPClose},
		{"client rst beyond", handshake, pk(Original, rst, cliEnd+srvWin+lag+1, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"fin in window", handshake, pk(Reply, finack, 6001, 1001, 509, 0), UpdateOK, TCPFinWait},
		{"fin with data reaching into the window", handshake, pk(Reply, finack, srvEnd-cliWin-100, 1001, 509, 100), UpdateOK, TCPFinWait},
		{"fin out of window", handshake, pk(Reply, finack, 0x40000000, 1001, 509, 0), UpdateOutOfWindow, TCPEstablished},
		{"unscaled: rst beyond the small window", noScale, pk(Reply, rst, srvEnd+noScaleW+lag+1, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"unscaled: rst within", noScale, pk(Reply, rst, srvEnd+noScaleW+lag, 0, 0, 0), UpdateOK, TCPClose},

		// The server has not sent anything: its RST must acknowledge the SYN.
		{"rst answering a syn", handshake[:1], pk(Reply, rstack, 0, 1001, 0, 0), UpdateOK, TCPClose},
		{"rst answering a syn, wrong ack", handshake[:1], pk(Reply, rstack, 0, 77777, 0, 0), UpdateOutOfWindow, TCPSynSent},
		{"rst without ack in SYN_SENT", handshake[:1], pk(Reply, rst, 0, 0, 0, 0), UpdateOutOfWindow, TCPSynSent},
		{"client aborts its own syn", handshake[:1], pk(Original, rst, 1001, 0, 0, 0), UpdateOK, TCPClose},
		// The peer still holds an older connection of this tuple and
		// answers the SYN with an ACK of its own; the client resets it
		// with that ACK as sequence number (RFC 9293, SYN-SENT).
		{"client resets a stale peer's answer", []seg{handshake[0], pk(Reply, ack, 9000, 555556, 509, 0)},
			pk(Original, rst, 555556, 0, 0, 0), UpdateOK, TCPClose},
		{"client rst far away once established", handshake, pk(Original, rst, 555556, 0, 0, 0), UpdateOutOfWindow, TCPEstablished},

		// Picked up mid-stream: only the client is known.
		{"loose: peer reset without ack", []seg{pk(Original, ack, 7777, 1, 1000, 10)}, pk(Reply, rst, 1, 0, 0, 0), UpdateOK, TCPClose},
		{"loose: peer rst acking the data", []seg{pk(Original, ack, 7777, 1, 1000, 10)}, pk(Reply, rstack, 1, 7787, 0, 0), UpdateOK, TCPClose},
		{"loose: peer rst acking nonsense", []seg{pk(Original, ack, 7777, 1, 1000, 10)}, pk(Reply, rstack, 1, 0x9000_0000, 0, 0), UpdateOutOfWindow, TCPEstablished},
		{"nothing known", nil, pk(Reply, rst, 12345, 0, 0, 0), UpdateOK, TCPClose},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tb := newTable(t, Config{Capacity: 64})
			h := mustInsert(t, tb, tup(client, 40000, frontend, 80, packet.ProtoTCP), tup(client, 40000, backend, 8080, packet.ProtoTCP), DNAT, 1, 0)
			for i, s := range c.setup {
				if _, res := tb.UpdateTCP(h, s.dir, &s.TCPSegment, sec); res != UpdateOK {
					t.Fatalf("setup %d: %v", i, res)
				}
			}
			st, res := tb.UpdateTCP(h, c.last.dir, &c.last.TCPSegment, sec)
			if res != c.want || st != c.state {
				t.Fatalf("got %v %v, want %v %v", st, res, c.want, c.state)
			}
			f, _ := mustLookup(t, tb, tup(client, 40000, frontend, 80, packet.ProtoTCP), sec)
			if f.State != c.state {
				t.Errorf("state after: %v", f.State)
			}
			stats := tb.Stats()
			oow := stats.OutOfWindowRST + stats.OutOfWindowFIN
			if (res == UpdateOutOfWindow) != (oow == 1) {
				t.Errorf("out-of-window counters %d RST %d FIN", stats.OutOfWindowRST, stats.OutOfWindowFIN)
			}
			if res == UpdateOutOfWindow && (c.last.Flags&rst != 0) != (stats.OutOfWindowRST == 1) {
				t.Errorf("counted as the wrong kind: %+v", stats)
			}
			if res.Reason() != map[UpdateResult]packet.Reason{UpdateOK: packet.OK, UpdateOutOfWindow: packet.DropOutOfWindow}[res] {
				t.Errorf("Reason %v", res.Reason())
			}
		})
	}
}

// TestTCPWindowStoresAmortised streams data and checks that the sender's
// window word is written about once per winLag bytes, and that an RST at
// the true end is still accepted, however far the stored end lags.
func TestTCPWindowStoresAmortised(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	o := tup(client, 40000, frontend, 80, packet.ProtoTCP)
	h := mustInsert(t, tb, o, tup(client, 40000, backend, 8080, packet.ProtoTCP), DNAT, 1, 0)
	for _, s := range handshake {
		tb.UpdateTCP(h, s.dir, &s.TCPSegment, sec)
	}
	e := &tb.entries[h.idx-1]
	seq := uint32(6001)
	stores, last := 0, e.win[Reply].Load()
	const packets, mss = 1000, 1448
	for i := range packets {
		// The client acks every other packet, as Linux does.
		if _, res := tb.UpdateTCP(h, Reply, &TCPSegment{Flags: ack, Seq: seq, Ack: 1001, Window: 509, Len: mss}, sec); res != UpdateOK {
			t.Fatalf("packet %d: %v", i, res)
		}
		seq += mss
		if i%2 == 1 {
			tb.UpdateTCP(h, Original, &TCPSegment{Flags: ack, Seq: 1001, Ack: seq, Window: 502}, sec)
		}
		if w := e.win[Reply].Load(); w != last {
			stores, last = stores+1, w
		}
	}
	if max := packets*mss/winLag + 1; stores > max {
		t.Errorf("%d stores for %d packets, want at most %d", stores, packets, max)
	}
	if lag := seq - winEnd(e.win[Reply].Load()); lag > winLag {
		t.Errorf("stored end lags %d bytes", lag)
	}
	t.Logf("%d stores of the sender's window word for %d packets", stores, packets)
	if _, res := tb.UpdateTCP(h, Reply, &TCPSegment{Flags: rst, Seq: seq}, sec); res != UpdateOK {
		t.Errorf("rst at the true end: %v", res)
	}
}

// TestTCPWindowRestart checks that a SYN reusing a closed flow starts both
// sides' windows afresh.
func TestTCPWindowRestart(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	o := tup(client, 40000, frontend, 80, packet.ProtoTCP)
	h := mustInsert(t, tb, o, tup(client, 40000, backend, 8080, packet.ProtoTCP), DNAT, 1, 0)
	for _, s := range append(handshake, pk(Reply, rstack, 6001, 1001, 0, 0)) {
		tb.UpdateTCP(h, s.dir, &s.TCPSegment, sec)
	}
	// A new connection on the same ports, ISNs far from the old ones.
	steps := []struct {
		s     seg
		want  UpdateResult
		state State
	}{
		{pk(Original, syn, 0x70000000, 0, 64240, 0), UpdateOK, TCPSynSent},
		{pk(Reply, rstack, 0, 0x70000001, 0, 0), UpdateOK, TCPClose}, // refused: acks the new SYN
		{pk(Original, syn, 0x70001000, 0, 64240, 0), UpdateOK, TCPSynSent},
		{pk(Reply, synack, 0x30000000, 0x12345678, 64240, 0), UpdateOK, TCPSynRecv}, // does not ack the SYN: not learnt
		{pk(Reply, rst, 0x30000001, 0, 0, 0), UpdateOutOfWindow, TCPSynRecv},        // so the server is still unknown: RST needs an ACK
		{pk(Reply, synack, 0x30000000, 0x70001001, 64240, 0), UpdateOK, TCPSynRecv},
		{pk(Reply, rst, 0x30000001, 0, 0, 0), UpdateOK, TCPClose},
	}
	for i, s := range steps {
		st, res := tb.UpdateTCP(h, s.s.dir, &s.s.TCPSegment, sec)
		if res != s.want || st != s.state {
			t.Fatalf("step %d: %v %v, want %v %v", i, st, res, s.want, s.state)
		}
	}
}

func TestUpdateTCPOtherProtocolsAndStaleHandles(t *testing.T) {
	tb := newTable(t, Config{Capacity: 1})
	u := tup(client, 1, frontend, 53, packet.ProtoUDP)
	h := mustInsert(t, tb, u, tup(client, 1, backend, 53, packet.ProtoUDP), DNAT, 1, 0)
	if st, res := tb.UpdateTCP(h, Reply, &TCPSegment{Flags: rst, Seq: 0x80000000}, 0); st != UDPReplied || res != UpdateOK {
		t.Errorf("UDP: %v %v", st, res)
	}
	tb.Delete(h)
	if _, res := tb.UpdateTCP(h, Original, &TCPSegment{Flags: ack}, 0); res != UpdateGone {
		t.Errorf("deleted flow: %v", res)
	}
	if _, res := tb.UpdateTCP(Handle{}, Original, &TCPSegment{Flags: ack}, 0); res != UpdateGone {
		t.Errorf("zero handle: %v", res)
	}
	if UpdateOK.String() != "ok" || UpdateGone.String() != "gone" || UpdateOutOfWindow.String() != "out_of_window" {
		t.Error("UpdateResult names")
	}
}

func TestUpdateTCPZeroAllocs(t *testing.T) {
	tb := newTable(t, Config{Capacity: 4096})
	o := tup(client, 1, frontend, 80, packet.ProtoTCP)
	tr := tup(client, 1, backend, 8080, packet.ProtoTCP)
	h := mustInsert(t, tb, o, tr, DNAT, 1, 0)
	for _, s := range handshake {
		tb.UpdateTCP(h, s.dir, &s.TCPSegment, 0)
	}
	reply := tr.Reverse()
	now, seq := int64(0), uint32(6001)
	if a := testing.AllocsPerRun(1000, func() {
		now += sec
		f, d, ok := tb.Lookup(o, now)
		if ok {
			tb.UpdateTCP(f.Handle, d, &TCPSegment{Flags: ack, Seq: 1001, Ack: seq, Window: 502}, now)
		}
		f, d, ok = tb.Lookup(reply, now)
		if ok {
			tb.UpdateTCP(f.Handle, d, &TCPSegment{Flags: ack, Seq: seq, Ack: 1001, Window: 509, Len: 1448}, now)
			seq += 1448
		}
		tb.UpdateTCP(f.Handle, d, &TCPSegment{Flags: rst, Seq: seq + 1<<30}, now) // out of window
	}); a != 0 {
		t.Errorf("Lookup+UpdateTCP: %v allocs", a)
	}
}

// TestReadNoOptionsMatchesParse: for every segment that is not a
// SYN, with or without options, the inlinable reader finds what
// ParseTCPSegment finds.
func TestReadNoOptionsMatchesParse(t *testing.T) {
	for i := range 2000 {
		doff := 20 + 4*(i%11)
		tcp := make([]byte, doff+i%37)
		for j := range tcp {
			tcp[j] = byte(i*131 + j*29)
		}
		tcp[12] = byte(doff/4) << 4
		tcp[13] &^= packet.TCPSyn
		want, ok := ParseTCPSegment(tcp)
		if !ok {
			t.Fatalf("segment %d: ParseTCPSegment refused it", i)
		}
		got := TCPSegment{WScale: 7, HasWScale: true} // overwritten
		if got.ReadNoOptions(tcp, doff); got != want {
			t.Fatalf("segment %d: %+v, ParseTCPSegment %+v", i, got, want)
		}
	}
}
