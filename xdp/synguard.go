package xdp

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// SYNGuard is the SYN guard's setting. While On, the program drops the
// first SYN of every new (source, destination, ports) to a frontend and
// remembers it in a set-associative table; a retransmission of that SYN
// between MinRetry and Window after the SYN before it is let through. A flood overwrites
// entries at its rate, so a client whose entry was taken before it
// retransmitted starts again at its next retransmission. A real client's TCP retransmits its SYN after
// about a second and so connects one retransmission late; a flood of
// spoofed SYNs, each tuple sent once, is dropped in XDP and never reaches
// the workers or their connection table.
type SYNGuard struct {
	On       bool
	MinRetry time.Duration // a SYN sooner than this after the first is dropped
	Window   time.Duration // a SYN later than this counts as a first SYN again
}

// SetSYNGuard sets the SYN guard for every interface's program at once.
func (o *Objects) SetSYNGuard(g SYNGuard) error {
	if g.On && (g.MinRetry < 0 || g.Window <= g.MinRetry) {
		return fmt.Errorf("xdp: SYN guard window %v must be longer than its minimum retry %v", g.Window, g.MinRetry)
	}
	if g.On && g.Window >= synMaxWindow {
		return fmt.Errorf("xdp: SYN guard window %v must be shorter than %v (the table's clock wraps)", g.Window, synMaxWindow)
	}
	v := bpfSynGuard{
		MinRetry: synTicks(g.MinRetry),
		Window:   synTicks(g.Window),
		Seed:     rand.Uint32(),
		SetMask:  synSeenSets - 1,
	}
	if g.On {
		v.On = 1
	}
	if err := o.synGuard.Put(uint32(0), &v); err != nil {
		return fmt.Errorf("xdp: setting the SYN guard: %w", err)
	}
	return nil
}

// The SYN guard's clock ticks every 2^24 ns (about 16.8 ms) and its table
// keeps the time of a first SYN in 12 bits: ages wrap after 4096 ticks.
const (
	synTickShift = 24
	synMaxWindow = 4095 << synTickShift * time.Nanosecond
)

// synTicks converts d to the SYN guard's ticks, rounding up (a minimum
// retry is never shortened).
func synTicks(d time.Duration) uint32 {
	return uint32((d.Nanoseconds() + 1<<synTickShift - 1) >> synTickShift)
}
