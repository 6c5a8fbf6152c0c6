package dataplane

import (
	"time"

	"github.com/xdproxy/xdproxy/xdp"
)

// SYNGuardConfig tunes the SYN guard: while a flood of new TCP connections
// overruns the connection table (new TCP flows early-dropping others or
// refused for room: conntrack's TCPOverruns), the XDP program drops every
// tuple's first SYN and lets in only its retransmission (see
// xdp.SYNGuard). Spoofed floods send each tuple once and so never reach
// the workers; a real client connects a retransmission (about a second)
// late. New flows of other protocols that fill the table (a node's DNS
// churn, a UDP flood) do not turn it on: it could not stop them, and every
// TCP client would pay the second. Zero fields take the defaults.
type SYNGuardConfig struct {
	// Disabled leaves the guard off whatever happens.
	Disabled bool
	// Trigger is the number of new TCP flows that early-dropped a flow or
	// were refused for room in one Interval at which the guard turns on
	// (an insert of another protocol never counts); default the larger of 16
	// and 1/256 of the table's capacity (per 100 ms: the larger of 160
	// and 1/25 of the table per second).
	Trigger uint64
	// Calm is how long the guard stays on after it last saw a flood: first
	// SYNs dropped at the Trigger rate or more. Default 30 s.
	Calm time.Duration
	// Interval is how often the counters are read while the table is
	// under pressure (an insert found it full in the last Calm) or the
	// guard is on. Default 100 ms: every interval before the guard is on
	// lets a line-rate flood's SYNs reach the workers and the backends (a
	// second let about 100,000 in, whose half-open connections at the
	// backends outlived the flood's flows here and reset legitimate
	// connections that reused their ports). Otherwise the guard sleeps
	// until conntrack reports a full table (tableOverrun), so an idle node
	// pays nothing for it.
	Interval time.Duration
}

// tableOverrun is conntrack's OnOverrun: it wakes the SYN guard. It runs
// on a worker with a shard lock held, so it only tries to send.
func (e *Engine) tableOverrun() {
	select {
	case e.overrun <- struct{}{}:
	default:
	}
}

// The retransmission window the guard accepts: Linux, Windows and macOS
// retransmit a SYN after 1 s (3 s on older stacks) and again after a few
// more seconds.
const (
	synGuardMinRetry = 200 * time.Millisecond
	synGuardWindow   = 10 * time.Second
)

// SYNGuardOn reports whether the SYN guard is on now.
func (e *Engine) SYNGuardOn() bool { return e.synGuardOn.Load() }

// guardSYNs turns the SYN guard on while the connection table is overrun
// and off once it has been calm for SYNGuardConfig.Calm.
func (e *Engine) guardSYNs() {
	cfg := e.cfg.SYNGuard
	if cfg.Interval <= 0 {
		cfg.Interval = 100 * time.Millisecond
	}
	if cfg.Calm <= 0 {
		cfg.Calm = 30 * time.Second
	}
	if cfg.Trigger == 0 {
		cfg.Trigger = max(16, e.ct.Stats().Capacity/256)
	}
	// A pinned table may still hold the guard of an earlier process.
	if err := e.tables.SetSYNGuard(xdp.SYNGuard{}); err != nil {
		e.log.Error("turning the SYN guard off", "err", err)
	}
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	var lastOverrun, lastGuarded uint64
	overrun := func() uint64 { return e.ct.Stats().TCPOverruns }
	guarded := func() uint64 {
		c, err := e.tables.Counters()
		if err != nil {
			return lastGuarded
		}
		return c.SYNGuardDropped
	}
	lastOverrun, lastGuarded = overrun(), guarded()
	var lastFlood, lastPressure time.Time
	for {
		// Idle (no full table for Calm, guard off): sleep until conntrack
		// reports a full table, then watch every Interval.
		if !e.synGuardOn.Load() && time.Since(lastPressure) >= cfg.Calm {
			t.Stop() // no wake-ups while idle
			select {
			case <-e.overrun: // a signal from before the last reading
			default:
			}
			select {
			case <-e.stop:
				return
			case <-e.overrun:
			}
			// The next reading counts from the last one before the
			// sleep: any overrun since would have woken it, so that
			// is this one's, and the flood that sent it counts.
			lastPressure = time.Now()
			t.Reset(cfg.Interval)
			continue
		}
		select {
		case <-e.stop:
			return
		case now := <-t.C:
			o, g := overrun(), guarded()
			dOverrun, dGuarded := o-lastOverrun, g-lastGuarded
			lastOverrun, lastGuarded = o, g
			if dOverrun > 0 {
				lastPressure = now
			}
			on := e.synGuardOn.Load()
			switch {
			case !on && dOverrun >= cfg.Trigger:
				if err := e.tables.SetSYNGuard(xdp.SYNGuard{On: true, MinRetry: synGuardMinRetry, Window: synGuardWindow}); err != nil {
					e.log.Error("turning the SYN guard on", "err", err)
					continue
				}
				e.synGuardOn.Store(true)
				lastFlood = now
				e.log.Warn("SYN guard on: the connection table is overrun by new TCP connections; first SYNs are dropped until retransmitted",
					"tcpInsertsOverrun", dOverrun, "interval", cfg.Interval)
			case on && dGuarded >= cfg.Trigger:
				lastFlood = now
			case on && now.Sub(lastFlood) >= cfg.Calm:
				if err := e.tables.SetSYNGuard(xdp.SYNGuard{}); err != nil {
					e.log.Error("turning the SYN guard off", "err", err)
					continue
				}
				e.synGuardOn.Store(false)
				e.log.Info("SYN guard off: no flood for a while", "calm", cfg.Calm)
			}
		}
	}
}
