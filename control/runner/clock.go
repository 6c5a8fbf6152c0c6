package runner

import (
	"sync"
	"time"
)

// Clock is the source of time and timers.
type Clock interface {
	Now() time.Time
	NewTimer(d time.Duration) Timer
}

// Timer is the part of *time.Timer the runner uses. As with time.Timer
// since Go 1.23, Reset and Stop discard a value not yet received.
type Timer interface {
	C() <-chan time.Time
	Stop() bool
	Reset(d time.Duration) bool
}

// RealClock is the wall clock.
type RealClock struct{}

// Now returns time.Now().
func (RealClock) Now() time.Time { return time.Now() }

// NewTimer returns a time.Timer.
func (RealClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.Timer.C }

// FakeClock is a Clock that moves only when Step is called. It is safe for
// concurrent use.
type FakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

// NewFakeClock returns a FakeClock reading now.
func NewFakeClock(now time.Time) *FakeClock { return &FakeClock{now: now} }

// Now returns the fake time.
func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Step moves the clock forward by d and fires the timers that are due.
func (c *FakeClock) Step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	for _, t := range c.timers {
		t.fireIfDue(c.now)
	}
}

// Deadlines returns when the armed timers fire, so that a test can wait
// until the code under test has armed the timer it expects.
func (c *FakeClock) Deadlines() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Time
	for _, t := range c.timers {
		if t.armed {
			out = append(out, t.deadline)
		}
	}
	return out
}

// NewTimer returns a timer that fires when the clock reaches Now()+d.
func (c *FakeClock) NewTimer(d time.Duration) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, ch: make(chan time.Time, 1)}
	c.timers = append(c.timers, t)
	t.arm(c.now, d)
	return t
}

type fakeTimer struct {
	clock    *FakeClock
	ch       chan time.Time
	deadline time.Time
	armed    bool
}

// arm and fireIfDue run with clock.mu held.
func (t *fakeTimer) arm(now time.Time, d time.Duration) {
	t.deadline = now.Add(d)
	t.armed = true
	t.fireIfDue(now)
}

func (t *fakeTimer) fireIfDue(now time.Time) {
	if t.armed && !now.Before(t.deadline) {
		t.armed = false
		select {
		case t.ch <- now:
		default:
		}
	}
}

func (t *fakeTimer) drain() {
	select {
	case <-t.ch:
	default:
	}
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Stop() bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	was := t.armed
	t.armed = false
	t.drain()
	return was
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	was := t.armed
	t.drain()
	t.arm(t.clock.now, d)
	return was
}
