// Package conntrack is xdproxy's connection table: for every flow it holds
// the translation chosen for its first packet, so that later packets in both
// directions get the same rewrite, and it picks SNAT ports whose reply tuple
// is unique.
//
// # Keys, entries and the per-packet path
//
// A flow is one entry with two keys: the original tuple (client -> frontend,
// as received) and the reply tuple (backend -> us, the translated tuple
// reversed). Lookup finds either and says which Direction matched; its Flow
// carries the tuple the packet must be rewritten to and a Handle. Update
// then runs the state machine and refreshes the timeout with one atomic
// load and at most one compare-and-swap of the entry's timer word. The
// established path is therefore one Lookup and one Update, with no lock and
// no allocation; Update writes nothing when the state stays and the
// deadline would move by less than min(1s, timeout/16), so a busy flow's
// entry stays in the caches of both CPUs that handle its two directions.
//
// Entries store addresses and ports, never indexes into a service
// snapshot, so flows survive snapshot swaps.
//
// # Memory layout
//
// Entries sit in one slab allocated by New: 128 bytes each (two cache
// lines), made only of atomic.Uint64 words, so the slab has no pointers and
// the garbage collector never scans it. The table is split into up to 64
// shards; each shard owns a contiguous range of entries and an
// open-addressing index of at least 4 slots per entry, rounded up to a power
// of two (64-bit words: 32 to 64 bytes per entry). A 1M-flow table takes
// 160 bytes per flow in all (TestMemoryPerEntry). A key's hash (xxhash of the packed
// tuple, mixed with a random per-table seed) picks the shard, the home slot
// and a 31-bit tag. A slot is empty (0), a tombstone, or tag | direction |
// entry index+1. A flow's entry lives in the shard of its original key; its
// reply key is indexed in the shard its own hash picks.
//
// # Who writes what
//
// Inserts and removals (Insert, Sweep, Delete*, evictions) take the locks
// of the shards both keys of the flow hash to, in shard order; an eviction
// that needs a third shard only tries its lock. Lookups never lock. Under
// those locks a writer changes an entry's key words, meta and hashes, and
// the index slots. The timer word (state, status bits, 16-bit generation,
// deadline in ms) is also changed lock-free by Update, always with
// compare-and-swap, and removal decides against Update by a
// compare-and-swap of the timer word it inspected to zero: whoever swaps
// first wins, so a flow refreshed at the moment the sweeper found it
// expired survives.
//
// # Why readers never see a torn entry
//
// Each entry has a sequence counter: odd while an insert writes it, even
// otherwise, advanced by 2 per insert. A reader loads it, loads the key and
// the other fields, loads it again, and accepts the entry only if both
// loads are equal and even, the full key matches, the state is not free
// and the deadline is after now. All these accesses are atomic, so this is
// well defined under the Go memory model (and the race detector agrees):
// sequentially consistent atomics make a reader that saw the same even value
// twice see only values written before that value was stored. Inserts
// publish the index slots after the entry is complete, so a slot never
// leads to a half-written entry of its own flow.
//
// # Deletion, tombstones and reuse
//
// Removal first swaps the timer to zero (readers then reject the entry),
// then turns its two slots into tombstones, then frees the entry. A reader
// still holding a stale slot value reaches an entry that is free or belongs
// to a later flow; the state check, the sequence check and the full-key
// comparison reject it, so slot reuse cannot return a wrong flow. The
// sequence counter never wraps, and Handles carry the entry's generation
// (the same counter), which Update compares with the generation in the
// timer word, so a handle of a removed flow cannot touch its successor
// (ABA) unless the entry is reused 65536 times between Lookup and Update.
//
// Inserts reuse tombstones. A removal also turns the run of tombstones that
// ends just before an empty slot back into empty slots, which is safe
// because no live key's probe sequence crosses an empty slot. If tombstones
// still fill a shard's index to 3/4, the next insert publishes a rebuilt
// copy through an atomic pointer (this one allocates); readers still on the
// old copy find what it held and validate entries as always.
//
// A lookup that races with the removal and re-insertion of the same key
// may miss it; the dataplane then treats the packet as the start of a flow,
// and Insert reports OrigExists.
//
// # Expiry and a full table
//
// Expired flows are never returned. Sweep removes them incrementally: each
// worker calls it once per batch with a small budget, and the calls share
// one atomic cursor over the slab, so the table is swept in full every
// capacity/budget batches without any worker stalling. An insert that needs
// a key held by an expired flow removes that flow first.
//
// When the shard a new flow belongs to is full, Insert inspects the next
// EvictionWindow entries of that shard (a rotating cursor) and reuses the
// first expired one; failing that, it drops the oldest entry in the window
// that never saw a reply (like netfilter's early_drop); failing that, the
// insert fails with Full (DropConntrackFull). Capacity is per shard, so a
// table with many shards starts evicting a little before it is full: seen
// at 97.9% of a 1M-flow table with 64 shards. Everything is counted; see
// Stats.
//
// # TCP, UDP and ICMP state
//
// The TCP machine follows netfilter's states and default timeouts
// (Timeouts, all configurable) but looks only at flags and direction: no
// sequence or window tracking, so it accepts out-of-window segments and an
// RST with any sequence number closes the flow (its entry then lives 10 s).
// A SYN in TIME_WAIT or CLOSE restarts the flow with the same translation,
// where netfilter would destroy it and translate afresh. A simultaneous
// open (SYN from the reply side) is not modelled. An ACK without SYN on a
// new flow makes it ESTABLISHED, as netfilter's tcp_loose does. UDP is
// UDPUnreplied (30 s) until a reply passes, then UDPReplied (120 s, the
// stream timeout); netfilter waits a little longer before it calls a flow a
// stream. ICMP echo lives 30 s; other protocols 600 s.
//
// # SNAT ports
//
// InsertSNAT picks the source port from a PortRange by probing from a
// start derived from the flow's hash and lets Insert's uniqueness of the
// reply key decide, like netfilter's nf_nat_used_tuple: two flows can only
// share a port if their reply tuples differ (different backend, backend
// port or protocol).
//
// # Fragments
//
// Later IPv4/IPv6 fragments carry no ports. RememberFragment stores, for
// (src, dst, proto, id) of a first fragment, the addresses it was
// translated to; LookupFragment gives them to the later ones. The fragment
// table is a small lock-free 4-way set-associative cache with its own
// seqlocks, entries kept 30 s (the kernel's reassembly timeout). Fragments
// that arrive before their first fragment are not translated.
//
// # Time
//
// Every method that needs the time takes now, in nanoseconds of any clock
// that does not go backwards and stays below 2^61 (a monotonic clock, or
// Unix time until the year 2109). Tests pass it explicitly.
package conntrack
