package runner

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestSchedule(t *testing.T) {
	const min, max = time.Second, 10 * time.Second
	testCases := []struct {
		name     string
		s        schedule
		now      time.Time
		wantWait time.Duration
	}{
		{"first request runs at once", schedule{pending: true, since: t0}, t0, 0},
		{"idle before the first run waits max from loop start", schedule{since: t0}, t0.Add(3 * time.Second), 7 * time.Second},
		{"request within min waits for the rest of min", schedule{pending: true, hasRun: true, since: t0}, t0.Add(300 * time.Millisecond), 700 * time.Millisecond},
		{"request after min runs at once", schedule{pending: true, hasRun: true, since: t0}, t0.Add(min), 0},
		{"idle after a run waits until max", schedule{hasRun: true, since: t0}, t0.Add(4 * time.Second), 6 * time.Second},
		{"idle past max runs", schedule{hasRun: true, since: t0}, t0.Add(max + time.Millisecond), -time.Millisecond},
		{"retry before max comes first", schedule{hasRun: true, since: t0, retryAt: t0.Add(4 * time.Second)}, t0.Add(time.Second), 3 * time.Second},
		{"retry after max waits for max", schedule{hasRun: true, since: t0, retryAt: t0.Add(20 * time.Second)}, t0.Add(time.Second), 9 * time.Second},
		{"retry within min waits for min", schedule{hasRun: true, since: t0, retryAt: t0.Add(100 * time.Millisecond)}, t0, min},
		{"retry and request: min rules", schedule{pending: true, hasRun: true, since: t0, retryAt: t0.Add(5 * time.Second)}, t0, min},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.s
			s.min, s.max = min, max
			if got := s.wait(tc.now); got != tc.wantWait {
				t.Errorf("wait = %v, want %v", got, tc.wantWait)
			}
		})
	}
}

// loopHarness runs a Runner on a FakeClock and counts calls.
type loopHarness struct {
	t     *testing.T
	clock *FakeClock
	r     *Runner
	calls atomic.Int32
	ran   chan time.Time
}

func startLoop(t *testing.T, min, max time.Duration) *loopHarness {
	h := &loopHarness{t: t, clock: NewFakeClock(t0), ran: make(chan time.Time, 100)}
	h.r = New(func() {
		h.calls.Add(1)
		h.ran <- h.clock.Now()
	}, min, max, h.clock)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.r.Loop(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// expectRun waits for one call and checks the fake time it ran at.
func (h *loopHarness) expectRun(at time.Time) {
	h.t.Helper()
	select {
	case got := <-h.ran:
		if !got.Equal(at) {
			h.t.Fatalf("ran at %v, want %v", got.Sub(t0), at.Sub(t0))
		}
	case <-time.After(5 * time.Second):
		h.t.Fatalf("no run; want one at %v", at.Sub(t0))
	}
}

// waitArmed waits until the loop has armed its timer for deadline: from
// then on it is blocked and can only act on a request or a Step.
func (h *loopHarness) waitArmed(deadline time.Time) {
	h.t.Helper()
	stop := time.Now().Add(5 * time.Second)
	for !slices.ContainsFunc(h.clock.Deadlines(), deadline.Equal) {
		if time.Now().After(stop) {
			h.t.Fatalf("timer not armed for %v; armed: %v", deadline.Sub(t0), h.clock.Deadlines())
		}
		time.Sleep(time.Millisecond)
	}
}

func (h *loopHarness) expectNoRun() {
	h.t.Helper()
	select {
	case got := <-h.ran:
		h.t.Fatalf("unexpected run at %v", got.Sub(t0))
	default:
	}
}

func TestLoopBoundsFrequency(t *testing.T) {
	const min, max = time.Second, 10 * time.Second
	h := startLoop(t, min, max)
	h.waitArmed(t0.Add(max))

	h.r.Run()
	h.expectRun(t0)
	h.waitArmed(t0.Add(max))

	// A burst within min coalesces into one run at t0+min.
	h.clock.Step(200 * time.Millisecond)
	for range 5 {
		h.r.Run()
	}
	h.waitArmed(t0.Add(min))
	h.clock.Step(700 * time.Millisecond)
	h.waitArmed(t0.Add(min)) // still waiting: 900ms after the last run
	h.expectNoRun()
	h.clock.Step(100 * time.Millisecond)
	h.expectRun(t0.Add(min))
	h.waitArmed(t0.Add(min + max))
	h.expectNoRun()

	// Nobody asks: a run happens max after the last one.
	h.clock.Step(max - time.Millisecond)
	h.waitArmed(t0.Add(min + max))
	h.expectNoRun()
	h.clock.Step(time.Millisecond)
	h.expectRun(t0.Add(min + max))

	// A request long after the last run runs at once.
	h.waitArmed(t0.Add(min + 2*max))
	h.clock.Step(5 * time.Second)
	h.r.Run()
	h.expectRun(t0.Add(min + max + 5*time.Second))
	if n := h.calls.Load(); n != 4 {
		t.Fatalf("%d calls, want 4", n)
	}
}

func TestLoopStopsWithContext(t *testing.T) {
	clock := NewFakeClock(t0)
	r := New(func() { t.Error("ran after cancel") }, time.Second, time.Minute, clock)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan struct{})
	go func() { r.Loop(ctx); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Loop did not return")
	}
}

func TestLoopRetryAfter(t *testing.T) {
	const min, max = time.Second, time.Minute
	h := startLoop(t, min, max)
	h.waitArmed(t0.Add(max))
	h.r.Run()
	h.expectRun(t0)
	h.waitArmed(t0.Add(max))

	// fn failed and asks for a retry in 4s: it runs then, not at max.
	h.r.RetryAfter(4 * time.Second)
	h.waitArmed(t0.Add(4 * time.Second))
	h.clock.Step(4 * time.Second)
	h.expectRun(t0.Add(4 * time.Second))
	// The run used up the request: next is max after it.
	h.waitArmed(t0.Add(4*time.Second + max))

	// A retry sooner than min is held back to min; a later request for
	// a sooner retry wins over an earlier, later one.
	h.r.RetryAfter(30 * time.Second)
	h.waitArmed(t0.Add(34 * time.Second))
	h.r.RetryAfter(100 * time.Millisecond)
	h.waitArmed(t0.Add(5 * time.Second))
	h.clock.Step(time.Second)
	h.expectRun(t0.Add(5 * time.Second))
	h.waitArmed(t0.Add(5*time.Second + max))
	h.expectNoRun()
}

func TestRetryBackoffAndLogging(t *testing.T) {
	r := NewRetry(0, 0, 0)
	if w := r.Wait(t0); w > 0 {
		t.Fatalf("wait %v before any failure", w)
	}
	now := t0
	var delays []time.Duration
	var logged []int
	for i := 1; i <= 12; i++ {
		d, log := r.Failed(now)
		if w := r.Wait(now); w != d {
			t.Fatalf("failure %d: Wait %v, delay %v", i, w, d)
		}
		delays = append(delays, d)
		if log {
			logged = append(logged, i)
		}
		now = now.Add(d)
		if w := r.Wait(now); w != 0 {
			t.Fatalf("failure %d: Wait %v at the due time", i, w)
		}
	}
	s := time.Second
	if want := []time.Duration{s, 2 * s, 4 * s, 8 * s, 16 * s, 30 * s, 30 * s, 30 * s, 30 * s, 30 * s, 30 * s, 30 * s}; !slices.Equal(delays, want) {
		t.Fatalf("delays %v, want %v", delays, want)
	}
	// Failures at 0, 1, 3, 7, 15, 31, 61, 91, ... seconds: logged the first
	// time, then once 30s have passed since the last logged one.
	if want := []int{1, 6, 7, 8, 9, 10, 11, 12}; !slices.Equal(logged, want) {
		t.Fatalf("logged failures %v, want %v", logged, want)
	}
	if n := r.Failures(); n != 12 {
		t.Fatalf("Failures %d", n)
	}
	if n := r.Succeeded(); n != 12 {
		t.Fatalf("Succeeded reported %d failures, want 12", n)
	}
	if w := r.Wait(now); w > 0 || r.Failures() != 0 {
		t.Fatalf("after success: wait %v, failures %d", w, r.Failures())
	}
	// A success starts over: the next failure waits 1s and is logged.
	if d, log := r.Failed(now.Add(time.Second)); d != s || !log {
		t.Fatalf("first failure after success: delay %v, logged %v", d, log)
	}
	if n := NewRetry(0, 0, 0).Succeeded(); n != 0 {
		t.Fatalf("success without failures reported %d", n)
	}
}
