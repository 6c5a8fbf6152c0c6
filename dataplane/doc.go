// Package dataplane is xdproxy's packet path in user space: the Processor
// that translates one frame, the Worker loop that feeds it from an AF_XDP
// socket, and the Engine that attaches the XDP programs, opens the sockets
// and runs one pinned worker per configured queue.
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
//   - Process never allocates, locks or makes a system call; the worker
//     makes one transmit kick per batch and egress port, and sleeps in
//     poll() when its ring is empty (unless busy polling is configured).
//
// The Engine must be started from a thread in the network namespace of
// the interfaces it attaches to.
package dataplane
