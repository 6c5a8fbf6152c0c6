package dataplane

import (
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// flowCache is a worker's cache of established flows in front of the
// shared conntrack table: for the packet's tuple, the flow's handle, the
// direction it matched and the tuple to rewrite to. A hit skips the
// table's index (a random access into tens of megabytes at a million
// flows) and the seqlocked read of both keys; what is left is one check
// of the entry, which the state update reads anyway.
//
// A hit is never trusted as it is: conntrack.Table.Revalidate checks, with
// two atomic loads, that the entry still holds the flow the cache read (the
// same lifetime of the entry, not expired), so a flow deleted, expired or
// replaced by another in the same entry is never used; the slot is then
// dropped and the table asked. Translations never change during a flow's
// lifetime, so nothing else can go stale. Services are not involved: a
// table swap does not touch flows.
//
// Four ways per set, filled first in, first out. Two ways lost one flow in
// ten to conflicts with 1,000 flows in 4,096 slots; four lose about one in
// five hundred.
//
// The cache holds no pointers (the garbage collector never scans it) and
// belongs to one worker (no locks, no atomics).
type flowCache struct {
	// tags holds a fingerprint of each slot's key (tagOf; 0 for a slot
	// never filled; a dropped slot keeps its tag), so that a lookup reads
	// one cache line of tags and then only the slot whose tag matches,
	// not every way's key.
	tags [flowCacheSets][flowCacheWays]uint32
	sets [flowCacheSets][flowCacheWays]flowSlot
	// next is the way each set fills next (first in, first out).
	next [flowCacheSets]uint8
	// puts counts changes (flows cached or dropped), so that a lookup
	// result can tell it is still exact.
	puts uint64
}

// flowCacheSets and flowCacheWays: 4096 flows in 432 KiB per worker.
const (
	flowCacheSets = 1024
	flowCacheWays = 4
)

// flowSlot is one cached flow, 104 bytes. A zero key is an empty slot (no
// packed tuple is zero).
type flowSlot struct {
	key     conntrack.Key
	stamp   uint64
	handle  conntrack.Handle
	rewrite packet.Tuple
	dir     conntrack.Direction
	// fast says the flow is IPv4 TCP or UDP both ways: fastV4 may
	// translate it with ipDelta, l4Delta and pseudo (fastDeltas).
	fast                     bool
	ipDelta, l4Delta, pseudo uint16
}

// setOf is the set of hash h. It takes bits the table uses for its tags,
// not the low bits that pick the index slot.
func setOf(h uint64) uint32 { return uint32(h>>40) & (flowCacheSets - 1) }

// tagOf is the fingerprint of hash h in tags: bits the set does not use,
// never 0.
func tagOf(h uint64) uint32 { return uint32(h) | 1 }

// lookup returns the set of k and the way holding k, -1 for none.
func (c *flowCache) lookup(k *conntrack.Key, h uint64) (uint32, int8) {
	set := setOf(h)
	tag := tagOf(h)
	tags := &c.tags[set]
	for w := range tags {
		if tags[w] == tag && sameKey(&c.sets[set][w].key, k) {
			return set, int8(w)
		}
	}
	return set, -1
}

// find returns the slot holding k, or nil.
func (c *flowCache) find(k *conntrack.Key, h uint64) *flowSlot {
	set, way := c.lookup(k, h)
	if way < 0 {
		return nil
	}
	return &c.sets[set][way]
}

// put caches flow fh (stamp: Flow.Stamp), found for key k (hash h) in
// direction dir with rw the tuple to rewrite to, and returns its slot.
func (c *flowCache) put(k *conntrack.Key, h uint64, fh conntrack.Handle, stamp uint64, rw *packet.Tuple, dir conntrack.Direction) *flowSlot {
	set := setOf(h)
	w := c.next[set]
	c.next[set] = (w + 1) % flowCacheWays
	c.puts++
	c.tags[set][w] = tagOf(h)
	s := &c.sets[set][w]
	// Field by field: a composite literal is built aside and copied.
	s.key, s.stamp, s.handle, s.rewrite, s.dir = *k, stamp, fh, *rw, dir
	s.ipDelta, s.l4Delta, s.pseudo, s.fast = fastDeltas(k, rw)
	return s
}

// drop empties slot s (its flow is gone or was replaced). Its tag stays:
// the zero key matches no lookup.
func (c *flowCache) drop(s *flowSlot) {
	s.key = conntrack.Key{}
	c.puts++
}

// sameKey compares two keys word by word, ports and protocol first: they
// differ most often.
func sameKey(a, b *conntrack.Key) bool {
	return a[4] == b[4] && a[1] == b[1] && a[3] == b[3] && a[0] == b[0] && a[2] == b[2]
}
