package conntrack

import (
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/xdproxy/xdproxy/nat/cpu"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// Flags say which translations a flow applies.
type Flags uint8

const (
	DNAT Flags = 1 << iota // the destination was rewritten (frontend -> backend)
	SNAT                   // the source was rewritten (client -> SNAT address and port)
)

// MaxCapacity is the largest table New accepts.
const MaxCapacity = 1 << 28

// Config sizes a Table. Zero fields take defaults.
type Config struct {
	// Capacity is the number of flows the table holds. It is rounded up
	// to a multiple of the number of shards.
	Capacity int
	Timeouts Timeouts
	// EvictionWindow is how many entries an insert into a full shard
	// inspects for an expired or unreplied victim. Default 64.
	EvictionWindow int
	// FragmentCapacity is the number of fragment translations remembered.
	// Default 4096.
	FragmentCapacity int
	// FragmentTimeout is how long a fragment translation is kept.
	// Default 30s, the kernel's reassembly timeout (ipfrag_time).
	FragmentTimeout time.Duration
	// Seed keys the hash; 0 picks a random one. A table restored from a
	// state file keeps the file's seed.
	Seed uint64
	// SweepInterval is how long the SweepDue calls of all workers
	// together take to pass over the whole table once, whatever the
	// packet rate; an expired flow leaves the table (and OnRemove is
	// called) at most about this long after its deadline, unless an
	// insert needs its room first. Default 5s.
	SweepInterval time.Duration

	// OnRemove, when set, is called once for every flow that leaves the
	// table: expired (Sweep, an insert that needed its key or its entry,
	// or found expired when New restores a state file), early-dropped by
	// an insert into a full shard, or deleted (Delete, DeleteIf,
	// DeleteByBackend(s)). orig is the original tuple, reply the tuple reply
	// packets arrive with (the key the XDP program's reply map holds). It
	// runs on the goroutine that removed the flow (a worker's Insert or
	// Sweep, a control-plane Delete, or New), after the removal and with
	// no lock of the table held; calls from several goroutines may run at
	// once and in any order. It must be quick and must not call back into
	// the table's inserts or removals on a path that would wait for this
	// call. The table does not allocate to make the call.
	OnRemove func(orig, reply packet.Tuple)

	// OnOverrun, when set, is called whenever an insert found the table
	// full: it early-dropped an unassured flow to make room, or it failed
	// (Stats.EvictedUnassured, Stats.FullDrops). It runs on the inserting
	// goroutine with a shard lock held, so it must be quick and must not
	// call into the table (a non-blocking channel send, say): the SYN
	// guard wakes on it instead of polling an idle table.
	OnOverrun func()

	// StatePath, when set, keeps the entries in this file, mapped shared,
	// so that the next process to call New with the same path and layout
	// adopts every live flow (see doc.go, "State file"). Put it on a
	// tmpfs such as /run/xdproxy/conntrack.state. Tables with a state file
	// must be given CLOCK_MONOTONIC nanoseconds as now (MonotonicNow).
	StatePath string
	// Clock is the time New uses to tell which restored flows have
	// expired, in the clock every later call passes as now. Default
	// MonotonicNow. Only used with StatePath.
	Clock func() int64

	shards int // tests force a shard count with it
}

// Handle names one lifetime of one entry. It is meant to be used right
// after the Lookup or Insert that returned it: an entry's generation has 16
// bits, so a handle kept while its entry is reused 65536 times could name
// the wrong flow. The zero Handle names nothing.
type Handle struct {
	idx uint32 // entry index + 1
	gen uint16
}

// Flow is what a packet needs from its tracked connection.
type Flow struct {
	Handle Handle
	// Rewrite is the tuple the packet must carry after translation in the
	// direction it was looked up in: the translated tuple for Original, the
	// reverse of the original tuple for Reply.
	Rewrite   packet.Tuple
	Flags     Flags
	ServiceID uint32
	State     State
	// stamp is the entry's sequence number when it was read: see
	// Revalidate.
	stamp uint64
}

// Stamp identifies the lifetime of the entry the flow was read from; a
// cache keeps it to ask Revalidate whether the entry still holds this flow.
func (f *Flow) Stamp() uint64 { return f.stamp }

// InsertResult says whether Insert stored the flow.
type InsertResult uint8

const (
	Inserted    InsertResult = iota
	OrigExists               // a flow with this original tuple exists: look it up instead
	ReplyExists              // the reply tuple is taken: pick another SNAT port
	Full                     // no room and nothing could be evicted
	NoSNATPort               // InsertSNAT found no free port
)

func (r InsertResult) String() string {
	switch r {
	case Inserted:
		return "inserted"
	case OrigExists:
		return "orig_exists"
	case ReplyExists:
		return "reply_exists"
	case Full:
		return "full"
	case NoSNATPort:
		return "no_snat_port"
	}
	return "unknown"
}

// Reason maps a failed insert to the dataplane's drop reason. OrigExists
// normally means another worker inserted the same flow first; a caller that
// does not look it up again drops the packet as DropInvalidState.
func (r InsertResult) Reason() packet.Reason {
	switch r {
	case Inserted:
		return packet.OK
	case ReplyExists, NoSNATPort:
		return packet.DropNoSNATPort
	case Full:
		return packet.DropConntrackFull
	}
	return packet.DropInvalidState
}

// entry is one flow, 128 bytes: two cache lines, aligned when the slab is a
// large (page-aligned) allocation or the state file's mapping. Every field
// is an atomic word so that lock-free readers racing with writers are well
// defined (see doc.go). The layout is also the state file's format: a
// change to it must change stateVersion.
type entry struct {
	seq   atomic.Uint64 // even: stable; odd: being written; +2 per insert
	timer atomic.Uint64 // state, status, generation, deadline (packTimer)
	meta  atomic.Uint64 // service id (bits 0-31), flags (bits 32-39)
	orig  [keyWords]atomic.Uint64
	reply [keyWords]atomic.Uint64
	// created is the insert time in ms while the entry is live and the
	// next free entry (+1) while it is free.
	created atomic.Uint64
	// win is the TCP window tracking word of each Direction (window.go).
	win [2]atomic.Uint64
}

const entrySize = 128

// The slab layout depends on it: two whole cache lines per entry.
var _ [entrySize - unsafe.Sizeof(entry{})]byte
var _ [unsafe.Sizeof(entry{}) - entrySize]byte

// Timer word layout: state (4 bits), status (3), generation (16),
// deadline in ms (41 bits: 69 years of the clock).
const (
	stateMask     = 0xf
	statusShift   = 4
	statusMask    = 0x7
	genShift      = 7
	deadlineShift = 23
	deadlineMaxMs = 1<<(64-deadlineShift) - 1
	timerFree     = 0 // StateFree, the value of a free entry's timer
)

// Hash bits: the home slot uses the low bits (at most 26), the shard bits
// 26-31, the tag bits 33-63, so the three are independent.
const (
	tagShift        = 33
	shardShift      = 26
	maxShardBits    = 6
	maxShardSlots   = 1 << shardShift
	slotEmpty       = 0
	slotTombstone   = 1 << 32 // entry field zero, so never a live slot
	slotDirReply    = 1 << 32
	defaultWindow   = 64
	indexLoadNum    = 3 // an index shard is full at 3/4 occupied slots
	indexLoadDen    = 4
	slotsPerEntry   = 4 // two keys per entry, so at most half the slots hold live keys on average
	entriesPerShard = 4096
)

func packTimer(s State, status uint8, gen uint16, deadlineMs uint64) uint64 {
	return uint64(s) | uint64(status)<<statusShift | uint64(gen)<<genShift | (deadlineMs&deadlineMaxMs)<<deadlineShift
}

func timerState(t uint64) State     { return State(t & stateMask) }
func timerStatus(t uint64) uint8    { return uint8(t>>statusShift) & statusMask }
func timerGen(t uint64) uint16      { return uint16(t >> genShift) }
func timerDeadline(t uint64) uint64 { return t >> deadlineShift }

func msOf(now int64) uint64 {
	if now < 0 {
		return 0
	}
	return uint64(now) / uint64(time.Millisecond)
}

// slotArray is one shard's open-addressing index. The array itself never
// changes size; a rebuild fills the shard's spare array and publishes it.
type slotArray struct {
	slots []atomic.Uint64
	mask  uint64
}

// shard owns a contiguous range of entries and one index. Its lock orders
// inserts and removals; lookups never take it.
type shard struct {
	mu    sync.Mutex
	index atomic.Pointer[slotArray]
	// indexGen counts the rebuilds that began. A rebuild reuses the
	// array the one before it replaced (spare), which a lock-free reader
	// may still be probing: a reader that misses looks again when
	// indexGen moved while it probed (LookupKey).
	indexGen atomic.Uint64
	spare    *slotArray // guarded by mu
	id       int
	first    uint32 // entries [first, first+count) belong to this shard
	count    uint32
	// freeHead is the first free entry + 1, 0 when none. Written under
	// mu; read without it only as a hint (PrefetchInsert).
	freeHead atomic.Uint32
	unused   uint32 // guarded by mu; entries [first+unused, first+count) were never used
	// touched is unused, readable without mu: Sweep and All skip the
	// entries past it (an idle node's large table is mostly never used).
	touched     atomic.Uint32
	evictCursor uint32
	// victimAgeMs is a moving average of the age of the unassured flows
	// evicted from the shard (evictLocked). Guarded by mu.
	victimAgeMs uint64
	used        int // non-empty slots: live and tombstones
	tombs       int
	live        atomic.Int64
	c           shardCounters
	// counts holds the flows of the shard's entries by assured (0, 1) and
	// state, kept by whoever swaps a timer: Insert, Update, removals.
	counts [2][NumStates]atomic.Int64
	_      [64]byte
}

type shardCounters struct {
	inserts, origExists, replyExists, full, indexFull                            atomic.Uint64
	evictedExpired, evictedUnassured, evictedUnreplied, expired, expiredOnInsert atomic.Uint64
	deleted, rebuilds, outOfWindowRST, outOfWindowFIN, tcpOverruns               atomic.Uint64
}

// countTCPOverrun counts an insert of a flow that starts in state st (a
// TCP flow's is TCPNone) that a full table early-dropped a flow for or
// refused (Stats.TCPOverruns).
func (c *shardCounters) countTCPOverrun(st State) {
	if st == TCPNone {
		c.tcpOverruns.Add(1)
	}
}

// Table is the connection table. All methods are safe for concurrent use,
// except Close.
type Table struct {
	entries   []entry
	shards    []shard
	shardMask uint64
	perShard  uint32
	rawSeed   uint64
	seed      key
	timeout   [2][NumStates]uint64 // ms, by assured and state
	slack     [2][NumStates]uint64 // ms
	window    int
	onRemove  func(orig, reply packet.Tuple)
	onOverrun func()
	// sweepEvery is Config.SweepInterval in ns.
	sweepEvery int64

	sweepCursor atomic.Uint64
	// sweepClock is how far SweepDue has swept, as a time: the table is
	// due from there to now (see SweepDue).
	sweepClock atomic.Int64
	_          [48]byte
	snatTries  atomic.Uint64
	snatFails  atomic.Uint64

	frags *fragmentTable

	state    *stateFile // nil without StatePath
	restored RestoreInfo

	// midRebuild, when set (tests only), runs in rebuildLocked after the
	// reused array was cleared and before it is filled.
	midRebuild func(sh *shard, reused *slotArray)
}

// New allocates a table for cfg.Capacity flows.
func New(cfg Config) (*Table, error) {
	if cfg.Capacity <= 0 || cfg.Capacity > MaxCapacity {
		return nil, fmt.Errorf("conntrack: capacity %d outside 1..%d", cfg.Capacity, MaxCapacity)
	}
	if cfg.EvictionWindow < 0 || cfg.FragmentCapacity < 0 || cfg.FragmentTimeout < 0 {
		return nil, errors.New("conntrack: negative eviction window, fragment capacity or fragment timeout")
	}
	nShards := 1
	for nShards < 1<<maxShardBits && nShards*2*entriesPerShard <= cfg.Capacity {
		nShards *= 2
	}
	if cfg.shards > 0 && cfg.shards <= 1<<maxShardBits && cfg.shards&(cfg.shards-1) == 0 {
		nShards = cfg.shards
	}
	perShard := (cfg.Capacity + nShards - 1) / nShards
	nSlots := 1 << bits.Len(uint(perShard*slotsPerEntry-1))
	if nSlots < 16 {
		nSlots = 16
	}
	if nSlots > maxShardSlots {
		return nil, fmt.Errorf("conntrack: capacity %d needs %d index slots per shard, more than %d", cfg.Capacity, nSlots, maxShardSlots)
	}
	t := &Table{
		shards:    make([]shard, nShards),
		shardMask: uint64(nShards - 1),
		perShard:  uint32(perShard),
		window:    cfg.EvictionWindow,
		onRemove:  cfg.OnRemove,
		onOverrun: cfg.OnOverrun,
	}
	if t.window == 0 {
		t.window = defaultWindow
	}
	t.sweepEvery = int64(cfg.SweepInterval)
	if t.sweepEvery <= 0 {
		t.sweepEvery = int64(defaultSweepInterval)
	}
	to := cfg.Timeouts.withDefaults()
	t.timeout = to.byState()
	for a := range t.slack {
		for s := range t.slack[a] {
			// Skipping refreshes smaller than this keeps established
			// flows from writing their entry on every packet.
			t.slack[a][s] = min(1000, t.timeout[a][s]/16)
		}
	}
	// The shards' first index arrays are one allocation, so that huge
	// pages can back them (one shard's array is often smaller than a
	// huge page). A shard's first rebuild gives it a second array of its
	// own, and rebuilds then alternate between the two.
	slots := make([]atomic.Uint64, nShards*nSlots)
	prepareMemory(slots)
	for i := range t.shards {
		sh := &t.shards[i]
		sh.id = i
		sh.first = uint32(i * perShard)
		sh.count = uint32(perShard)
		sh.index.Store(&slotArray{slots: slots[i*nSlots : (i+1)*nSlots : (i+1)*nSlots], mask: uint64(nSlots - 1)})
	}
	if cfg.StatePath == "" {
		t.entries = make([]entry, perShard*nShards)
		prepareMemory(t.entries)
		t.setSeed(cfg.Seed)
	} else if err := t.openState(cfg); err != nil {
		return nil, err
	}
	fragCap := cfg.FragmentCapacity
	if fragCap == 0 {
		fragCap = 4096
	}
	fragTimeout := cfg.FragmentTimeout
	if fragTimeout == 0 {
		fragTimeout = 30 * time.Second
	}
	t.frags = newFragmentTable(fragCap, fragTimeout, t.seed)
	return t, nil
}

// setSeed derives the hash key from seed, or from a random seed if it is 0.
func (t *Table) setSeed(seed uint64) {
	if seed == 0 {
		seed = rand.Uint64() | 1
	}
	t.rawSeed = seed
	// splitmix64: each word of the hash key looks independent of the
	// others, so one leaked word does not give away the rest.
	for i := range t.seed {
		seed += 0x9e3779b97f4a7c15
		z := seed
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		t.seed[i] = z ^ z>>31
	}
}

func newSlotArray(n int) *slotArray {
	a := &slotArray{slots: make([]atomic.Uint64, n), mask: uint64(n - 1)}
	prepareMemory(a.slots) // as New does for the first arrays: it lives as long
	return a
}

// Capacity is the number of flows the table holds.
func (t *Table) Capacity() int { return len(t.entries) }

func (t *Table) shardOf(h uint64) *shard { return &t.shards[(h>>shardShift)&t.shardMask] }

func (t *Table) ownerOf(idx uint32) *shard { return &t.shards[idx/t.perShard] }

// Lookup finds the flow that tuple tu belongs to, in either direction. It
// never locks and never allocates. An expired flow is not returned.
func (t *Table) Lookup(tu packet.Tuple, now int64) (Flow, Direction, bool) {
	k := packKey(&tu)
	var f Flow
	dir, ok := t.LookupKey(&k, hashKey(&k, &t.seed), now, &f)
	return f, dir, ok
}

// LookupKey is Lookup of a packed tuple whose hash (Hash) the caller has
// already computed, for a cache in front of the table that hashes each
// key once. It fills *f in place, for the per-packet path: a Flow returned
// by value is copied just after it was written field by field, which on
// amd64 stalls on a failed store-to-load forward.
func (t *Table) LookupKey(k *Key, h uint64, now int64, f *Flow) (Direction, bool) {
	sh := t.shardOf(h)
	nowMs := msOf(now)
	// It looks again only when a rebuild began during its probe, and a
	// rebuild needs many inserts into the shard first: a reader would
	// have to be descheduled mid-probe again and again to loop for long.
	for {
		gen := sh.indexGen.Load()
		if dir, found, sure := t.lookupIn(sh, sh.index.Load(), gen, k, h, nowMs, f); sure {
			return dir, found
		}
	}
}

// lookupIn probes arr, which the caller loaded from sh after reading
// indexGen as gen, for k. A miss is sure only if no rebuild began since
// gen: a rebuild may be rewriting arr (rebuildLocked), and the caller
// must then look again.
func (t *Table) lookupIn(sh *shard, arr *slotArray, gen uint64, k *Key, h, nowMs uint64, f *Flow) (dir Direction, found, sure bool) {
	tag := h >> tagShift
	pos := h & arr.mask
	for n := uint64(0); n <= arr.mask; n++ {
		s := arr.slots[pos].Load()
		if s == slotEmpty {
			break
		}
		if s>>tagShift == tag && uint32(s) != 0 {
			dir := Original
			if s&slotDirReply != 0 {
				dir = Reply
			}
			if t.readFlow(uint32(s)-1, dir, k, nowMs, f) {
				return dir, true, true
			}
		}
		pos = (pos + 1) & arr.mask
	}
	return Original, false, sh.indexGen.Load() == gen
}

// readFlow reads entry idx under its seqlock and fills f if the entry holds
// k in direction dir and has not expired.
func (t *Table) readFlow(idx uint32, dir Direction, k *key, nowMs uint64, f *Flow) bool {
	e := &t.entries[idx]
	s1 := e.seq.Load()
	if s1&1 != 0 {
		// Being rewritten: the entry is between two lifetimes, and
		// neither holds a published key at this moment.
		return false
	}
	mine, other := &e.orig, &e.reply
	if dir == Reply {
		mine, other = other, mine
	}
	for i := range keyWords {
		if mine[i].Load() != k[i] {
			return false
		}
	}
	var o key
	for i := range keyWords {
		o[i] = other[i].Load()
	}
	meta := e.meta.Load()
	tm := e.timer.Load()
	if e.seq.Load() != s1 {
		return false
	}
	st := timerState(tm)
	if st == StateFree || timerDeadline(tm) <= nowMs {
		return false
	}
	f.Handle = Handle{idx: idx + 1, gen: uint16(s1 >> 1)}
	f.stamp = s1
	o.reverseInto(&f.Rewrite)
	f.Flags = Flags(meta >> 32)
	f.ServiceID = uint32(meta)
	f.State = st
	return true
}

// Update runs the state machine for a packet of the flow h in direction dir
// and refreshes its timeout. It returns the new state, or false if the flow
// is gone. It is one atomic load and at most one compare-and-swap; when
// neither the state changes nor the deadline moves by more than
// min(1s, timeout/16) it writes nothing, so a busy flow does not bounce its
// cache line between the CPUs of its two directions.
//
// Update knows TCP flags only: it accepts every RST and FIN. UpdateTCP
// also tracks sequence numbers and windows; use one or the other for all
// the TCP packets of a table.
func (t *Table) Update(h Handle, dir Direction, tcpFlags uint8, now int64) (State, bool) {
	if h.idx == 0 || h.idx > uint32(len(t.entries)) {
		return StateFree, false
	}
	return t.advance(&t.entries[h.idx-1], h, dir, tcpFlags, msOf(now))
}

// advance is Update on entry e of h.
func (t *Table) advance(e *entry, h Handle, dir Direction, tcpFlags uint8, nowMs uint64) (State, bool) {
	for {
		old := e.timer.Load()
		s := timerState(old)
		if s == StateFree || timerGen(old) != h.gen {
			return StateFree, false
		}
		st := timerStatus(old)
		// Only a replied UDP flow that is not a stream yet needs its age.
		udpOld := s == UDPReplied && st&statusAssured == 0 && nowMs > e.created.Load()+udpStreamMs
		ns, nst := next(s, st, dir, tcpFlags, udpOld)
		a := assuredBit(nst)
		dl := nowMs + t.timeout[a][ns]
		if ns == s && nst == st && dl < timerDeadline(old)+t.slack[a][ns] {
			return s, true
		}
		nt := packTimer(ns, nst, h.gen, dl)
		if e.timer.CompareAndSwap(old, nt) {
			if ns != s || a != assuredBit(st) {
				t.recount(h.idx-1, old, nt)
			}
			return ns, true
		}
	}
}

// recount moves a flow between the per-state counts after its timer was
// swapped from old to new. Transitions are a handful per flow, so this is
// off the per-packet path.
func (t *Table) recount(idx uint32, old, new uint64) {
	c := &t.ownerOf(idx).counts
	c[assuredBit(timerStatus(old))][timerState(old)].Add(-1)
	c[assuredBit(timerStatus(new))][timerState(new)].Add(1)
}

// gone holds a removed flow's keys, copied while the entry could not be
// reused yet, for the OnRemove callback made after the locks are released.
type gone struct {
	orig, reply key
	ok          bool
}

func (t *Table) notify(g *gone) {
	if g.ok && t.onRemove != nil {
		t.onRemove(g.orig.tuple(), g.reply.tuple())
	}
}

// Insert stores a new flow: orig is the tuple as received, translated the
// tuple as sent on. Both orig and the reply tuple (translated reversed)
// become keys; Insert fails if either is taken by a live flow. It takes the
// locks of the (at most two) shards the keys hash to, never allocates, and
// evicts by the policy in doc.go when the shard is full.
//
// A TCP flow starts in TCPNone: call Update with the first packet's flags.
func (t *Table) Insert(orig, translated packet.Tuple, flags Flags, serviceID uint32, now int64) (Handle, InsertResult) {
	ko := packKey(&orig)
	reply := translated.Reverse()
	kr := packKey(&reply)
	ho := hashKey(&ko, &t.seed)
	if ko == kr {
		t.shardOf(ho).c.replyExists.Add(1)
		return Handle{}, ReplyExists
	}
	hr := hashKey(&kr, &t.seed)
	nowMs := msOf(now)
	meta := uint64(serviceID) | uint64(flags)<<32
	st := initialState(orig.Proto)
	for attempt := 0; ; attempt++ {
		var evicted gone
		h, res, staleIdx, staleTimer := t.tryInsert(&ko, &kr, ho, hr, meta, st, nowMs, &evicted)
		t.notify(&evicted)
		if staleIdx == 0 {
			return h, res
		}
		if attempt == 3 {
			t.countExists(ho, res)
			return h, res
		}
		// An expired flow not yet swept holds one of the keys: remove it
		// with its own locks, then try again.
		if g, ok := t.remove(staleIdx-1, staleTimer); ok {
			t.ownerOf(staleIdx - 1).c.expiredOnInsert.Add(1)
			t.notify(&g)
		}
	}
}

// tryInsert inserts under the shard locks. If an expired flow holds a key,
// it returns that entry (+1) and its timer instead. A flow it evicts to
// make room is described in *evicted.
func (t *Table) tryInsert(ko, kr *key, ho, hr, meta uint64, st State, nowMs uint64, evicted *gone) (Handle, InsertResult, uint32, uint64) {
	so, sr := t.shardOf(ho), t.shardOf(hr)
	lockPair(so, sr)
	defer unlockPair(so, sr)

	for i, k := range [2]*key{ko, kr} {
		sh, h := so, ho
		if i == 1 {
			sh, h = sr, hr
		}
		if idx, ok := t.findLocked(sh.index.Load(), k, h); ok {
			res := OrigExists
			if i == 1 {
				res = ReplyExists
			}
			if tm := t.entries[idx].timer.Load(); timerDeadline(tm) <= nowMs {
				return Handle{}, res, idx + 1, tm
			}
			if res == OrigExists {
				so.c.origExists.Add(1)
			} else {
				so.c.replyExists.Add(1)
			}
			return Handle{}, res, 0, 0
		}
	}
	need := 1
	if so == sr {
		need = 2
	}
	if !t.roomInIndex(so, need) || (so != sr && !t.roomInIndex(sr, 1)) {
		so.c.indexFull.Add(1)
		so.c.full.Add(1)
		so.c.countTCPOverrun(st)
		t.overrun()
		return Handle{}, Full, 0, 0
	}
	idx, ok := so.allocLocked(t)
	if !ok {
		t.overrun()
		var early bool
		if idx, ok, early = t.evictLocked(so, sr, nowMs, evicted); !ok {
			so.c.full.Add(1)
			so.c.countTCPOverrun(st)
			return Handle{}, Full, 0, 0
		}
		if early {
			so.c.countTCPOverrun(st)
		}
	}
	e := &t.entries[idx]
	seq := e.seq.Load()
	// The seqlock's writer side needs its stores seen in order: the odd
	// sequence number before the words, the words before the even one
	// and the index slots (doc.go). The odd one is a full barrier: a
	// plain store there could also be dropped by the compiler as dead,
	// with the even store to the same word following. The rest are
	// release stores (storeRelease).
	e.seq.Store(seq + 1)
	for i := range keyWords {
		storeRelease(&e.orig[i], ko[i])
		storeRelease(&e.reply[i], kr[i])
	}
	storeRelease(&e.meta, meta)
	storeRelease(&e.created, nowMs)
	gen := uint16((seq + 2) >> 1)
	storeRelease(&e.win[Original], winTag(gen))
	storeRelease(&e.win[Reply], winTag(gen))
	storeRelease(&e.timer, packTimer(st, 0, gen, nowMs+t.timeout[0][st]))
	storeRelease(&e.seq, seq+2)
	// Publish the keys only now that the entry is complete.
	placeLocked(so, ho, ho>>tagShift<<tagShift|uint64(idx+1))
	placeLocked(sr, hr, hr>>tagShift<<tagShift|slotDirReply|uint64(idx+1))
	so.live.Add(1)
	so.counts[0][st].Add(1)
	storeRelease(&so.c.inserts, so.c.inserts.Load()+1) // written only under so.mu
	return Handle{idx: idx + 1, gen: gen}, Inserted, 0, 0
}

func (t *Table) countExists(ho uint64, res InsertResult) {
	if res == OrigExists {
		t.shardOf(ho).c.origExists.Add(1)
	} else {
		t.shardOf(ho).c.replyExists.Add(1)
	}
}

func lockPair(a, b *shard) {
	if a == b {
		a.mu.Lock()
		return
	}
	if a.id > b.id {
		a, b = b, a
	}
	a.mu.Lock()
	b.mu.Lock()
}

func unlockPair(a, b *shard) {
	a.mu.Unlock()
	if a != b {
		b.mu.Unlock()
	}
}

// findLocked returns the entry holding k in arr, if any.
func (t *Table) findLocked(arr *slotArray, k *key, h uint64) (uint32, bool) {
	tag := h >> tagShift
	pos := h & arr.mask
	for n := uint64(0); n <= arr.mask; n++ {
		s := arr.slots[pos].Load()
		if s == slotEmpty {
			break
		}
		if s>>tagShift == tag && uint32(s) != 0 {
			idx := uint32(s) - 1
			e := &t.entries[idx]
			words := &e.orig
			if s&slotDirReply != 0 {
				words = &e.reply
			}
			match := true
			for i := range keyWords {
				if words[i].Load() != k[i] {
					match = false
					break
				}
			}
			if match {
				return idx, true
			}
		}
		pos = (pos + 1) & arr.mask
	}
	return 0, false
}

// roomInIndex makes sure sh's index can take need more keys, rebuilding it
// to drop tombstones if that is what fills it.
func (t *Table) roomInIndex(sh *shard, need int) bool {
	arr := sh.index.Load()
	limit := len(arr.slots) * indexLoadNum / indexLoadDen
	if sh.used+need <= limit {
		return true
	}
	if sh.tombs > 0 {
		t.rebuildLocked(sh)
	}
	return sh.used+need <= limit
}

// rebuildLocked publishes a copy of sh's index without tombstones. Readers
// still probing the old array find what it held; entries they reach are
// validated as always. It happens only when tombstones fill a quarter of
// the slots, which under a flood of new flows is often, so it allocates
// nothing: it writes into the array the previous rebuild replaced
// (sh.spare) and keeps the one it replaces for the next. A reader may
// still be probing that reused array, so indexGen moves before it is
// cleared, and LookupKey looks again after a miss that saw it move. Each
// key's hash is computed again from the entry, whose keys cannot change
// while sh is locked and the slot is live.
func (t *Table) rebuildLocked(sh *shard) {
	old := sh.index.Load()
	fresh := sh.spare
	// Before any store into the reused array (storeRelease keeps them
	// after this on arm64; on amd64 the locked add orders them).
	sh.indexGen.Add(1)
	if fresh == nil || len(fresh.slots) != len(old.slots) {
		fresh = newSlotArray(len(old.slots))
	} else {
		for i := range fresh.slots {
			storeRelease(&fresh.slots[i], slotEmpty)
		}
	}
	if t.midRebuild != nil {
		t.midRebuild(sh, fresh)
	}
	sh.used, sh.tombs = 0, 0
	for i := range old.slots {
		s := old.slots[i].Load()
		if uint32(s) == 0 {
			continue
		}
		e := &t.entries[uint32(s)-1]
		var k key
		if s&slotDirReply != 0 {
			loadKey(&e.reply, &k)
		} else {
			loadKey(&e.orig, &k)
		}
		h := hashKey(&k, &t.seed)
		pos := h & fresh.mask
		for fresh.slots[pos].Load() != slotEmpty {
			pos = (pos + 1) & fresh.mask
		}
		storeRelease(&fresh.slots[pos], s)
		sh.used++
	}
	sh.index.Store(fresh)
	sh.spare = old
	sh.c.rebuilds.Add(1)
}

// placeLocked stores slot value v for hash h in the first empty or
// tombstone slot of its probe sequence. roomInIndex guaranteed one exists.
func placeLocked(sh *shard, h, v uint64) {
	arr := sh.index.Load()
	pos := h & arr.mask
	for {
		switch arr.slots[pos].Load() {
		case slotEmpty:
			sh.used++
			storeRelease(&arr.slots[pos], v)
			return
		case slotTombstone:
			sh.tombs--
			storeRelease(&arr.slots[pos], v)
			return
		}
		pos = (pos + 1) & arr.mask
	}
}

// unplaceLocked replaces the slot holding v with a tombstone, then turns the
// run of tombstones before an empty slot back into empty slots: no probe
// sequence of a live key can pass through them.
func unplaceLocked(sh *shard, h, v uint64) {
	arr := sh.index.Load()
	pos := h & arr.mask
	for n := uint64(0); ; n++ {
		if n > arr.mask {
			panic("conntrack: index slot of a live entry is missing")
		}
		if arr.slots[pos].Load() == v {
			break
		}
		pos = (pos + 1) & arr.mask
	}
	arr.slots[pos].Store(slotTombstone)
	sh.tombs++
	if arr.slots[(pos+1)&arr.mask].Load() != slotEmpty {
		return
	}
	for arr.slots[pos].Load() == slotTombstone {
		arr.slots[pos].Store(slotEmpty)
		sh.tombs--
		sh.used--
		pos = (pos - 1) & arr.mask
	}
}

// allocLocked pops a free entry of sh.
func (sh *shard) allocLocked(t *Table) (uint32, bool) {
	if f := sh.freeHead.Load(); f != 0 {
		idx := f - 1
		storeRelease32(&sh.freeHead, uint32(t.entries[idx].created.Load()))
		return idx, true
	}
	if sh.unused < sh.count {
		idx := sh.first + sh.unused
		sh.unused++
		sh.touched.Store(sh.unused)
		return idx, true
	}
	return 0, false
}

func (sh *shard) freeLocked(t *Table, idx uint32) {
	t.entries[idx].created.Store(uint64(sh.freeHead.Load()))
	storeRelease32(&sh.freeHead, idx+1)
}

// evictLocked frees an entry of the full shard so (sr is also locked): the
// first expired entry in the next window entries, else the oldest of them
// that is not assured, whatever its state (netfilter's early_drop); but
// an unassured flow at least half as old as the shard's recent victims
// ends the search there, before an expired entry further on, which the
// cursor reaches with the next evictions. An assured flow is never
// evicted. The evicted flow is described in *g.
func (t *Table) evictLocked(so, sr *shard, nowMs uint64, g *gone) (idx uint32, ok, early bool) {
	var victim uint32
	var victimTimer, victimCreated uint64
	found := false
	// An unassured flow at least half as old as the shard's recent
	// victims is taken at once, without reading the rest of the window:
	// under a flood that fills the table, the cursor's next entries are
	// the flows it passed longest ago (each victim's entry goes to a new
	// flow behind the cursor), so the first one is about the oldest, and
	// reading the whole window for every new flow cost more than the rest
	// of the insert (BenchmarkWorkerNewFlowFull). Younger flows ahead of
	// the cursor (entries freed by the sweep and taken again) are passed
	// over as before, in favour of the window's oldest.
	ripe := so.victimAgeMs / 2
	for range min(t.window, int(so.count)) {
		idx := so.first + so.evictCursor
		so.evictCursor++
		if so.evictCursor == so.count {
			so.evictCursor = 0
		}
		e := &t.entries[idx]
		tm := e.timer.Load()
		if timerState(tm) == StateFree {
			continue
		}
		if timerDeadline(tm) <= nowMs {
			if t.unlinkLocked(idx, tm, so, sr, g) {
				so.c.evictedExpired.Add(1)
				return idx, true, false
			}
			continue
		}
		if timerStatus(tm)&statusAssured == 0 {
			if c := e.created.Load(); !found || c < victimCreated {
				victim, victimTimer, victimCreated, found = idx, tm, c, true
				if ripe > 0 && c+ripe <= nowMs {
					break
				}
			}
		}
	}
	if found && t.unlinkLocked(victim, victimTimer, so, sr, g) {
		age := uint64(1) // 0 would mean no victim yet
		if victimCreated < nowMs {
			age = nowMs - victimCreated
		}
		if so.victimAgeMs == 0 {
			so.victimAgeMs = age
		} else {
			so.victimAgeMs = (7*so.victimAgeMs + age) / 8
		}
		so.c.evictedUnassured.Add(1)
		if timerStatus(victimTimer)&statusSeenReply == 0 {
			so.c.evictedUnreplied.Add(1)
		}
		return victim, true, true
	}
	return 0, false, false
}

// loadKey copies key words w.
func loadKey(w *[keyWords]atomic.Uint64, k *key) {
	for i := range keyWords {
		k[i] = w[i].Load()
	}
}

// unlinkLocked removes entry idx, owned by the locked shard so, if its timer
// still reads tm, and copies its keys into *g. Its reply key may live in a
// third shard: that one is only tried, never waited for, since so and sr
// are already held. The keys cannot change meanwhile: only an insert into
// so writes them.
func (t *Table) unlinkLocked(idx uint32, tm uint64, so, sr *shard, g *gone) bool {
	e := &t.entries[idx]
	var ko, kr key
	loadKey(&e.orig, &ko)
	loadKey(&e.reply, &kr)
	hr := hashKey(&kr, &t.seed)
	vr := t.shardOf(hr)
	if vr != so && vr != sr {
		if !vr.mu.TryLock() {
			return false
		}
		defer vr.mu.Unlock()
	}
	if !e.timer.CompareAndSwap(tm, timerFree) {
		return false
	}
	ho := hashKey(&ko, &t.seed)
	unplaceLocked(so, ho, ho>>tagShift<<tagShift|uint64(idx+1))
	unplaceLocked(vr, hr, hr>>tagShift<<tagShift|slotDirReply|uint64(idx+1))
	so.live.Add(-1)
	so.counts[assuredBit(timerStatus(tm))][timerState(tm)].Add(-1)
	g.orig, g.reply, g.ok = ko, kr, true
	return true
}

// remove deletes entry idx if its timer still reads tm, taking the locks
// of both its shards. It returns the removed flow for notify, which the
// caller makes once the locks are released.
func (t *Table) remove(idx uint32, tm uint64) (gone, bool) {
	e := &t.entries[idx]
	so := t.ownerOf(idx)
	// The reply key read here, unlocked, picks the second lock. If the
	// entry is reused meanwhile its generation differs and the timer
	// check below fails; unlinkLocked reads the keys again under the lock.
	var kr key
	loadKey(&e.reply, &kr)
	sr := t.shardOf(hashKey(&kr, &t.seed))
	lockPair(so, sr)
	defer unlockPair(so, sr)
	var g gone
	if e.timer.Load() != tm || !t.unlinkLocked(idx, tm, so, sr, &g) {
		return gone{}, false
	}
	so.freeLocked(t, idx)
	return g, true
}

// Delete removes the flow h if it still exists.
func (t *Table) Delete(h Handle) bool {
	if h.idx == 0 || h.idx > uint32(len(t.entries)) {
		return false
	}
	idx := h.idx - 1
	for {
		tm := t.entries[idx].timer.Load()
		if timerState(tm) == StateFree || timerGen(tm) != h.gen {
			return false
		}
		if g, ok := t.remove(idx, tm); ok {
			t.ownerOf(idx).c.deleted.Add(1)
			t.notify(&g)
			return true
		}
	}
}

// Sweep inspects the next budget entries of the table, taken from a cursor
// shared by all callers, and removes those that have expired. Each worker
// calls it once per batch; it locks only to remove. It returns the number
// removed.
func (t *Table) Sweep(budget int, now int64) int {
	n := uint64(len(t.entries))
	if budget <= 0 {
		return 0
	}
	b := min(uint64(budget), n)
	idx := (t.sweepCursor.Add(b) - b) % n
	nowMs := msOf(now)
	removed := 0
	for left := b; left > 0; {
		sh := t.ownerOf(uint32(idx))
		used := uint64(sh.first) + uint64(sh.touched.Load())
		if idx >= used {
			// The shard's never-used tail: nothing to expire there.
			skip := min(uint64(sh.first)+uint64(sh.count)-idx, left)
			left -= skip
			if idx += skip; idx >= n {
				idx = 0
			}
			continue
		}
		if ahead := idx + sweepAhead; ahead < used {
			// The entries' first lines in a row, one per 128 bytes:
			// the hardware prefetcher follows that stride only within
			// a page, and the sweep's misses were a tenth of a new
			// flow's cost in the new-flow benchmark's profile.
			cpu.Prefetch(uintptr(unsafe.Pointer(&t.entries[ahead])))
		}
		tm := t.entries[idx].timer.Load()
		if timerState(tm) != StateFree && timerDeadline(tm) <= nowMs {
			if g, ok := t.remove(uint32(idx), tm); ok {
				sh.c.expired.Add(1)
				removed++
				t.notify(&g)
			}
		}
		left--
		if idx++; idx == n {
			idx = 0
		}
	}
	return removed
}

// sweepAhead is how many entries ahead of the one it reads Sweep
// prefetches: a page ahead. BenchmarkSweep (64 entries of a full 1M-flow
// table): 680-700 ns without, 610-635 at 8 ahead, 465-475 at 16, 430 at
// 32.
const sweepAhead = 32

// overrun tells Config.OnOverrun that an insert found the table full.
func (t *Table) overrun() {
	if f := t.onOverrun; f != nil {
		f()
	}
}
