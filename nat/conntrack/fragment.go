package conntrack

import (
	"encoding/binary"
	"math/bits"
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// FragmentKey identifies the fragments of one IP datagram as they arrive,
// before translation.
type FragmentKey struct {
	Src, Dst packet.Addr
	ID       uint32 // IPv4 identification or IPv6 fragment id
	Proto    packet.Proto
}

// FragmentKeyOf returns the key of a parsed fragment.
func FragmentKeyOf(p *packet.Packet) FragmentKey {
	return FragmentKey{Src: p.Src, Dst: p.Dst, ID: p.FragID, Proto: p.Proto}
}

func packFragmentKey(k *FragmentKey) key {
	return key{
		binary.LittleEndian.Uint64(k.Src[0:8]),
		binary.LittleEndian.Uint64(k.Src[8:16]),
		binary.LittleEndian.Uint64(k.Dst[0:8]),
		binary.LittleEndian.Uint64(k.Dst[8:16]),
		uint64(k.ID)<<32 | uint64(k.Proto)<<8 | 1,
	}
}

const fragmentWays = 4

// fragEntry is one remembered first fragment. seq is a seqlock that doubles
// as the writer's lock: a writer owns the entry while seq is odd.
type fragEntry struct {
	seq      atomic.Uint64
	key      [keyWords]atomic.Uint64
	src      [2]atomic.Uint64
	dst      [2]atomic.Uint64
	deadline atomic.Uint64 // ms; 0 when never written
}

// fragmentTable is a 4-way set-associative cache. It may forget a datagram
// when more than four of them hash to one set at once; its later fragments
// then miss and go to the kernel, which is the same outcome as a first
// fragment that was never seen.
type fragmentTable struct {
	entries   []fragEntry
	setMask   uint64
	timeoutMs uint64
	seed      key

	remembered atomic.Uint64
	evicted    atomic.Uint64
	busy       atomic.Uint64
}

func newFragmentTable(capacity int, timeout time.Duration, seed key) *fragmentTable {
	sets := 1 << bits.Len(uint((capacity+fragmentWays-1)/fragmentWays-1))
	for i := range seed {
		seed[i] = bits.RotateLeft64(seed[i], 17) // independent of the flow index
	}
	return &fragmentTable{
		entries:   make([]fragEntry, sets*fragmentWays),
		setMask:   uint64(sets - 1),
		timeoutMs: uint64(timeout / time.Millisecond),
		seed:      seed,
	}
}

func (f *fragmentTable) set(k *key) []fragEntry {
	base := (hashKey(k, &f.seed) & f.setMask) * fragmentWays
	return f.entries[base : base+fragmentWays]
}

func (e *fragEntry) holds(k *key) bool {
	for i := range keyWords {
		if e.key[i].Load() != k[i] {
			return false
		}
	}
	return true
}

// RememberFragment records the addresses the first fragment of datagram k
// was translated to, so that LookupFragment can give them to its later
// fragments, which carry no ports to look the flow up by. Entries live
// FragmentTimeout (default 30 s, the kernel's ipfrag_time: a receiver
// discards a datagram it could not reassemble by then, so later fragments
// are useless). Lock-free and allocation-free.
func (t *Table) RememberFragment(k FragmentKey, newSrc, newDst packet.Addr, now int64) {
	f := t.frags
	pk := packFragmentKey(&k)
	set := f.set(&pk)
	nowMs := msOf(now)
	// Prefer the entry already holding k, then a stale one, then the one
	// closest to expiry.
	way, wayDeadline, same := 0, uint64(1<<63), false
	for i := range set {
		e := &set[i]
		if e.holds(&pk) {
			way, same = i, true
			break
		}
		if d := e.deadline.Load(); d < wayDeadline {
			way, wayDeadline = i, d
		}
	}
	e := &set[way]
	s := e.seq.Load()
	if s&1 != 0 || !e.seq.CompareAndSwap(s, s+1) {
		f.busy.Add(1) // another worker is writing this entry: let it win
		return
	}
	if !same && e.deadline.Load() > nowMs {
		f.evicted.Add(1)
	}
	for i := range keyWords {
		e.key[i].Store(pk[i])
	}
	e.src[0].Store(binary.LittleEndian.Uint64(newSrc[0:8]))
	e.src[1].Store(binary.LittleEndian.Uint64(newSrc[8:16]))
	e.dst[0].Store(binary.LittleEndian.Uint64(newDst[0:8]))
	e.dst[1].Store(binary.LittleEndian.Uint64(newDst[8:16]))
	e.deadline.Store(nowMs + f.timeoutMs)
	e.seq.Store(s + 2)
	f.remembered.Add(1)
}

// LookupFragment returns the addresses remembered for datagram k.
func (t *Table) LookupFragment(k FragmentKey, now int64) (newSrc, newDst packet.Addr, ok bool) {
	f := t.frags
	pk := packFragmentKey(&k)
	set := f.set(&pk)
	nowMs := msOf(now)
	for i := range set {
		e := &set[i]
		s1 := e.seq.Load()
		if s1&1 != 0 || !e.holds(&pk) {
			continue
		}
		s0, s1w := e.src[0].Load(), e.src[1].Load()
		d0, d1 := e.dst[0].Load(), e.dst[1].Load()
		dl := e.deadline.Load()
		if e.seq.Load() != s1 || dl <= nowMs {
			continue
		}
		binary.LittleEndian.PutUint64(newSrc[0:8], s0)
		binary.LittleEndian.PutUint64(newSrc[8:16], s1w)
		binary.LittleEndian.PutUint64(newDst[0:8], d0)
		binary.LittleEndian.PutUint64(newDst[8:16], d1)
		return newSrc, newDst, true
	}
	return packet.Addr{}, packet.Addr{}, false
}
