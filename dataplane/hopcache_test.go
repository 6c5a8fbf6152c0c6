package dataplane

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// countingResolver answers from a map, counts its calls, and has the
// generation the test gives it.
type countingResolver struct {
	hops  map[packet.Addr]NextHop
	gen   uint64
	calls int
}

func (r *countingResolver) Generation() uint64 { return r.gen }

func (r *countingResolver) Resolve(dst packet.Addr) (NextHop, packet.Reason) {
	r.calls++
	if h, ok := r.hops[dst]; ok {
		return h, packet.OK
	}
	return NextHop{}, packet.DropNeighbor
}

// TestHopCache: an answer is reused within its generation and asked again
// in the next; answers other than OK are never reused; destinations that
// share a slot get their own answers.
func TestHopCache(t *testing.T) {
	a, b := addr("198.18.1.11"), addr("198.18.1.12")
	r := &countingResolver{gen: 7, hops: map[packet.Addr]NextHop{a: {Ifindex: 2, Dst: [6]byte{2, 0, 0, 0, 0, 1}}}}
	var c hopCache
	resolve := func(dst packet.Addr) (NextHop, packet.Reason) {
		t.Helper()
		c.begin(r.Generation())
		h, reason := c.resolve(r, &dst)
		if h == nil {
			return NextHop{}, reason
		}
		return *h, reason
	}
	for range 3 {
		if h, reason := resolve(a); reason != packet.OK || h != r.hops[a] {
			t.Fatalf("resolve(%v) = %+v, %v", a, h, reason)
		}
	}
	if r.calls != 1 {
		t.Fatalf("%d calls to the resolver for one destination in one generation, want 1", r.calls)
	}

	// A new generation: the neighbour's MAC changed.
	r.gen++
	r.hops[a] = NextHop{Ifindex: 2, Dst: [6]byte{2, 0, 0, 0, 0, 9}}
	if h, _ := resolve(a); h != r.hops[a] || r.calls != 2 {
		t.Fatalf("after a new generation: %+v after %d calls", h, r.calls)
	}

	// Unresolved: asked with every frame.
	for range 2 {
		if _, reason := resolve(b); reason != packet.DropNeighbor {
			t.Fatalf("resolve(%v): %v", b, reason)
		}
	}
	if r.calls != 4 {
		t.Fatalf("%d calls, want 4: an unresolved neighbour was cached", r.calls)
	}

	// Two destinations in one slot.
	var x packet.Addr
	for i := 1; ; i++ {
		x = packet.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		if x != a && hopSlot(&x) == hopSlot(&a) {
			break
		}
	}
	r.hops[x] = NextHop{Ifindex: 3}
	for range 2 {
		if h, _ := resolve(x); h.Ifindex != 3 {
			t.Fatalf("resolve(%v) = %+v", x, h)
		}
		if h, _ := resolve(a); h != r.hops[a] {
			t.Fatalf("resolve(%v) = %+v", a, h)
		}
	}
}

// BenchmarkHopCacheHit is a forwarded frame's next hop from the cache;
// route.BenchmarkLookup is what it saves on a hit.
func BenchmarkHopCacheHit(b *testing.B) {
	dsts := []packet.Addr{addr("198.18.1.11"), addr("198.18.1.12"), addr("198.18.1.13"), addr("198.18.1.14")}
	r := &countingResolver{gen: 1, hops: map[packet.Addr]NextHop{}}
	for i, d := range dsts {
		r.hops[d] = NextHop{Ifindex: i + 2}
	}
	var c hopCache
	c.begin(1)
	i := 0
	for b.Loop() {
		if _, reason := c.resolve(r, &dsts[i&3]); reason != packet.OK {
			b.Fatal(reason)
		}
		i++
	}
	if r.calls != len(dsts) {
		b.Fatalf("%d calls to the resolver, want %d", r.calls, len(dsts))
	}
}
