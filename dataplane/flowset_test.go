package dataplane

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
)

// TestFlowSet: what was added is in the set and nothing else is, across
// growth, duplicates and a reset that keeps the memory.
func TestFlowSet(t *testing.T) {
	key := func(i int) xdp.FlowKey {
		return xdp.FlowKey{Src: packet.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), Dst: podA,
			SrcPort: 8080, DstPort: uint16(i), Proto: packet.ProtoTCP}
	}
	var s flowSet
	for round := range 2 {
		const n = 5000
		for i := range n {
			k := key(i)
			s.add(&k)
			s.add(&k) // again: counted once
		}
		if s.len() != n {
			t.Fatalf("round %d: %d in the set, want %d", round, s.len(), n)
		}
		for i := range 2 * n {
			k := key(i)
			if got := s.has(&k); got != (i < n) {
				t.Fatalf("round %d: has(%d) = %v", round, i, got)
			}
		}
		size := len(s.slots)
		s.reset()
		if k := key(1); s.len() != 0 || s.has(&k) || len(s.slots) != size {
			t.Fatalf("round %d: after reset: %d in the set, %d slots (had %d)", round, s.len(), len(s.slots), size)
		}
	}
}

// BenchmarkReconcileSet is the reconciler's bookkeeping for one pass over
// a million tuples: every tuple of the flow map added, every live flow
// looked up. "map" is the Go map it used before.
func BenchmarkReconcileSet(b *testing.B) {
	const n = 1 << 20
	keys := make([]xdp.FlowKey, n)
	for i := range keys {
		keys[i] = xdp.FlowKey{Src: packet.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), Dst: podA,
			SrcPort: 8080, DstPort: uint16(i), Proto: packet.ProtoUDP}
	}
	b.Run("flowSet", func(b *testing.B) {
		var s flowSet
		for b.Loop() {
			s.reset()
			for i := range keys {
				s.add(&keys[i])
			}
			for i := range keys {
				if !s.has(&keys[i]) {
					b.Fatal("missing")
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/tuple")
	})
	b.Run("map", func(b *testing.B) {
		for b.Loop() {
			m := map[xdp.FlowKey]bool{}
			for _, k := range keys {
				m[k] = true
			}
			for _, k := range keys {
				if !m[k] {
					b.Fatal("missing")
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/tuple")
	})
}
