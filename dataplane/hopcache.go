package dataplane

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// hopCache is a worker's cache of next hops by destination, in front of
// its Resolver. The route cache's lookup (a longest-prefix match, then the
// neighbour table: 25-38 ns in route.BenchmarkLookup) ran for every
// forwarded frame; a hit here is one compare. An answer is used only while
// the resolver's generation is the one it was cached in: the worker reads
// the generation once per batch (begin), and every change of routes, links
// or neighbours makes a new one. Only answers with reason OK are cached,
// so a destination whose neighbour is still being resolved asks again with
// its next frame, as it did without the cache.
//
// Direct-mapped, 256 destinations, no pointers; it belongs to one worker.
type hopCache struct {
	gen     uint64
	entries [hopCacheSize]hopEntry
}

const hopCacheSize = 256

type hopEntry struct {
	dst packet.Addr
	gen uint64
	set bool
	hop NextHop
}

// begin starts a batch in resolver generation gen.
func (c *hopCache) begin(gen uint64) { c.gen = gen }

// resolve is r.Resolve(*dst), from the cache when it can be. The next hop
// is returned in the cache (valid until the next call), not copied: a
// copy of a struct just written is a failed store-to-load forward on
// amd64 (see Verdict).
func (c *hopCache) resolve(r Resolver, dst *packet.Addr) (*NextHop, packet.Reason) {
	e := &c.entries[hopSlot(dst)]
	if e.set && e.gen == c.gen && e.dst == *dst {
		return &e.hop, packet.OK
	}
	hop, reason := r.Resolve(*dst)
	if reason != packet.OK {
		return nil, reason
	}
	*e = hopEntry{dst: *dst, gen: c.gen, set: true, hop: hop}
	return &e.hop, packet.OK
}

// hopSlot spreads addresses over the cache: IPv4 addresses differ in their
// last word, IPv6 ones anywhere.
func hopSlot(a *packet.Addr) int {
	w := binary.LittleEndian.Uint32(a[0:]) ^ binary.LittleEndian.Uint32(a[4:]) ^
		binary.LittleEndian.Uint32(a[8:]) ^ binary.LittleEndian.Uint32(a[12:])
	return int((w * 0x9e3779b1) >> 24)
}
