package dataplane

import "time"

// Idle strategy. When its receive ring is empty a worker spins for a
// while, re-checking the ring (Socket.Drive, with a CPU relax between
// checks), and only then sleeps in poll(). Sleeping costs a wake-up when
// frames come (a system call, a context switch, and the kernel waking the
// thread from the softirq that queued the frames: several microseconds on
// both CPUs, and the latency of the wake-up), spinning costs the CPU for
// as long as it spins. How long to spin adapts to the queue:
//
//   - frames that arrive while the worker spins, or soon after it went to
//     sleep (within the longest spin), show that the queue is busy: the
//     spin grows to twice the gap that was seen (at once when the worker
//     had to wake up, by at most that when it caught them spinning), so
//     that a loaded queue is served without wake-ups;
//   - a sleep that ends without frames, or with frames that came after
//     longer than the longest spin, shows a quiet queue: the spin halves,
//     down to the shortest, so that an idle worker costs next to nothing
//     (a turn every IdleWait: a few microseconds per 200 ms).
//
// WorkerConfig.BusyPoll workers spin as long as their queue has traffic
// and sleep only after IdleWait without a frame.

const (
	// spinMin is the shortest spin: about what going to sleep and
	// waking up would cost anyway.
	spinMin = int64(2 * time.Microsecond)
	// defaultSpinMax is the longest spin unless WorkerConfig.MaxSpin
	// says otherwise.
	defaultSpinMax = int64(50 * time.Microsecond)
)

// idleSpin is the adaptive spin limit of one worker, in nanoseconds.
type idleSpin struct {
	limit, max int64
}

func newIdleSpin(max time.Duration) idleSpin {
	m := int64(max)
	switch {
	case m == 0:
		m = defaultSpinMax
	case m < 0:
		m = 0
	}
	return idleSpin{limit: min(spinMin, m), max: m}
}

// caught records frames that arrived gap ns after the ring went empty,
// while the worker spun: the limit stays at least twice the gap, and
// otherwise eases down by 1/16, so that it follows the queue's gaps.
func (s *idleSpin) caught(gap int64) {
	s.limit = min(s.max, max(s.limit-s.limit/16, 2*gap, min(spinMin, s.max)))
}

// woke records a sleep in poll() that ended with frames gap ns after the
// ring went empty: a short gap means spinning a little longer would have
// saved the wake-up.
func (s *idleSpin) woke(gap int64) {
	if gap > s.max {
		s.quiet()
		return
	}
	s.limit = min(s.max, max(2*s.limit, 2*gap))
}

// quiet records a sleep that ended without frames.
func (s *idleSpin) quiet() {
	s.limit = max(s.limit/2, min(spinMin, s.max))
}
