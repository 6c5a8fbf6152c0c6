package conntrack

import (
	"iter"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// FlowInfo is a copy of one entry, for the admin CLI and for tests.
type FlowInfo struct {
	Handle     Handle
	Orig       packet.Tuple // as received: client -> frontend
	Translated packet.Tuple // as sent on: to the backend
	Flags      Flags
	ServiceID  uint32
	State      State
	SeenReply  bool
	Assured    bool          // never early-dropped (see doc.go)
	Created    time.Duration // since the clock's zero, ms precision
	Expires    time.Duration
}

// Reply is the tuple reply packets arrive with.
func (f *FlowInfo) Reply() packet.Tuple { return f.Translated.Reverse() }

// readInfo copies entry idx, retrying while a writer holds it. It also
// returns the timer it read, for a removal that must not hit a newer flow.
func (t *Table) readInfo(idx uint32) (FlowInfo, uint64, bool) {
	e := &t.entries[idx]
	for range 16 {
		s1 := e.seq.Load()
		if s1&1 != 0 {
			continue
		}
		tm := e.timer.Load()
		if timerState(tm) == StateFree {
			return FlowInfo{}, 0, false
		}
		var o, r key
		for i := range keyWords {
			o[i] = e.orig[i].Load()
			r[i] = e.reply[i].Load()
		}
		meta := e.meta.Load()
		created := e.created.Load()
		if e.seq.Load() != s1 {
			continue
		}
		return FlowInfo{
			Handle:     Handle{idx: idx + 1, gen: uint16(s1 >> 1)},
			Orig:       o.tuple(),
			Translated: r.tuple().Reverse(),
			Flags:      Flags(meta >> 32),
			ServiceID:  uint32(meta),
			State:      timerState(tm),
			SeenReply:  timerStatus(tm)&statusSeenReply != 0,
			Assured:    timerStatus(tm)&statusAssured != 0,
			Created:    time.Duration(created) * time.Millisecond,
			Expires:    time.Duration(timerDeadline(tm)) * time.Millisecond,
		}, tm, true
	}
	return FlowInfo{}, 0, false
}

// All yields every flow that has not expired at now. It scans the whole
// slab without locks; flows inserted or removed during the scan may or may
// not be seen.
func (t *Table) All(now int64) iter.Seq[FlowInfo] {
	nowMs := msOf(now)
	return func(yield func(FlowInfo) bool) {
		for i := range t.shards {
			sh := &t.shards[i]
			for idx := sh.first; idx < sh.first+sh.touched.Load(); idx++ {
				fi, tm, ok := t.readInfo(idx)
				if !ok || timerDeadline(tm) <= nowMs {
					continue
				}
				if !yield(fi) {
					return
				}
			}
		}
	}
}

// CountByState counts the flows that have not expired at now, per state.
func (t *Table) CountByState(now int64) [NumStates]int {
	var c [NumStates]int
	nowMs := msOf(now)
	for i := range t.entries {
		tm := t.entries[i].timer.Load()
		if s := timerState(tm); s != StateFree && timerDeadline(tm) > nowMs {
			c[s]++
		}
	}
	return c
}

// DeleteIf removes every flow for which match returns true and returns how
// many it removed. It scans the whole table: a control-plane operation.
// match must not keep f: the next entry is read into it.
func (t *Table) DeleteIf(match func(f *FlowInfo) bool) int {
	return t.deleteIf(match, nil)
}

// deleteIf is DeleteIf that also calls removed, when set, with each flow
// it removed.
func (t *Table) deleteIf(match func(*FlowInfo) bool, removed func(*FlowInfo)) int {
	n := 0
	// One FlowInfo for the whole scan: match escapes, so a variable per
	// entry would be an allocation per entry (a million per scan).
	var fi FlowInfo
	for idx := range uint32(len(t.entries)) {
		var tm uint64
		var ok bool
		if fi, tm, ok = t.readInfo(idx); !ok || !match(&fi) {
			continue
		}
		if g, ok := t.remove(idx, tm); ok {
			t.ownerOf(idx).c.deleted.Add(1)
			n++
			t.notify(&g)
			if removed != nil {
				removed(&fi)
			}
		}
	}
	return n
}

// DeleteByBackend removes the flows translated to backend addr:port over
// proto; port 0 matches every port and proto 0 every protocol. Call it when
// an endpoint goes away, so that UDP flows, which never end by themselves
// while the client keeps sending, move to a live endpoint.
// Several endpoints at once take one scan with DeleteByBackends.
func (t *Table) DeleteByBackend(addr packet.Addr, port uint16, proto packet.Proto) int {
	return t.DeleteByBackends(map[Backend]int{{Addr: addr, Port: port, Proto: proto}: 0})
}

// Backend is an endpoint as DeleteByBackend takes it: Port 0 matches every
// port and Proto 0 every protocol.
type Backend struct {
	Addr  packet.Addr
	Port  uint16
	Proto packet.Proto
}

// DeleteByBackends removes the flows translated to any key of backends, in
// one scan of the table where a DeleteByBackend per key would take one
// each. It adds to each key's value the flows
// removed for it (a flow that several keys match counts once, for the
// first of: exact, any protocol, any port, both) and returns the total.
func (t *Table) DeleteByBackends(backends map[Backend]int) int {
	if len(backends) == 0 {
		return 0
	}
	// Most flows go to addresses not in backends; a map of bare addresses
	// (hashed as plain memory, unlike Backend) turns them away quicker.
	addrs := make(map[packet.Addr]struct{}, len(backends))
	var anyPort, anyProto bool
	for b := range backends {
		addrs[b.Addr] = struct{}{}
		anyPort = anyPort || b.Port == 0
		anyProto = anyProto || b.Proto == 0
	}
	var hit Backend // the key match found, for removed
	match := func(f *FlowInfo) bool {
		d := &f.Translated
		if !hasKey(addrs, d.Dst) {
			return false
		}
		hit = Backend{Addr: d.Dst, Port: d.DstPort, Proto: d.Proto}
		if hasKey(backends, hit) {
			return true
		}
		if anyProto {
			if hit.Proto = 0; hasKey(backends, hit) {
				return true
			}
			hit.Proto = d.Proto
		}
		if anyPort {
			if hit.Port = 0; hasKey(backends, hit) {
				return true
			}
			if anyProto {
				if hit.Proto = 0; hasKey(backends, hit) {
					return true
				}
			}
		}
		return false
	}
	return t.deleteIf(match, func(*FlowInfo) { backends[hit]++ })
}

func hasKey[K comparable, V any](m map[K]V, k K) bool {
	_, ok := m[k]
	return ok
}

// Stats are the table's counters since New, and its current fill. Flow
// counts (Live, Assured, Unassured, ByState) include flows that have
// expired but were not swept yet; CountByState leaves those out.
type Stats struct {
	Live      uint64 // flows in the table, expired ones not yet swept included
	Assured   uint64 // of Live, flows that are assured: never early-dropped
	Unassured uint64 // of Live, flows an insert into a full shard may drop
	// ByState is Live by state (index by State; StateFree stays 0).
	ByState     [NumStates]uint64
	FillRatio   float64 // Live / Capacity
	Inserts     uint64
	OrigExists  uint64 // inserts refused: the original tuple was taken
	ReplyExists uint64 // inserts refused: the reply tuple was taken
	FullDrops   uint64 // inserts refused: DropConntrackFull
	IndexFull   uint64 // of FullDrops, those where the shard's index had no room
	// EvictedExpired counts entries reused by an insert into a full shard
	// because they had expired.
	EvictedExpired uint64
	// EvictedUnassured counts live flows that were not assured, dropped
	// to make room (early drop), in any state.
	EvictedUnassured uint64
	// EvictedUnreplied counts, of EvictedUnassured, the flows that had
	// never seen a reply.
	EvictedUnreplied uint64
	// TCPOverruns counts inserts of TCP flows that found the table full:
	// they early-dropped an unassured flow (of any protocol) or were
	// refused. It is what a flood of new TCP connections drives, and a
	// flood of other protocols (DNS churn) does not.
	TCPOverruns     uint64
	Expired         uint64 // removed by Sweep
	ExpiredOnInsert uint64 // expired flows removed because a new flow needed their key
	Deleted         uint64 // removed by Delete, DeleteIf, DeleteByBackend(s)
	IndexRebuilds   uint64
	// OutOfWindowRST and OutOfWindowFIN count TCP resets and FINs that
	// UpdateTCP ignored because their sequence numbers were outside the
	// tracked window (the caller drops them).
	OutOfWindowRST     uint64
	OutOfWindowFIN     uint64
	SNATRetries        uint64 // ports tried beyond the first
	SNATExhausted      uint64 // InsertSNAT calls that found no port
	FragsRemembered    uint64
	FragsEvicted       uint64 // live fragment translations overwritten
	FragsWriterBusy    uint64 // RememberFragment calls that lost to a concurrent writer
	Capacity           uint64
	Shards             uint64
	IndexSlotsPerShard uint64
}

// Stats sums the counters. It reads atomics only (a few hundred per
// shard), so a metrics scrape never stalls a worker.
func (t *Table) Stats() Stats {
	var s Stats
	for i := range t.shards {
		sh := &t.shards[i]
		c := &sh.c
		s.Live += uint64(sh.live.Load())
		for a := range sh.counts {
			for st := range sh.counts[a] {
				n := uint64(max(0, sh.counts[a][st].Load()))
				s.ByState[st] += n
				if a == 1 {
					s.Assured += n
				}
			}
		}
		s.Inserts += c.inserts.Load()
		s.OrigExists += c.origExists.Load()
		s.ReplyExists += c.replyExists.Load()
		s.FullDrops += c.full.Load()
		s.IndexFull += c.indexFull.Load()
		s.EvictedExpired += c.evictedExpired.Load()
		s.EvictedUnassured += c.evictedUnassured.Load()
		s.EvictedUnreplied += c.evictedUnreplied.Load()
		s.TCPOverruns += c.tcpOverruns.Load()
		s.Expired += c.expired.Load()
		s.ExpiredOnInsert += c.expiredOnInsert.Load()
		s.Deleted += c.deleted.Load()
		s.IndexRebuilds += c.rebuilds.Load()
		s.OutOfWindowRST += c.outOfWindowRST.Load()
		s.OutOfWindowFIN += c.outOfWindowFIN.Load()
	}
	// The counts are updated right after each swap, without a lock, so
	// under load they may trail Live by a transition or two.
	s.Assured = min(s.Assured, s.Live)
	s.Unassured = s.Live - s.Assured
	s.SNATRetries = t.snatTries.Load()
	s.SNATExhausted = t.snatFails.Load()
	s.FragsRemembered = t.frags.remembered.Load()
	s.FragsEvicted = t.frags.evicted.Load()
	s.FragsWriterBusy = t.frags.busy.Load()
	s.Capacity = uint64(len(t.entries))
	if s.Capacity > 0 {
		s.FillRatio = float64(s.Live) / float64(s.Capacity)
	}
	s.Shards = uint64(len(t.shards))
	s.IndexSlotsPerShard = uint64(len(t.shards[0].index.Load().slots))
	return s
}
