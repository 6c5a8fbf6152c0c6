package conntrack

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestRevalidate: a cached flow stays valid while its entry holds it and
// becomes invalid once the flow is deleted, expires, or its entry is
// reused, whichever way round.
func TestRevalidate(t *testing.T) {
	tb := newTable(t, Config{Capacity: 16, shards: 1})
	orig := tup(client, 1000, frontend, 80, packet.ProtoUDP)
	mustInsert(t, tb, orig, tup(client, 1000, backend, 8080, packet.ProtoUDP), DNAT, 1, 0)
	k := MakeKey(&orig)
	var f Flow
	dir, ok := tb.LookupKey(&k, tb.Hash(&k), sec, &f)
	if !ok || dir != Original {
		t.Fatal("inserted flow not found")
	}
	if !tb.Revalidate(f.Handle, f.Stamp(), sec) {
		t.Fatal("live flow not valid")
	}
	tb.Update(f.Handle, Reply, 0, 2*sec) // a state change keeps the entry
	if !tb.Revalidate(f.Handle, f.Stamp(), 2*sec) {
		t.Fatal("flow not valid after an update")
	}
	if tb.Revalidate(f.Handle, f.Stamp(), 200*sec) {
		t.Error("expired flow still valid")
	}
	if !tb.Delete(f.Handle) {
		t.Fatal("delete failed")
	}
	if tb.Revalidate(f.Handle, f.Stamp(), 2*sec) {
		t.Error("deleted flow still valid")
	}
	// The same key again, with another translation: a new lifetime, so
	// the old stamp must not pass even if the entry and generation match.
	mustInsert(t, tb, orig, tup(client, 1000, snatAddr, 9090, packet.ProtoUDP), DNAT, 1, 3*sec)
	f2, _, _ := tb.Lookup(orig, 3*sec)
	if f2.Handle.idx != f.Handle.idx {
		t.Fatalf("the flow took entry %d, not the freed %d", f2.Handle.idx, f.Handle.idx)
	}
	if tb.Revalidate(f.Handle, f.Stamp(), 3*sec) {
		t.Error("old stamp valid for the entry's next flow")
	}
	// Even with the generation forced equal (65536 reuses later), the
	// stamp tells the lifetimes apart.
	if tb.Revalidate(Handle{idx: f.Handle.idx, gen: f2.Handle.gen}, f.Stamp(), 3*sec) {
		t.Error("old stamp valid with the new generation")
	}
	if !tb.Revalidate(f2.Handle, f2.Stamp(), 3*sec) {
		t.Error("new flow not valid")
	}
	for _, h := range []Handle{{}, {idx: 17}, {idx: ^uint32(0)}} {
		if tb.Revalidate(h, 0, sec) {
			t.Errorf("handle %+v valid", h)
		}
	}
}

// TestRevalidateRace: while writers keep deleting flows and inserting
// others into the same few entries, a flow a reader cached is never valid
// once its entry holds another flow. Run it with -race.
func TestRevalidateRace(t *testing.T) {
	tb := newTable(t, Config{Capacity: 4, shards: 1})
	const keys = 4
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // writer: each round gives every key a new backend port
		defer wg.Done()
		for round := uint16(0); !stop.Load(); round++ {
			for i := range keys {
				orig := tup(client, uint16(i+1), frontend, 80, packet.ProtoUDP)
				if f, _, ok := tb.Lookup(orig, sec); ok {
					tb.Delete(f.Handle)
				}
				tb.Insert(orig, tup(client, uint16(i+1), backend, round, packet.ProtoUDP), DNAT, 1, sec)
			}
		}
	}()
	checked := 0
	deadline := time.Now().Add(5 * time.Second)
	for n := 0; checked < 2000 && time.Now().Before(deadline); n++ {
		orig := tup(client, uint16(n%keys+1), frontend, 80, packet.ProtoUDP)
		k := MakeKey(&orig)
		var f Flow
		_, ok := tb.LookupKey(&k, tb.Hash(&k), sec, &f)
		if !ok {
			continue
		}
		if !tb.Revalidate(f.Handle, f.Stamp(), sec) {
			continue
		}
		// Valid now: the entry still holds exactly what was read.
		e := &tb.entries[f.Handle.idx-1]
		s1 := e.seq.Load()
		var kr key
		loadKey(&e.reply, &kr)
		if e.seq.Load() == s1 && s1 == f.Stamp() && kr.reversedTuple() != f.Rewrite {
			t.Fatalf("valid stamp but the entry translates to %v, cached %v", kr.reversedTuple(), f.Rewrite)
		}
		checked++
	}
	stop.Store(true)
	wg.Wait()
	if checked == 0 {
		t.Fatal("no lookup found a flow")
	}
}

// TestSweepDue: the calls together pass over the table once per interval
// whatever their number, each inspects at most its limit, and a call with
// less than a chunk due inspects nothing.
func TestSweepDue(t *testing.T) {
	tb := newTable(t, Config{Capacity: 4096, SweepInterval: 2000 * 1e6})
	n := uint64(tb.Capacity())
	for i := range 2000 {
		mustInsert(t, tb, tup(client, uint16(1+i), frontend, 53, packet.ProtoUDP),
			tup(client, uint16(1+i), backend, 53, packet.ProtoUDP), DNAT, 1, 99*sec)
	}
	// First call: one pass is due, at most limit of it.
	tb.SweepDue(100*sec, 256)
	if c := tb.sweepCursor.Load(); c != 256 {
		t.Fatalf("first call inspected %d, want the limit 256", c)
	}
	// Catch up, then calls 1 ms apart: 1/2000 of the table (2 entries)
	// each, under a chunk, so they inspect nothing until a chunk is due.
	for tb.SweepDue(100*sec, 1<<20) > 0 || tb.sweepClock.Load() < 100*sec-sec/100 {
	}
	before := tb.sweepCursor.Load()
	now := 100 * sec
	calls := 0
	for now < 102*sec { // one interval of calls every 1 ms
		now += sec / 1000
		tb.SweepDue(now, 256)
		calls++
	}
	inspected := tb.sweepCursor.Load() - before
	if inspected < n-sweepChunk || inspected > n+sweepChunk {
		t.Errorf("%d calls in an interval inspected %d entries, want about %d", calls, inspected, n)
	}
	// Everything expired at 129 s: after one interval of calls from
	// 130 s, the table is empty.
	for now = 130 * sec; now < 132*sec+sec/10; now += sec / 100 {
		tb.SweepDue(now, 256)
	}
	if st := tb.Stats(); st.Live != 0 || st.Expired != 2000 {
		t.Errorf("after an interval of calls: %d live, %d expired", st.Live, st.Expired)
	}
	// An empty table is not scanned.
	before = tb.sweepCursor.Load()
	for now = 140 * sec; now < 145*sec; now += sec / 100 {
		tb.SweepDue(now, 256)
	}
	if c := tb.sweepCursor.Load(); c != before {
		t.Errorf("an empty table: %d entries inspected", c-before)
	}
	if n := tb.SweepDue(now-sec, 256); n != 0 || tb.SweepDue(now, 0) != 0 {
		t.Error("a call in the past or with no limit swept")
	}
}

// TestInsertEntryPredictsInserts: the entries PrefetchInsert prefetches for
// a batch's inserts into one shard (insertEntry with ahead 0, 1, 2, ...)
// are the entries those inserts fill, while the shard takes entries it
// never used; from the free list, only the next insert's is told.
func TestInsertEntryPredictsInserts(t *testing.T) {
	tb := newTable(t, Config{Capacity: 4096, shards: 4})
	orig := func(i int) packet.Tuple { return tup(client, uint16(1000+i), frontend, 80, packet.ProtoUDP) }
	hashOf := func(i int) uint64 { k := MakeKey(ptr(orig(i))); return tb.Hash(&k) }
	// A batch of 200 flows: predict each one's entry, by shard, before
	// any is inserted.
	ahead := map[int]int{}
	want := make([]uint32, 200)
	for i := range want {
		h := hashOf(i)
		sh := tb.ShardIndex(h)
		e, ok := tb.insertEntry(h, ahead[sh])
		if !ok {
			t.Fatalf("flow %d: no prediction from unused entries", i)
		}
		want[i] = e
		ahead[sh]++
	}
	handles := make([]Handle, len(want))
	for i := range want {
		handles[i] = mustInsert(t, tb, orig(i), tup(client, uint16(1000+i), backend, 8080, packet.ProtoUDP), DNAT, 1, 0)
		if got := handles[i].idx - 1; got != want[i] {
			t.Fatalf("flow %d filled entry %d, predicted %d", i, got, want[i])
		}
	}
	// Freed entries: the next insert into that shard is told, no later one.
	tb.Delete(handles[0])
	h := hashOf(0)
	if e, ok := tb.insertEntry(h, 0); !ok || e != want[0] {
		t.Errorf("after a delete: predicted %d, %v; want the freed entry %d", e, ok, want[0])
	}
	if _, ok := tb.insertEntry(h, 1); ok {
		t.Error("after a delete: predicted the second insert's entry from the free list")
	}
}

func ptr[T any](v T) *T { return &v }
