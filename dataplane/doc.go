// Package dataplane is xdproxy's packet path in user space: the Processor
// that translates one frame, the Worker loop that feeds it from an AF_XDP
// socket, and the Engine that attaches the XDP programs, opens the sockets
// and runs one pinned worker per queue of every served interface.
//
// The engine reaches the kernel only through the Kernel interface
// (kernel.go): NewKernel is the real one, and the tests drive the same
// engine and workers on an in-memory fake with injectable faults.
//
// Ownership and the exception path. The XDP program hands a worker only
// frames xdproxy owns, but ownership can end between the program's lookup
// and the worker's (a table swap, an expired flow, a fragment whose head
// was never seen). Such a frame is not dropped: the worker hands it,
// unchanged but for its destination MAC, to the kernel's stack through the
// exception link, a veth pair xdproxy creates (EngineConfig.
// ExceptionInterface), and counts it under its pass_* reason. The same
// path delivers translated frames whose destination sits behind an
// interface xdproxy does not serve (a local pod's veth): the kernel is the
// last hop.
//
// Interfaces are followed, not fixed: every receive queue is served unless
// the config lists queues, a queue added by ethtool -L gets a socket and a
// worker, an interface deleted and created again is attached again, and
// Healthy says when a configured interface is not fully served. Linux
// refuses to remove a queue that has an AF_XDP socket; SetChannels lets go
// of such queues before it asks.
//
// Threading rules:
//   - A Processor belongs to one Worker. It reads the service table the
//     worker loaded for the batch (BeginBatch), and shares only
//     concurrency-safe tables with other workers: conntrack, session
//     affinity and the immutable service table.
//   - A Port's receive ring belongs to its worker. Its free-frame stack,
//     fill, TX and completion rings are shared with every worker that
//     forwards into that interface, under the port's mutex, taken once per
//     batch and egress port.
//   - The set of ports is an immutable snapshot the engine publishes with
//     one atomic store when interfaces change; a worker loads it once per
//     batch. A port being closed is marked under its mutex first, so a
//     worker still holding the old snapshot drops instead of transmitting.
//   - Process never allocates, locks or makes a system call; the worker
//     makes at most one transmit kick per batch and egress port (only when
//     the TX ring's need-wakeup flag asks for it, which copy mode always
//     does), one flow-table write per batch that opened connections, and
//     no system call at all for a batch of established flows otherwise.
//
// The per-packet path (fastpath.go, flowcache.go, hopcache.go). A batch is
// worked through twice: the first pass reads each frame's tuple from its
// headers, hashes it once (conntrack's keyed hash) and prefetches the memory
// the second pass will need, in short loops over the batch so that the
// batch's cache misses overlap; for a frame that opens a flow it makes the
// backend choice ahead and prefetches what the insert will touch. The second
// translates. The next hop of each forwarded frame comes from a per-worker
// cache of the route cache's answers, valid while the route cache's
// generation is unchanged. Results travel in registers or in place, never as
// structs copied just after they were written (on amd64 such a copy waits
// for a failed store-to-load forward; see Verdict). Each worker keeps a flow
// cache of 4096 flows (4-way, pointer-free) in front of the shared conntrack
// table, every hit checked against the table (conntrack.Table.Revalidate:
// the entry still holds the same lifetime of the flow and it has not
// expired), so a deleted, expired or replaced flow is never used. An
// established IPv4 TCP or UDP packet without options or fragmentation (from
// the cache, or from conntrack through it) is rewritten without a full
// parse, with the checksum changes worked out once per flow; everything else
// takes the general path (packet.Parse and package nat). Reply tuples are
// published only for new flows, once per batch, into memory the XDP
// program reads (xdp.FlowWriter: no system call unless a set is full).
//
// Idle and busy polling (idle.go). With an empty ring a worker spins for
// an adaptive while (re-checking the ring with a CPU relax in between),
// then sleeps in poll(): the spin grows while frames keep arriving soon
// after the ring went empty and shrinks on a quiet queue, so a loaded
// queue is served without wake-ups and an idle worker costs about 0.01%
// of a CPU. WorkerConfig.BusyPoll (the configuration's busyPoll) spins
// while its queue has traffic and sleeps only after IdleWait without a
// frame, so that quiet queues leave the CPU to busy ones. A socket opened with afxdp.Config.BusyPoll is busy polled:
// the spin drives the queue's NAPI with recvfrom (Socket.Drive). See
// xdp/afxdp's documentation for the per-device settings that needs.
//
// I/O floor (iofloor.go). EngineConfig.IOFloor is a benchmarking mode:
// workers forward every frame between the interfaces untranslated, only
// its MACs rewritten, to measure the sockets and the loop alone.
package dataplane
