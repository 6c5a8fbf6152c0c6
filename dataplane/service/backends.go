package service

import (
	"math/bits"
	"slices"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// backendIndex is the set of endpoint keys behind IsBackend. It is split
// by hash into shards of about shardTarget keys, and each slot counts the
// ports that list its key, so that CompileFrom copies only the few shards
// a change touches instead of rebuilding a set of every endpoint in the
// cluster. Shards are keyIndexes whose pos field holds that count; like
// everything in a Table they are never modified once built, and tables
// share the shards they have in common.
type backendIndex struct {
	shards []keyIndex
	shift  uint // a hash's shard is hash >> shift; 64 for a single shard
	total  int  // sum of all counts
}

const shardTarget = 64

// shardsFor returns the number of shards for n keys, a power of two.
func shardsFor(n int) int {
	if n <= shardTarget {
		return 1
	}
	return min(1<<bits.Len(uint(n/shardTarget-1)), 1<<16)
}

// shardSlots returns the slot count of a shard holding n keys: a power of
// two at least 2n (a load factor of at most one half), and at least 8.
func shardSlots(n int) int {
	if n <= 4 {
		return 8
	}
	return 1 << bits.Len(uint(2*n-1))
}

// newBackendIndex indexes the endpoint keys of all ports.
func newBackendIndex(ports []*Port) backendIndex {
	n := 0
	for i := range ports {
		n += len(ports[i].endpointKeys)
	}
	nShards := shardsFor(n)
	b := backendIndex{shards: make([]keyIndex, nShards), shift: uint(64 - bits.TrailingZeros(uint(nShards))), total: n}
	hashes := make([]uint64, 0, n)
	perShard := make([]int, nShards)
	for i := range ports {
		for k := range ports[i].endpointKeys {
			h := hashKey(&ports[i].endpointKeys[k])
			hashes = append(hashes, h)
			perShard[h>>b.shift]++
		}
	}
	// One allocation for all shards' slots.
	slots := 0
	for _, c := range perShard {
		slots += shardSlots(c)
	}
	arena := make([]indexSlot, slots)
	for s, c := range perShard {
		size := shardSlots(c)
		b.shards[s] = keyIndex{slots: arena[:size:size], mask: uint64(size - 1)}
		arena = arena[size:]
	}
	next := 0
	for i := range ports {
		for k := range ports[i].endpointKeys {
			h := hashes[next]
			next++
			b.shards[h>>b.shift].add(h, ports[i].endpointKeys[k], 1)
		}
	}
	return b
}

// add raises the count of k, whose hash is h, by n.
func (x *keyIndex) add(h uint64, k Key, n int32) {
	for i := h & x.mask; ; i = (i + 1) & x.mask {
		s := &x.slots[i]
		if s.pos == 0 {
			s.key, s.pos = k, n
			return
		}
		if s.key == k {
			s.pos += n
			return
		}
	}
}

func (b *backendIndex) contains(addr *packet.Addr, port uint16, proto packet.Proto) bool {
	if len(b.shards) == 0 {
		return false
	}
	h := hashParts(addr, port, proto)
	x := &b.shards[h>>b.shift]
	for i := h & x.mask; ; i = (i + 1) & x.mask {
		s := &x.slots[i]
		if s.pos == 0 {
			return false
		}
		if s.key.Port == port && s.key.Proto == proto && s.key.Addr == *addr {
			return true
		}
	}
}

// same reports whether b and o share all their shards, and so hold the
// same keys.
func (b *backendIndex) same(o *backendIndex) bool {
	return len(b.shards) == len(o.shards) && (len(b.shards) == 0 || &b.shards[0] == &o.shards[0])
}

// keys lists every key once.
func (b *backendIndex) keys() []Key {
	out := make([]Key, 0, b.total)
	for s := range b.shards {
		for _, slot := range b.shards[s].slots {
			if slot.pos > 0 {
				out = append(out, slot.key)
			}
		}
	}
	return out
}

type keyDelta struct {
	shard int
	hash  uint64
	key   Key
	n     int32
}

// update makes b prev with the keys of the ports prev had and the new
// table lacks taken out, and those of the ports compiled afresh put in:
// from maps each new port to the prev port it was taken over from, or -1.
// It copies the shards it changes and shares the rest with prev. It
// reports false, leaving b as it was, when so much changed that building
// the index afresh is as cheap and sizes the shards better.
func (b *backendIndex) update(prev *backendIndex, prevPorts []*Port, from []int32, ports []*Port) bool {
	kept := make([]bool, len(prevPorts))
	changed := 0
	for i, k := range from {
		if k >= 0 {
			kept[k] = true
		} else {
			changed += len(ports[i].endpointKeys)
		}
	}
	for k := range prevPorts {
		if !kept[k] {
			changed += len(prevPorts[k].endpointKeys)
		}
	}
	if changed == 0 {
		*b = *prev
		return true
	}
	if changed > prev.total/4+shardTarget {
		return false
	}

	// Net change per key: a port recompiled with the same endpoints
	// cancels out and touches no shard.
	net := make(map[Key]int32, changed)
	for k := range prevPorts {
		if !kept[k] {
			for _, key := range prevPorts[k].endpointKeys {
				net[key]--
			}
		}
	}
	for i, k := range from {
		if k < 0 {
			for _, key := range ports[i].endpointKeys {
				net[key]++
			}
		}
	}
	total := prev.total
	deltas := make([]keyDelta, 0, len(net))
	for key, n := range net {
		if n != 0 {
			h := hashKey(&key)
			deltas = append(deltas, keyDelta{shard: int(h >> prev.shift), hash: h, key: key, n: n})
			total += int(n)
		}
	}
	if s := shardsFor(total); s > 4*len(prev.shards) || 4*s < len(prev.shards) {
		return false
	}
	*b = backendIndex{shift: prev.shift, total: total}
	if len(deltas) == 0 {
		b.shards = prev.shards
		return true
	}
	b.shards = slices.Clone(prev.shards)
	slices.SortFunc(deltas, func(x, y keyDelta) int { return x.shard - y.shard })
	for len(deltas) > 0 {
		n := 1
		for n < len(deltas) && deltas[n].shard == deltas[0].shard {
			n++
		}
		s := deltas[0].shard
		b.shards[s] = prev.shards[s].withDeltas(deltas[:n])
		deltas = deltas[n:]
	}
	return true
}

// withDeltas returns a copy of the shard x with the counts changed by ds;
// keys whose count drops to zero leave it.
func (x *keyIndex) withDeltas(ds []keyDelta) keyIndex {
	live := 0
	for i := range x.slots {
		if x.slots[i].pos > 0 {
			live++
		}
	}
	size := shardSlots(live + len(ds))
	nx := keyIndex{slots: make([]indexSlot, size), mask: uint64(size - 1)}
	for i := range x.slots {
		s := &x.slots[i]
		if s.pos <= 0 {
			continue
		}
		n := s.pos
		for d := range ds {
			if ds[d].key == s.key {
				n += ds[d].n
				ds[d].n = 0 // applied
			}
		}
		if n > 0 {
			nx.add(hashKey(&s.key), s.key, n)
		}
	}
	for d := range ds {
		if ds[d].n > 0 {
			nx.add(ds[d].hash, ds[d].key, ds[d].n)
		}
	}
	return nx
}
