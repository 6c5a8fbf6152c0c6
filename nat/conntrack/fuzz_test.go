package conntrack

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// fuzzPacketLen is the size of one packet in FuzzTCPMachine's input:
//
//	0     bit 0 direction, bit 1 use Update (no window data), bit 2 window
//	      scale option present, bits 3-7 ms to wait before it (x 64)
//	1     TCP flags
//	2-5   seq
//	6-9   ack
//	10-11 window
//	12    payload length (x 16), the low 4 bits also the window scale
const fuzzPacketLen = 13

func encodePackets(segs []seg) []byte {
	var b []byte
	for _, s := range segs {
		p := make([]byte, fuzzPacketLen)
		p[0] = byte(s.dir)
		if s.HasWScale {
			p[0] |= 4
		}
		p[1] = s.Flags
		binary.BigEndian.PutUint32(p[2:], s.Seq)
		binary.BigEndian.PutUint32(p[6:], s.Ack)
		binary.BigEndian.PutUint16(p[10:], s.Window)
		p[12] = byte(s.Len/16) | s.WScale
		b = append(b, p...)
	}
	return b
}

// FuzzTCPMachine drives random packet sequences through the state machine
// and window tracking of one flow, looked up per packet as the dataplane
// does, and checks invariants after every packet.
func FuzzTCPMachine(f *testing.F) {
	f.Add(encodePackets(handshake))
	f.Add(encodePackets(append(handshake, pk(Reply, rstack, 6001, 1001, 0, 0), pk(Original, syn, 9, 0, 100, 0))))
	f.Add(encodePackets(append(handshake, pk(Original, finack, 1001, 6001, 502, 0), pk(Reply, ack, 6001, 1002, 509, 0),
		pk(Reply, finack, 6001, 1002, 509, 0), pk(Original, ack, 1002, 6002, 502, 0))))
	f.Add(encodePackets([]seg{pk(Original, ack, 7777, 1, 1000, 10), pk(Reply, rst, 1, 0, 0, 0)}))
	f.Add(encodePackets([]seg{pk(Original, syn, 1000, 0, 64240, 0), pk(Reply, rstack, 0, 1001, 0, 0)}))
	f.Fuzz(func(t *testing.T, data []byte) {
		tb, err := New(Config{Capacity: 4, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		o := tup(client, 40000, frontend, 80, packet.ProtoTCP)
		tr := tup(client, 40000, backend, 8080, packet.ProtoTCP)
		now := int64(sec)
		inserts := 0
		for len(data) >= fuzzPacketLen {
			p := data[:fuzzPacketLen]
			data = data[fuzzPacketLen:]
			now += int64(p[0]>>3) * 64e6
			dir := Direction(p[0] & 1)
			sg := TCPSegment{
				Flags: p[1], Seq: binary.BigEndian.Uint32(p[2:]), Ack: binary.BigEndian.Uint32(p[6:]),
				Window: binary.BigEndian.Uint16(p[10:]), Len: uint32(p[12]>>4) * 16,
				WScale: p[12] & 0xf, HasWScale: p[0]&4 != 0,
			}
			tu := o
			if dir == Reply {
				tu = tr.Reverse()
			}
			fl, d, ok := tb.Lookup(tu, now)
			if !ok {
				// A new flow (first packet, or the old one expired):
				// the dataplane inserts on the original direction.
				if _, res := tb.Insert(o, tr, DNAT, 1, now); res != Inserted {
					t.Fatalf("insert: %v", res)
				}
				inserts++
				if fl, d, ok = tb.Lookup(tu, now); !ok {
					t.Fatal("inserted flow not found")
				}
			}
			if d != dir {
				t.Fatalf("lookup direction %v, want %v", d, dir)
			}
			e := &tb.entries[fl.Handle.idx-1]
			before := e.timer.Load()
			var st State
			res := UpdateOK
			if p[0]&2 != 0 {
				var ok bool
				if st, ok = tb.Update(fl.Handle, dir, sg.Flags, now); !ok {
					res = UpdateGone
				}
			} else {
				st, res = tb.UpdateTCP(fl.Handle, dir, &sg, now)
			}
			after := e.timer.Load()
			switch res {
			case UpdateGone:
				t.Fatal("a flow just looked up is gone")
			case UpdateOutOfWindow:
				if sg.Flags&(packet.TCPRst|packet.TCPFin) == 0 {
					t.Fatalf("out of window without RST or FIN: flags %#x", sg.Flags)
				}
				if after != before {
					t.Fatalf("an ignored packet changed the timer %#x -> %#x", before, after)
				}
			}
			if st != timerState(after) || st < TCPNone || st > TCPClose {
				t.Fatalf("state %v, timer says %v", st, timerState(after))
			}
			if res == UpdateOK && sg.Flags&packet.TCPRst != 0 && st != TCPClose {
				t.Fatalf("accepted RST left the flow in %v", st)
			}
			prev, was, is := timerState(before), timerStatus(before)&statusAssured != 0, timerStatus(after)&statusAssured != 0
			restart := dir == Original && sg.Flags&(packet.TCPSyn|packet.TCPAck|packet.TCPRst) == packet.TCPSyn &&
				(prev == TCPTimeWait || prev == TCPClose)
			if was && !is && !restart {
				t.Fatalf("assured lost: %v -> %v on flags %#x from %v", prev, st, sg.Flags, dir)
			}
			if is && !was && st != TCPEstablished {
				t.Fatalf("assured in %v", st)
			}
			if timerDeadline(after) <= msOf(now) {
				t.Fatalf("deadline %d not after now %d", timerDeadline(after), msOf(now))
			}
			tag := winTag(fl.Handle.gen)
			for i := range e.win {
				if !sameTag(e.win[i].Load(), tag) {
					t.Fatalf("window word %d lost its tag: %#x", i, e.win[i].Load())
				}
			}
			s := tb.Stats()
			if s.Live != 1 || s.ByState[st] != 1 || (s.Assured == 1) != is {
				t.Fatalf("stats %+v for one flow in %v (assured %v)", s, st, is)
			}
			if f2, d2, ok := tb.Lookup(tr.Reverse(), now); !ok || d2 != Reply || f2.Handle != fl.Handle || f2.Rewrite != o.Reverse() {
				t.Fatalf("reply lookup %+v %v %v", f2, d2, ok)
			}
		}
		if s := tb.Stats(); s.Inserts != uint64(inserts) || s.Inserts != s.Live+s.ExpiredOnInsert {
			t.Fatalf("stats %+v after %d inserts", s, inserts)
		}
	})
}

// FuzzStateFile patches a valid state file at a random offset and opens
// it: New must not panic, and whatever it adopts must be a consistent
// table.
func FuzzStateFile(f *testing.F) {
	now := int64(50 * sec)
	dir := f.TempDir()
	cfg := Config{Capacity: 64, shards: 2, StatePath: filepath.Join(dir, "base.state"), Clock: clockAt(&now)}
	tb, err := New(cfg)
	if err != nil {
		f.Fatal(err)
	}
	ports := PortRange{First: 1000, Last: 1099}
	for i := range 40 {
		o := tup(client, uint16(100+i), frontend, 80, packet.Proto([]uint8{6, 17, 1}[i%3]))
		if i%2 == 0 {
			tb.InsertSNAT(o, tup(snatAddr, 0, backend, 80, o.Proto), DNAT, uint32(i), ports, int64(i)*sec)
		} else if h, res := tb.Insert(o, tup(client, uint16(100+i), backend, 80, o.Proto), DNAT, uint32(i), int64(i)*sec); res == Inserted {
			tb.Update(h, Reply, packet.TCPSyn|packet.TCPAck, int64(i)*sec)
		}
	}
	tb.Close()
	base, err := os.ReadFile(cfg.StatePath)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(uint32(0), []byte{})
	f.Add(uint32(stateHeaderSize+1), []byte{1})                  // an odd sequence
	f.Add(uint32(stateHeaderSize+8), []byte{0xff, 0xff})         // a timer
	f.Add(uint32(stateHeaderSize+entrySize+32), []byte{1, 2, 3}) // a key
	f.Add(uint32(stateHeaderSize+entrySize*3+8), []byte{0x3d})   // another state
	f.Add(uint32(hdrSeed), []byte{9})                            // the header
	f.Fuzz(func(t *testing.T, off uint32, patch []byte) {
		b := append([]byte(nil), base...)
		if len(patch) > 0 {
			copy(b[int(off)%len(b):], patch)
		}
		c := cfg
		c.StatePath = filepath.Join(t.TempDir(), "ct.state")
		if err := os.WriteFile(c.StatePath, b, 0o600); err != nil {
			t.Fatal(err)
		}
		tb, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		defer tb.Close()
		ri := tb.Restored()
		s := tb.Stats()
		if s.Live != uint64(ri.Flows) || ri.Flows+ri.Expired+ri.Torn+ri.Invalid > tb.Capacity() {
			t.Fatalf("restore %+v, stats %+v", ri, s)
		}
		var sum uint64
		for _, n := range s.ByState {
			sum += n
		}
		if sum != s.Live || s.ByState[StateFree] != 0 {
			t.Fatalf("per-state counts %v for %d live", s.ByState, s.Live)
		}
		n := 0
		for fi := range tb.All(now) {
			n++
			for _, k := range []packet.Tuple{fi.Orig, fi.Reply()} {
				if fl, _, ok := tb.Lookup(k, now); !ok || fl.Handle != fi.Handle {
					t.Fatalf("restored key %v of %+v not indexed", k, fi)
				}
			}
		}
		if n != ri.Flows {
			t.Fatalf("All yields %d flows, restored %d", n, ri.Flows)
		}
		// The table works: fill it, then expire everything.
		for i := range 200 {
			o := tup(client2, uint16(i), frontend, 80, packet.ProtoUDP)
			tb.Insert(o, tup(client2, uint16(i), backend2, 80, packet.ProtoUDP), DNAT, 1, now)
		}
		for fi := range tb.All(now) {
			tb.Update(fi.Handle, Reply, packet.TCPRst, now)
		}
		tb.Sweep(1000, now+1000*24*3600*sec)
		if s := tb.Stats(); s.Live != 0 {
			t.Fatalf("after sweeping everything: %+v", s)
		}
	})
}

// FuzzParseTCPSegment checks that any bytes parse without panic and that
// what parses is consistent with the header.
func FuzzParseTCPSegment(f *testing.F) {
	f.Add(tcpHeader(syn, 1000, 0, 64240, []byte{2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7}, 0))
	f.Add(tcpHeader(ack, 1, 2, 3, nil, 100))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, ok := ParseTCPSegment(b)
		if !ok {
			return
		}
		doff := int(b[12]>>4) * 4
		if s.Len != uint32(len(b)-doff) || s.Flags != b[13] || s.Seq != binary.BigEndian.Uint32(b[4:]) {
			t.Fatalf("%+v from %x", s, b)
		}
		if s.WScale > maxWScale || s.HasWScale && s.Flags&packet.TCPSyn == 0 {
			t.Fatalf("window scale %+v", s)
		}
	})
}
