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
// UpdateTCP is Update for callers that have the TCP header
// (ParseTCPSegment): it also tracks sequence numbers and windows (see "TCP
// windows") at the cost of two more loads and, amortised, far less than
// one store per packet.
//
// Entries store addresses and ports, never indexes into a service
// snapshot, so flows survive snapshot swaps.
//
// # Memory layout
//
// Entries sit in one slab: 128 bytes each (two cache lines), made only of
// atomic.Uint64 words, so the slab has no pointers and the garbage
// collector never scans it. The words are: sequence, timer, meta (service
// id, flags), the original key (5), the reply key (5), created (ms), and
// one TCP window word per direction. The slab is allocated by New, or
// mapped from the state file (see "State file"). The table is split into
// up to 64 shards; each shard owns a contiguous range of entries and an
// open-addressing index of at least 4 slots per entry, rounded up to a power
// of two (64-bit words: 32 to 64 bytes per entry); the shards' first
// index arrays are one allocation. A 1M-flow table takes 160 bytes per
// flow in all (TestMemoryPerEntry); once churn has made a shard rebuild
// its index, the shard keeps a second array for the next rebuild (see
// "Deletion, tombstones and reuse"), up to 32-64 bytes more per flow. New asks for transparent huge pages for
// the slab and the index (MADV_HUGEPAGE: lookups touch both at random, and
// with 4 KiB pages most of them would also miss the TLB) and faults every
// page in at once, so that no early flow pays a page fault.
//
// A key's hash picks the shard (bits 26 up), the home slot (the low bits)
// and a 31-bit tag (the top bits). It is keyed by a secret per-table seed
// (random unless Config.Seed says otherwise; kept in the state file): NH,
// UMAC's universal hash (RFC 4418), over the key's ten 32-bit halves each
// added to a word of the seed, then murmur3's fmix64 to spread the sum. For
// any two different keys the chance over the seed that they hash alike is
// at most 2^-32, so someone who does not know the seed cannot pick tuples
// that collide; it costs about 2 ns (xxhash of the 40 bytes, used before,
// about 25). TestHashSpread and TestHashCollisions check the spread of
// every part of the hash on structured keys. A slot is empty (0), a
// tombstone, or tag | direction | entry index+1. A flow's entry lives in
// the shard of its original key; its reply key is indexed in the shard its
// own hash picks. Entries do not keep their keys' hashes: removals and
// index rebuilds compute them again from the keys.
//
// # Caches in front of the table
//
// A worker keeps the flows it sees in a cache of its own (package
// dataplane). The table gives it what it needs (cache.go): Key and
// MakeKey/KeyV4 (the packed tuple), Hash (the table's hash, computed once
// for both), LookupKey (Lookup of a hashed key), Flow.Stamp and Revalidate.
// The stamp is the entry's sequence number when the lookup read it; the
// sequence changes with every insert into the entry and never wraps, so
// Revalidate (the timer word, then the sequence: two atomic loads on the
// entry's first cache line, the one Update reads anyway) tells whether the
// entry still holds that very flow, live and not expired, however often it
// was reused meanwhile; a cached translation can never outlive its flow.
// PrefetchSlot, PrefetchLookup and PrefetchFlow prefetch what a lookup or
// an update of the next packets will read, and PrefetchInsert the entry an
// insert will fill, for callers that work through a batch. LookupKey fills
// the caller's Flow in place.
//
// # Who writes what
//
// Inserts and removals (Insert, Sweep, Delete*, evictions) take the locks
// of the shards both keys of the flow hash to, in shard order; an eviction
// that needs a third shard only tries its lock. Lookups never lock. Under
// those locks a writer changes an entry's key words, meta and created, and
// the index slots. The timer word (state, status bits: seen reply, closer,
// assured; 16-bit generation; deadline in ms) is also changed lock-free by
// Update, always with compare-and-swap, and removal decides against Update
// by a compare-and-swap of the timer word it inspected to zero: whoever
// swaps first wins, so a flow refreshed at the moment the sweeper found it
// expired survives. The window words are changed lock-free by UpdateTCP
// with compare-and-swap; each carries the low 10 bits of the entry's
// generation, so a late UpdateTCP never writes into the next flow's words.
// Whoever swaps a timer word also moves the flow between the per-shard,
// per-state counts (atomics; transitions are a handful per flow).
//
// # Why readers never see a torn entry
//
// Each entry has a sequence counter: odd while an insert writes it, even
// otherwise, advanced by 2 per insert. A reader loads it, loads the key and
// the other fields, loads it again, and accepts the entry only if both
// loads are equal and even, the full key matches, the state is not free
// and the deadline is after now. The reader's accesses are atomic loads.
// The writer, which holds the shard locks, needs only that its stores are
// seen in the order it makes them: the odd sequence number, the entry's
// words, the even sequence number, the index slots. The odd sequence
// number is an atomic Store (a full barrier); the rest are storeRelease:
// atomic.Uint64.Store in race builds and off amd64 (an STLR on arm64), and
// a plain store on amd64, where the processor makes stores visible in
// program order and Store would be an XCHG, 13 more full barriers per
// insert. That the compiler keeps plain stores in order is how gc works,
// not a rule of the memory model (release_amd64.go says what it relies
// on); race builds, where the race detector checks this protocol, use
// atomic stores throughout.
// A reader that saw the same even value twice thus saw only values written
// before that value was stored. Inserts publish the index slots after the
// entry is complete, so a slot never leads to a half-written entry of its
// own flow.
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
// copy through an atomic pointer; readers still on the old copy find what
// it held and validate entries as always. Under a flood into a full table
// that happens often, so a rebuild allocates nothing after a shard's
// first: it writes into the array the previous rebuild replaced (the
// shard keeps it as its spare, which doubles the index's memory once the
// churn starts) and keeps the one it replaces. A reader may still be
// probing that reused array, so the shard's indexGen moves before the
// array is cleared, and a lookup that missed while it moved looks again
// (TestMissInReusedArrayIsNotSure).
//
// A lookup that races with the removal and re-insertion of the same key
// may miss it; the dataplane then treats the packet as the start of a flow,
// and Insert reports OrigExists.
//
// # Removal callback
//
// Config.OnRemove(orig, reply) is called once for every flow that leaves
// the table: expired (Sweep; an insert that needed the key or the entry of
// an expired flow; a flow found expired when New restores a state file),
// early-dropped, or deleted (Delete, DeleteIf, DeleteByBackend(s)). reply is
// the tuple reply packets arrive with, the key of the XDP program's reply
// map. It runs on the goroutine that removed the flow, after the removal,
// with no shard lock held: removals copy the keys while they hold the
// locks and call it once the locks are released. Calls from several
// workers may overlap, so it must be safe for concurrent use, and quick:
// it runs inside Insert and Sweep on the per-packet path. The table does
// not allocate to call it. A removal in progress when the process dies is
// not reported again by the next process; a dataplane that mirrors reply
// tuples must still reconcile its map now and then.
//
// # Expiry, a full table and assured flows
//
// Expired flows are never returned. Sweep removes them incrementally,
// inspecting the next entries from one atomic cursor that every caller
// shares. Workers call SweepDue, once per batch and when idle: it inspects
// the part of the slab that is due at that time, so that all the workers
// together pass over the whole table once per Config.SweepInterval
// (default 5 s) however many packets they handle, at most a given budget
// per call; a call with less than 64 entries due costs one atomic load,
// and an empty table is not scanned.
// (A fixed budget per batch, as before, read 256 entries, 32 KiB, for
// every 64 packets: a third of the cost of a new flow at a million flows.)
// An expired flow therefore leaves the table, and OnRemove is called, up
// to about SweepInterval after its deadline, unless an insert needs its key
// or its room first: an insert that needs a key held by an expired flow
// removes that flow first, and a full shard evicts expired flows first.
//
// A flow is assured when it has shown it is a real connection (see the
// next section); assured flows are never dropped to make room, like
// netfilter's IPS_ASSURED. When the shard a new flow belongs to is full,
// Insert inspects the next EvictionWindow entries of that shard (a
// rotating cursor) and reuses the first expired one; failing that, it drops
// the oldest (by creation) entry in the window that is not assured,
// whatever its state (netfilter's early_drop: a SYN flood, unanswered UDP,
// half-open or half-closed connections without a handshake); failing that,
// the insert fails with Full (DropConntrackFull). An unassured entry at
// least half as old as the shard's recent victims (a moving average) ends
// the inspection at once: under a flood the entries at the cursor are the
// ones it passed longest ago, and reading the whole window for every new
// flow cost more than the rest of the insert
// (dataplane.BenchmarkWorkerNewFlowFull). Capacity is per shard, so a
// table with many shards starts evicting a little before it is full: seen
// at 97.9% of a 1M-flow table with 64 shards. Everything is counted; see
// Stats: EvictedExpired, EvictedUnassured and, of those, EvictedUnreplied.
//
// # TCP, UDP and ICMP state
//
// The TCP machine follows netfilter's states and default timeouts
// (Timeouts, all configurable; DefaultTimeouts are netfilter's,
// KubeProxyTimeouts add kube-proxy's 24h ESTABLISHED and 1h CLOSE_WAIT).
// Update looks only at flags and direction; UpdateTCP also checks RST and
// FIN against the window (next section). A SYN in TIME_WAIT or CLOSE
// restarts the flow with the same translation and clears the status bits,
// assured included; netfilter instead destroys the flow and translates
// afresh, and the dataplane does that too (Closed, then Delete). A simultaneous open (SYN from the reply side) is not
// modelled. An ACK without SYN on a new flow makes it ESTABLISHED, as
// netfilter's tcp_loose does.
//
// A TCP flow becomes assured when it reaches ESTABLISHED with traffic seen
// both ways: the client's final ACK after the server's SYN-ACK, or, for a
// flow picked up mid-stream, the first packet from the other side that
// leaves it ESTABLISHED (not a FIN or RST). Until
// then an ESTABLISHED flow lives at most TCPUnacknowledged (300 s), as in
// netfilter. A flow that closes before it was established (FIN in
// SYN_RECV) is never assured.
//
// UDP follows nf_conntrack_proto_udp: UDPUnreplied lives UDPUnreplied
// (udp_timeout, 30 s); the first reply makes it UDPReplied, still with
// 30 s; once a reply has been seen, a packet (either way) that arrives more
// than 2 s after the flow was created makes it a stream: assured, timeout
// UDPReplied (udp_timeout_stream, 120 s). ICMP echo lives 30 s and other
// protocols 600 s; neither is ever assured.
//
// # TCP windows
//
// UpdateTCP keeps, per direction, a word with the highest sequence end the
// side sent (seq + payload, SYN and FIN count one), the largest window it
// advertised outside SYNs, and its window scale option. Scaling applies
// when both SYNs carried the option (RFC 7323). A side's SYN (the client's
// when the flow is, again, in SYN_SENT; the server's SYN-ACK in SYN_RECV
// if it acknowledges the client's SYN) sets its word afresh; a SYN that
// restarts a closed flow also forgets the server's side.
//
// A segment from side d to side r is in the window when:
//
//   - d's end is known: the segment [seq, seq+len] reaches
//     [end(d) - win(r), end(d) + win(r) + 16 KiB], where win(r) is the
//     largest window r advertised, scaled (65535 while r has sent only a
//     SYN or nothing). The 16 KiB allow for the stored end lagging the true
//     one (below). This is netfilter's tcp_in_window bounds simplified to
//     the largest window instead of the receiver's ACK + window.
//   - d has sent nothing yet, r has: the segment must carry an ACK no
//     further than r's end (+16 KiB) and no further behind it than
//     max(66000, win(d)) (netfilter's MAXACKWINCONST); except that an RST
//     without ACK is accepted once the flow is ESTABLISHED or later (a peer
//     that lost the connection resets with seq = the ACK it received) and
//     refused before (RFC 9293: an RST answering a SYN must acknowledge it).
//   - neither side is known (Update was used, or the flow was just
//     restored): every segment is.
//
// An RST or FIN that is not in the window is ignored: the state and the
// deadline stay, it is counted (Stats.OutOfWindowRST, OutOfWindowFIN), and
// UpdateTCP returns UpdateOutOfWindow so that the caller drops it
// (DropOutOfWindow). One RST outside the window is let through: one
// without ACK from the client before the flow is established, which
// answers a peer still holding an older connection of the same tuple (an
// early-dropped flow's SNAT port given out again) with seq = that peer's
// ACK, as RFC 9293 prescribes in SYN-SENT; it is what clears the peer's
// stale state. Other segments are never dropped; out-of-window ones are
// only not recorded, so a blind attacker can neither close a flow nor
// widen its window. A recorded segment moves its side's end forward only
// when it is more than 16 KiB past the stored end (or it is a SYN, FIN or
// RST), and the window only when it grows, so a bulk sender writes its word
// about once per 16 KiB (TestTCPWindowStoresAmortised); both words share the
// cache line of the reply key that Lookup reads anyway. Use UpdateTCP for
// every TCP packet of a table or for none: packets passed to Update are not
// seen by the window tracking, which then falls behind.
//
// # State file
//
// With Config.StatePath the slab is a file mapped MAP_SHARED (meant for a
// tmpfs with huge pages at /run/xdproxy: MountStateDir makes one; on 4 KiB
// pages an insert costs about twice as much, BenchmarkStateFilePages), so
// the entries outlive the process: a process that is killed, or that
// restarts to upgrade, leaves every flow to its successor. New takes an
// exclusive flock on the file (a second table on it gets ErrStateInUse),
// reserves its blocks with fallocate, so that a full tmpfs fails New
// rather than a later write, and maps every page at once
// (MADV_POPULATE_WRITE), so that no insert pays a page fault: all of the
// file's memory is committed from the start (and on a disk file system
// every block is dirtied, one more reason not to use one).
//
// The file is a 4096-byte header followed by the entries, exactly as in
// memory. The header holds, little-endian: magic "XDPCTST\0", layout
// version (u32), entry size (u32), header size (u32), shard count (u32),
// capacity (u64), the hash seed (u64), a hash of the layout description
// (entry words, timer, key and window bit layouts, hash and shard bits),
// the boot id, the creation time, and an xxhash checksum of all that. New
// adopts the file only if all of it matches this table (capacity and shard
// count are the ones Config yields) and the file has exactly the expected
// size; the seed comes from the file. Otherwise it starts empty, recreates
// the file, and says why in Table.Restored (RestoreInfo.Reason): no file,
// bad magic, corrupt header, other version or layout, other capacity,
// truncated, or written before a reboot (CLOCK_MONOTONIC restarts at
// boot). The caller should log that loudly: every flow is lost.
//
// Restoring rebuilds the indexes, free lists and counts from the slab,
// before any worker runs. An entry is adopted if its sequence is even and
// non-zero, its timer is live with the generation of that sequence, its
// keys are well formed, differ, sit in the right shard and are not already
// taken, and it has not expired at Config.Clock() (default MonotonicNow).
// Entries caught mid-write (odd sequence) are freed and counted as torn;
// expired ones are freed and reported to OnRemove; the rest as invalid. A
// deadline further away than this table's timeout for its state is brought
// back to now + that timeout. Window words keep the scale and largest
// windows, but each side's end is learnt again from its next packet. Not
// kept: the fragment table (entries live 30 s), the counters of Stats
// other than the flow counts, the sweep and eviction cursors. Entries are
// never synced to disk: on tmpfs the kernel's page cache is the storage,
// which survives the process but not the machine.
//
// Close unmaps the file and releases the lock; the file stays for the
// next process. RemoveState deletes it (xdproxy cleanup). Without a state
// file the slab is ordinary memory and Close does nothing.
//
// # Counters
//
// Stats reads atomics only: counters since New, Live, Assured and
// Unassured, flows per state (ByState), FillRatio, evictions by kind and
// out-of-window RST/FIN. Its flow counts include expired flows not yet
// swept. CountByState scans the slab without locks for the flows that have
// not expired; it is meant for an occasional scrape and stalls no worker.
//
// # SNAT ports
//
// InsertSNAT picks the source port from a PortRange by probing from a
// start derived from the flow's hash and lets Insert's uniqueness of the
// reply key decide, like netfilter's nf_nat_used_tuple: two flows can only
// share a port if their reply tuples differ (different backend, backend
// port or protocol). Restored flows keep their reply keys, so their ports
// are not handed out again.
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
// Every method that needs the time takes now, in nanoseconds; deadlines
// are kept in milliseconds of that clock, 41 bits of them, so now must
// stay below 2^41 ms (69 years of the clock) and must not go backwards.
// Tests pass it explicitly. A table with a state file must be given
// CLOCK_MONOTONIC (MonotonicNow, as cheap as time.Since): it is the same
// clock in every process until the machine reboots, so the deadlines a
// process wrote stay valid for the next one. A clock that starts at zero
// per process (time.Since of a process-local start) would make restored
// flows live far too long or die at once.
package conntrack
