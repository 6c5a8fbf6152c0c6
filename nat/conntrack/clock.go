package conntrack

import (
	"time"

	"golang.org/x/sys/unix"
)

// The runtime's monotonic clock is CLOCK_MONOTONIC on Linux; these pin
// its offset once so that MonotonicNow costs what time.Since costs (a
// vDSO read), not a system call.
var (
	monoStart = time.Now()
	monoBase  = func() int64 {
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			panic("conntrack: clock_gettime(CLOCK_MONOTONIC): " + err.Error())
		}
		return ts.Nano()
	}()
)

// MonotonicNow returns CLOCK_MONOTONIC in nanoseconds: the time since boot,
// the same in every process. It is the clock to pass as now to a table
// with a state file, so that deadlines written by one process mean the
// same to the next.
func MonotonicNow() int64 { return monoBase + int64(time.Since(monoStart)) }
