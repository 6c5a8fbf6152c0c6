package conntrack

import (
	"fmt"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func benchOrig(i int) packet.Tuple {
	return tup(packet.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), uint16(1024+i%60000), frontend, 80, packet.ProtoTCP)
}

func benchTranslated(i int) packet.Tuple {
	o := benchOrig(i)
	return tup(o.Src, o.SrcPort, packet.AddrFrom4([4]byte{10, 200, 0, byte(i % 64)}), 8080, packet.ProtoTCP)
}

// filledTable holds n established flows. Capacity is per shard, so the
// table gets 5% more room than n to keep every flow.
// The benchmark function runs several times with growing b.N; filling a
// million flows once is enough.
var filled = map[int]struct {
	tb   *Table
	keys []packet.Tuple
}{}

func filledTable(b *testing.B, n int) (*Table, []packet.Tuple) {
	b.Helper()
	if f, ok := filled[n]; ok {
		return f.tb, f.keys
	}
	tb := newTable(b, Config{Capacity: n + n/20})
	keys := make([]packet.Tuple, 0, 2*n)
	for i := range n {
		h, res := tb.Insert(benchOrig(i), benchTranslated(i), DNAT, uint32(i), 0)
		if res != Inserted {
			b.Fatalf("fill %d: %v", i, res)
		}
		tb.Update(h, Original, packet.TCPAck, 0)
		keys = append(keys, benchOrig(i), benchTranslated(i).Reverse())
	}
	if st := tb.Stats(); st.Live != uint64(n) {
		b.Fatalf("%d of %d flows kept: %+v", st.Live, n, st)
	}
	filled[n] = struct {
		tb   *Table
		keys []packet.Tuple
	}{tb, keys}
	return tb, keys
}

// BenchmarkLookupUpdate is the per-packet established path: one Lookup and
// one Update, alternating directions over flows in a scattered order.
func BenchmarkLookupUpdate(b *testing.B) {
	for _, n := range []int{10_000, 1 << 20} {
		b.Run(fmt.Sprintf("entries=%d", n), func(b *testing.B) {
			tb, keys := filledTable(b, n)
			now := int64(10 * sec)
			const stride = 7919 * 2 // odd flow step, both directions
			i := 0
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				f, d, ok := tb.Lookup(keys[i], now)
				if !ok {
					b.Fatal("miss")
				}
				tb.Update(f.Handle, d, packet.TCPAck, now)
				if i += stride + 1; i >= len(keys) {
					i -= len(keys)
				}
			}
		})
	}
}

// BenchmarkLookupUpdateTCP is the established path with window tracking:
// Lookup and UpdateTCP, each flow's two directions sending full-sized
// segments in sequence (so the stored end moves about once per 11 visits).
func BenchmarkLookupUpdateTCP(b *testing.B) {
	for _, n := range []int{10_000, 1 << 20} {
		b.Run(fmt.Sprintf("entries=%d", n), func(b *testing.B) {
			tb, keys := filledTable(b, n)
			seqs := make([]uint32, len(keys))
			now := int64(10 * sec)
			const stride = 7919 * 2
			i := 0
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				f, d, ok := tb.Lookup(keys[i], now)
				if !ok {
					b.Fatal("miss")
				}
				seg := TCPSegment{Flags: packet.TCPAck, Seq: seqs[i], Ack: seqs[i^1], Window: 502, Len: 1448}
				if _, res := tb.UpdateTCP(f.Handle, d, &seg, now); res != UpdateOK {
					b.Fatal(res)
				}
				seqs[i] += 1448
				if i += stride + 1; i >= len(keys) {
					i -= len(keys)
				}
			}
		})
	}
}

func BenchmarkInsert(b *testing.B) {
	const capacity = 1 << 20
	tb := newTable(b, Config{Capacity: capacity})
	i := 0
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if i == capacity {
			b.StopTimer()
			tb, i = newTable(b, Config{Capacity: capacity}), 0
			b.StartTimer()
		}
		if _, res := tb.Insert(benchOrig(i), benchTranslated(i), DNAT, 1, 0); res != Inserted {
			b.Fatalf("insert %d: %v", i, res)
		}
		i++
	}
}

func BenchmarkInsertSNAT(b *testing.B) {
	const capacity = 1 << 20
	tb := newTable(b, Config{Capacity: capacity})
	i := 0
	ports := PortRange{First: 1024, Last: 65535}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if i == capacity/2 {
			b.StopTimer()
			tb, i = newTable(b, Config{Capacity: capacity}), 0
			b.StartTimer()
		}
		// 64 backends: each gets up to 8192 flows out of 64512 ports.
		if _, _, res := tb.InsertSNAT(benchOrig(i), tup(snatAddr, 0, packet.AddrFrom4([4]byte{10, 200, 0, byte(i % 64)}), 8080, packet.ProtoTCP), DNAT, 1, ports, 0); res != Inserted {
			b.Fatalf("insert %d: %v", i, res)
		}
		i++
	}
}

// BenchmarkSweep is one worker's per-batch sweep of 64 slots of a full
// table in which nothing has expired.
func BenchmarkSweep(b *testing.B) {
	tb, _ := filledTable(b, 1<<20)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if tb.Sweep(64, 10*sec) != 0 {
			b.Fatal("swept a live flow")
		}
	}
}
