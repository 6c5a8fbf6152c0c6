// Package afxdp wraps AF_XDP sockets for xdproxy's workers.
//
// An AF_XDP socket shares a UMEM (an array of equal-sized frames in user
// memory) and four single-producer single-consumer rings with the kernel:
//
//	fill ring        user -> kernel   free frames the kernel may receive into
//	RX ring          kernel -> user   frames that arrived (address + length)
//	TX ring          user -> kernel   frames to send
//	completion ring  kernel -> user   frames the kernel has finished sending
//
// Every frame is in exactly one place at a time: the socket's free stack,
// one of the rings (or the kernel behind them), or the caller's hands after
// Receive or Alloc until it passes the frame to Transmit or Release. A
// worker loop is:
//
//	s.Refill()                 // keep the fill ring full
//	n := s.Receive(descs)      // take received frames
//	... rewrite s.Frame(d) ...
//	s.Transmit(out)            // send; Release what is dropped
//	s.Complete()               // recycle sent frames
//	if n == 0 && !s.Drive() { s.Wait(timeout) }
//
// Ring indexes are read and written with sync/atomic (the kernel updates
// them from other CPUs), once per batch: each side caches the other side's
// index and rereads it only when the cache says the ring is full or empty.
// Free frames are a stack, so taking or returning one is O(1). Receive,
// Refill, Transmit, Complete, Alloc, Release and Drive never allocate.
//
// # System calls: need-wakeup and busy polling
//
// A socket makes a system call only when the kernel asks for one. With
// Config.NeedWakeup (the default) the kernel says so through a flag on the
// fill and TX rings: Transmit calls sendto only while the TX ring's flag
// is set, and Refill and Drive call recvfrom only while the fill ring's
// flag is set. In copy mode (veth, and any driver without zero-copy) the
// kernel sets the TX flag at bind and keeps it set, because it transmits
// inside sendto, so every Transmit with frames kicks; it never sets the fill
// ring's flag. A zero-copy driver sets either flag only when its NAPI
// context stopped for want of work. Stats counts the calls (TxKicks,
// RxWakeups).
//
// Config.BusyPoll turns on preferred busy polling (Linux 5.11 or later):
// SO_PREFER_BUSY_POLL, SO_BUSY_POLL (the time one poll may spin, in
// microseconds) and SO_BUSY_POLL_BUDGET (frames per poll) on the socket.
// The application then drives the queue from its own thread: Drive calls
// recvfrom(MSG_DONTWAIT) whenever the RX ring is empty, which runs the
// queue's NAPI poll on the calling CPU, and Transmit always calls sendto.
// For the device's interrupts to stay off while the application polls,
// the administrator sets two per-device values (Documentation/networking
// /napi.rst, "Preferred busy polling"):
//
//	echo 2      > /sys/class/net/<if>/napi_defer_hard_irqs
//	echo 200000 > /sys/class/net/<if>/gro_flush_timeout   # ns: the fallback
//
// gro_flush_timeout must be longer than the longest gap between two polls,
// or the interrupts come back. xdproxy never sets them itself: they are
// the device's, shared by every user of it. Do not set them on a veth: a
// veth in copy mode gives the socket no NAPI id (Stats.NAPIID stays 0), so
// there is nothing to busy-poll, and the deferral then throttles the veth
// to one ring of frames per timeout (measured: 25 kpps with 10 ms). On
// veth the options are accepted and inert.
//
// Threading rule: a Socket is used by one goroutine at a time; its methods
// take no locks. There is no separate RX and TX owner: Refill, Release,
// Alloc and Complete all work on the one free stack, so a goroutine that
// transmits on a socket another goroutine receives on (for example
// forwarding into another interface's socket) must serialize with it, and
// callers that share a socket's TX side serialize among themselves.
//
// Each socket has its own UMEM, so a frame received on one socket is sent on
// another by copying it into a frame from the other socket's Alloc.
//
// Lifetimes: slices returned by Frame alias the UMEM and are valid only while
// the caller owns the frame, and never after Close. Open neither loads nor
// attaches an XDP program; the caller registers FD() in its XSKMAP.
//
// The socket is set up here with golang.org/x/sys/unix rather than with
// github.com/asavie/xdp's NewSocket: asavie's Close unmaps the UMEM but not
// the rings, a ring mapping keeps the socket alive, and so the queue stays
// bound and every later bind in the process fails with EBUSY
// (TestAsavieCloseLeavesQueueBound); a failed NewSocket leaks the same way,
// which rules out retrying it. Its bind flags are also one package variable
// for all sockets, and its Transmit panics on unexpected sendto errors.
// asavie remains the baseline in this package's benchmarks
// (BenchmarkReceive, BenchmarkDrain).
package afxdp
