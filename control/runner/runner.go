package runner

import (
	"context"
	"sync"
	"time"
)

// Runner calls a function at a bounded frequency.
type Runner struct {
	fn       func()
	min, max time.Duration
	clock    Clock
	requests chan struct{}
	wake     chan struct{} // a retry was asked for; room for one

	mu      sync.Mutex
	retryAt time.Time // zero: no retry asked for
}

// New returns a Runner that calls fn at most once per minInterval and at
// least once per maxInterval. clock nil means RealClock.
func New(fn func(), minInterval, maxInterval time.Duration, clock Clock) *Runner {
	if clock == nil {
		clock = RealClock{}
	}
	if maxInterval < minInterval {
		maxInterval = minInterval
	}
	return &Runner{
		fn:       fn,
		min:      minInterval,
		max:      maxInterval,
		clock:    clock,
		requests: make(chan struct{}, 1),
		wake:     make(chan struct{}, 1),
	}
}

// Run asks for a call of fn as soon as MinInterval allows. It never blocks;
// requests made while one is already waiting are folded into it.
func (r *Runner) Run() {
	select {
	case r.requests <- struct{}{}:
	default:
	}
}

// RetryAfter asks for a call of fn no later than d from now (and, as
// always, no sooner than MinInterval after the last one), as kube-proxy's
// BoundedFrequencyRunner.RetryAfter does. fn calls it when it failed and
// wants another go. Any call of fn satisfies the request, so fn must ask
// again each time it fails; of several requests the earliest counts. It
// never blocks and may be called from fn or from another goroutine.
func (r *Runner) RetryAfter(d time.Duration) {
	at := r.clock.Now().Add(d)
	r.mu.Lock()
	if r.retryAt.IsZero() || at.Before(r.retryAt) {
		r.retryAt = at
	}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *Runner) retryTime() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.retryAt
}

// Loop calls fn as requested until ctx is done. Only one Loop may run.
func (r *Runner) Loop(ctx context.Context) {
	s := schedule{min: r.min, max: r.max, since: r.clock.Now()}
	timer := r.clock.NewTimer(r.max)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.requests:
			s.pending = true
		case <-r.wake:
		case <-timer.C():
		}
		now := r.clock.Now()
		s.retryAt = r.retryTime()
		wait := s.wait(now)
		if wait <= 0 {
			s.ran(now)
			r.mu.Lock()
			r.retryAt = time.Time{} // this call is the retry; fn asks again if it fails
			r.mu.Unlock()
			r.fn()
			s.retryAt = r.retryTime()
			wait = s.wait(r.clock.Now())
		}
		timer.Reset(wait)
	}
}

// schedule decides when the next call is due. It is a plain value so the
// rules can be tested without goroutines.
type schedule struct {
	min, max time.Duration
	pending  bool      // a Run is waiting
	hasRun   bool      // fn has been called
	since    time.Time // start of the last call (or of the loop)
	retryAt  time.Time // a retry asked for; zero: none
}

// wait returns how long from now until fn is due; <= 0 means now.
func (s *schedule) wait(now time.Time) time.Duration {
	due := s.since.Add(s.max)
	if s.pending {
		if !s.hasRun {
			return 0
		}
		due = s.since.Add(s.min)
	}
	if !s.retryAt.IsZero() && s.retryAt.Before(due) {
		due = s.retryAt
		if earliest := s.since.Add(s.min); s.hasRun && due.Before(earliest) {
			due = earliest
		}
	}
	return due.Sub(now)
}

// ran records a call of fn starting at now.
func (s *schedule) ran(now time.Time) {
	s.pending = false
	s.hasRun = true
	s.since = now
	s.retryAt = time.Time{}
}
