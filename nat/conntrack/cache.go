package conntrack

import (
	"math/bits"
	"time"
	"unsafe"

	"github.com/xdproxy/xdproxy/nat/cpu"
)

// This file is the table's side of a cache in front of it (a worker's
// flow cache): hashing a key once for both, telling whether a cached flow
// is still the entry's, and prefetching the memory of the next packets'
// lookups. See doc.go, "Caches in front of the table".

// Hash is the hash the table files k under, for LookupKey and for a cache
// that wants the same spread.
func (t *Table) Hash(k *Key) uint64 { return hashKey(k, &t.seed) }

// Revalidate reports whether flow h, read by a lookup that returned a
// Flow with Stamp stamp, is still held by its entry and has not expired
// at now. It is two atomic loads from the entry's first cache line (the
// timer word and the sequence number), the line Update reads anyway.
//
// The sequence number changes with every insert into the entry and never
// wraps, so an equal one means the keys and the translation are still the
// ones the lookup read: a flow removed and its entry reused is never taken
// for the one cached, however often that happened. The timer is read
// first; a timer written by a later insert would come with a sequence
// number that changed before it (inserts make the sequence odd before
// they write the timer), so the check cannot pass on a half-written or
// newer entry.
func (t *Table) Revalidate(h Handle, stamp uint64, now int64) bool {
	i := h.idx - 1 // 0 wraps past the end
	if i >= uint32(len(t.entries)) {
		return false
	}
	e := &t.entries[i]
	tm := e.timer.Load()
	if timerState(tm) == StateFree || timerGen(tm) != h.gen || timerDeadline(tm) <= msOf(now) {
		return false
	}
	return e.seq.Load() == stamp
}

// Stamp returns the stamp of flow h, for a caller that inserted the flow
// itself and wants to cache it (Insert returns no Flow): the entry's
// sequence number, if it still belongs to h's lifetime (the same 16-bit
// generation; for a wrong answer the entry would have to be reused 65536
// times between the Insert and this call).
func (t *Table) Stamp(h Handle) (uint64, bool) {
	i := h.idx - 1
	if i >= uint32(len(t.entries)) {
		return 0, false
	}
	s := t.entries[i].seq.Load()
	return s, s&1 == 0 && uint16(s>>1) == h.gen
}

// A caller with a batch of packets prefetches what the batch's lookups
// will read before it works on any of them, so that their cache misses
// overlap instead of following one another: PrefetchSlot for each packet,
// then PrefetchLookup for each (its slot has arrived by then), or
// PrefetchFlow for a flow it already holds a handle to.

// PrefetchSlot prefetches the index slot where the lookup of a key with
// hash h starts.
func (t *Table) PrefetchSlot(h uint64) {
	arr := t.shardOf(h).index.Load()
	cpu.Prefetch(uintptr(unsafe.Pointer(&arr.slots[h&arr.mask])))
}

// PrefetchLookup reads the index slot where the lookup of a key with hash
// h starts and, when its tag matches, prefetches the entry it points to.
// It reports whether the table may hold the key: false when that slot is
// empty (a lookup would stop there), at the time of the call.
func (t *Table) PrefetchLookup(h uint64) (maybe bool) {
	arr := t.shardOf(h).index.Load()
	s := arr.slots[h&arr.mask].Load()
	if i := uint32(s) - 1; s>>tagShift == h>>tagShift && i < uint32(len(t.entries)) {
		t.prefetchEntry(i)
	}
	return s != slotEmpty
}

// PrefetchFlow prefetches flow h's entry: Revalidate, Update and UpdateTCP
// read both of its cache lines.
func (t *Table) PrefetchFlow(h Handle) {
	if i := h.idx - 1; i < uint32(len(t.entries)) {
		t.prefetchEntry(i)
	}
}

// PrefetchInsert prefetches the entry that an Insert of a flow whose
// original tuple has hash h would fill next (the shard's first free
// entry), so that the insert's writes do not wait for it. It reads the
// shard's free list without its lock: another insert may take that entry
// first, and the prefetch is then wasted, nothing more.
//
// ahead is how many inserts into the same shard come before this one (the
// caller's batch): while the shard takes entries it never used, in order,
// the ahead-th next one is prefetched; from the free list, only the head
// is known without reading the list, so a later insert prefetches nothing.
func (t *Table) PrefetchInsert(h uint64, ahead int) {
	if i, ok := t.insertEntry(h, ahead); ok {
		t.prefetchEntry(i)
	}
}

// insertEntry is the entry that an insert into the shard of hash h will
// fill when ahead other inserts into that shard come before it, if that
// can be told without the shard's lock (PrefetchInsert).
func (t *Table) insertEntry(h uint64, ahead int) (uint32, bool) {
	sh := t.shardOf(h)
	if f := sh.freeHead.Load(); f != 0 {
		i := f - 1
		return i, ahead == 0 && i < uint32(len(t.entries))
	}
	if u := uint64(sh.touched.Load()) + uint64(ahead); u < uint64(sh.count) {
		return sh.first + uint32(u), true
	}
	return 0, false
}

// ShardIndex is the shard of a key with hash h, 0 to MaxShards-1, so that
// a caller can count the inserts of a batch into each (PrefetchInsert).
func (t *Table) ShardIndex(h uint64) int { return int((h >> shardShift) & t.shardMask) }

// MaxShards is the most shards a table has.
const MaxShards = 1 << maxShardBits

func (t *Table) prefetchEntry(i uint32) {
	p := uintptr(unsafe.Pointer(&t.entries[i]))
	cpu.Prefetch(p)
	cpu.Prefetch(p + entrySize/2)
}

// defaultSweepInterval is Config.SweepInterval's default. A pass over a
// million entries reads 128 MiB: once per 5 s that is about 1% of a CPU
// over all workers.
const defaultSweepInterval = 5 * time.Second

// sweepChunk is the fewest entries SweepDue inspects at once: fewer calls
// move the shared clock, and the slab is read in runs the hardware
// prefetcher follows.
const sweepChunk = 64

// SweepDue removes expired flows from the part of the table that is due
// at now, so that the calls of every worker together pass over the whole
// table once per Config.SweepInterval, however many packets or batches
// they see; each call inspects at most limit entries. Workers call it once
// per batch and when idle: most calls find less than a chunk due and
// return after one atomic load. A backlog (after a long pause, or at
// start) is at most one pass. It returns the number removed.
func (t *Table) SweepDue(now int64, limit int) int {
	n := uint64(len(t.entries))
	every := t.sweepEvery
	for {
		last := t.sweepClock.Load()
		from := last
		if now-from > every {
			from = now - every
		}
		el := now - from
		if el <= 0 {
			return 0
		}
		// due = el * n / every; el <= every, so the quotient fits.
		hi, lo := bits.Mul64(uint64(el), n)
		due, _ := bits.Div64(hi, lo, uint64(every))
		if due < sweepChunk && due < n {
			return 0
		}
		due = min(due, uint64(limit))
		if due == 0 {
			return 0
		}
		hi, lo = bits.Mul64(due, uint64(every))
		adv, _ := bits.Div64(hi, lo, n)
		if t.sweepClock.CompareAndSwap(last, from+int64(max(adv, 1))) {
			if !t.anyLive() {
				return 0 // nothing can expire: an idle node scans nothing
			}
			return t.Sweep(int(due), now)
		}
	}
}

// anyLive reports whether any shard holds a flow.
func (t *Table) anyLive() bool {
	for i := range t.shards {
		if t.shards[i].live.Load() != 0 {
			return true
		}
	}
	return false
}
