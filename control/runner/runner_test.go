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
