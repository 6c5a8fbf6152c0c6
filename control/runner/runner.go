package runner

import (
	"context"
	"time"
)

// Runner calls a function at a bounded frequency.
type Runner struct {
	fn       func()
	min, max time.Duration
	clock    Clock
	requests chan struct{}
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
		case <-timer.C():
		}
		now := r.clock.Now()
		wait := s.wait(now)
		if wait <= 0 {
			s.ran(now)
			r.fn()
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
}

// wait returns how long from now until fn is due; <= 0 means now.
func (s *schedule) wait(now time.Time) time.Duration {
	if s.pending {
		if !s.hasRun {
			return 0
		}
		return s.since.Add(s.min).Sub(now)
	}
	return s.since.Add(s.max).Sub(now)
}

// ran records a call of fn starting at now.
func (s *schedule) ran(now time.Time) {
	s.pending = false
	s.hasRun = true
	s.since = now
}
