package runner

import (
	"math"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// Defaults for a Retry: the delay starts at one second and doubles to at
// most 30 seconds; a failure that goes on is logged at most every 30
// seconds.
const (
	DefaultRetryInitial  = time.Second
	DefaultRetryMax      = 30 * time.Second
	DefaultRetryLogEvery = 30 * time.Second
)

// Retry paces the retries of an operation that keeps failing, such as
// publishing a Model: after each failure the next try waits longer
// (exponential backoff from initial, doubling, capped at max), and a
// success starts over. It also says which failures deserve a log line:
// the first, then at most one per logEvery, so that a failure that lasts
// does not flood the log.
//
// A Retry is not safe for concurrent use; the goroutine that runs the
// operation owns it.
type Retry struct {
	base     wait.Backoff
	backoff  wait.Backoff
	logEvery time.Duration

	failures int
	due      time.Time // when the next try is due
	lastLog  time.Time
}

// NewRetry returns a Retry; zero arguments take the defaults.
func NewRetry(initial, max, logEvery time.Duration) *Retry {
	if initial <= 0 {
		initial = DefaultRetryInitial
	}
	if max <= 0 {
		max = DefaultRetryMax
	}
	if max < initial {
		max = initial
	}
	if logEvery <= 0 {
		logEvery = DefaultRetryLogEvery
	}
	b := wait.Backoff{Duration: initial, Factor: 2, Cap: max, Steps: math.MaxInt32}
	return &Retry{base: b, backoff: b, logEvery: logEvery}
}

// Failed records a failure at now. It returns how long to wait before the
// next try and whether this failure should be logged.
func (r *Retry) Failed(now time.Time) (delay time.Duration, log bool) {
	r.failures++
	delay = r.backoff.Step()
	r.due = now.Add(delay)
	if r.failures == 1 || now.Sub(r.lastLog) >= r.logEvery {
		r.lastLog = now
		log = true
	}
	return delay, log
}

// Succeeded records a success and returns how many failures came before
// it since the last success (zero: nothing to report).
func (r *Retry) Succeeded() int {
	n := r.failures
	r.failures = 0
	r.due = time.Time{}
	r.backoff = r.base
	return n
}

// Failures is the number of failures since the last success.
func (r *Retry) Failures() int { return r.failures }

// Wait returns how long from now until the next try is due: > 0 while
// backing off after a failure, <= 0 when a try may run now (including
// when nothing failed).
func (r *Retry) Wait(now time.Time) time.Duration {
	if r.failures == 0 {
		return 0
	}
	return r.due.Sub(now)
}
