package afxdp

import (
	"errors"
	"fmt"
	"time"
)

// BindMode chooses how the kernel moves frames between the driver and the
// UMEM.
type BindMode int

const (
	// Auto lets the kernel use zero-copy where the driver supports it and
	// fall back to copy mode otherwise (veth always copies).
	Auto BindMode = iota
	// Copy forces copy mode (XDP_COPY).
	Copy
	// ZeroCopy demands zero-copy (XDP_ZEROCOPY); Open fails where the
	// driver cannot do it.
	ZeroCopy
)

func (m BindMode) String() string {
	switch m {
	case Auto:
		return "auto"
	case Copy:
		return "copy"
	case ZeroCopy:
		return "zero-copy"
	}
	return fmt.Sprintf("BindMode(%d)", int(m))
}

// Config sizes a socket's UMEM and rings. All counts are in frames or
// descriptors.
type Config struct {
	// NumFrames is the number of frames in the UMEM (power of two).
	NumFrames int
	// FrameSize is the size of one frame in bytes: 2048 or 4096.
	FrameSize int
	// FillRingSize and CompletionRingSize size the UMEM rings; RxRingSize
	// and TxRingSize the socket rings. Each is a power of two no larger
	// than NumFrames.
	FillRingSize       int
	CompletionRingSize int
	RxRingSize         int
	TxRingSize         int
	// Mode selects copy or zero-copy binding.
	Mode BindMode
	// NeedWakeup binds with XDP_USE_NEED_WAKEUP: the kernel says through a
	// ring flag when it needs a syscall to make progress, so a busy
	// zero-copy socket skips most sendto calls.
	NeedWakeup bool
	// BusyPoll, when positive, turns on preferred busy polling: the
	// socket gets SO_PREFER_BUSY_POLL, SO_BUSY_POLL of this long (in
	// microseconds, rounded up) and SO_BUSY_POLL_BUDGET of
	// BusyPollBudget, and Drive then polls the queue's NAPI context from
	// the caller's thread with recvfrom(MSG_DONTWAIT) (see doc.go, "Busy
	// polling"). It needs CAP_NET_ADMIN.
	BusyPoll time.Duration
	// BusyPollBudget is how many frames one busy poll may process; 0
	// means 64. Only with BusyPoll.
	BusyPollBudget int
}

// DefaultBusyPollBudget is BusyPollBudget's default, the kernel's NAPI
// weight.
const DefaultBusyPollBudget = 64

// maxBusyPoll bounds BusyPoll: the kernel takes microseconds in an int,
// and a busy poll longer than a second would only stall the caller.
const maxBusyPoll = time.Second

// DefaultConfig returns 4096 frames of 2048 bytes (8 MiB of UMEM) with 2048
// descriptors in every ring, copy or zero-copy as the driver allows, and
// need-wakeup on.
func DefaultConfig() Config {
	return Config{
		NumFrames:          4096,
		FrameSize:          2048,
		FillRingSize:       2048,
		CompletionRingSize: 2048,
		RxRingSize:         2048,
		TxRingSize:         2048,
		Mode:               Auto,
		NeedWakeup:         true,
	}
}

// ErrInvalidConfig is wrapped by every error Validate returns.
var ErrInvalidConfig = errors.New("afxdp: invalid config")

// maxFrames bounds NumFrames so that frame addresses stay far inside uint32
// ring arithmetic and the UMEM stays below 4 GiB.
const maxFrames = 1 << 20

// Validate reports the first field that the kernel would refuse or that
// would make the socket unusable. The error wraps ErrInvalidConfig and names
// the field.
func (c Config) Validate() error {
	if !isPowerOfTwo(c.NumFrames) || c.NumFrames > maxFrames {
		return fmt.Errorf("%w: NumFrames %d must be a power of two between 1 and %d", ErrInvalidConfig, c.NumFrames, maxFrames)
	}
	if c.FrameSize != 2048 && c.FrameSize != 4096 {
		return fmt.Errorf("%w: FrameSize %d must be 2048 or 4096", ErrInvalidConfig, c.FrameSize)
	}
	rings := []struct {
		name string
		size int
	}{
		{"FillRingSize", c.FillRingSize},
		{"CompletionRingSize", c.CompletionRingSize},
		{"RxRingSize", c.RxRingSize},
		{"TxRingSize", c.TxRingSize},
	}
	for _, r := range rings {
		if !isPowerOfTwo(r.size) {
			return fmt.Errorf("%w: %s %d must be a power of two", ErrInvalidConfig, r.name, r.size)
		}
		if r.size > c.NumFrames {
			return fmt.Errorf("%w: %s %d exceeds NumFrames %d", ErrInvalidConfig, r.name, r.size, c.NumFrames)
		}
	}
	if c.Mode != Auto && c.Mode != Copy && c.Mode != ZeroCopy {
		return fmt.Errorf("%w: Mode %d is not Auto, Copy or ZeroCopy", ErrInvalidConfig, int(c.Mode))
	}
	if c.BusyPoll < 0 || c.BusyPoll > maxBusyPoll {
		return fmt.Errorf("%w: BusyPoll %v must be between 0 and %v", ErrInvalidConfig, c.BusyPoll, maxBusyPoll)
	}
	if c.BusyPollBudget < 0 || c.BusyPollBudget > 0xffff {
		return fmt.Errorf("%w: BusyPollBudget %d must be between 0 and 65535", ErrInvalidConfig, c.BusyPollBudget)
	}
	if c.BusyPollBudget != 0 && c.BusyPoll == 0 {
		return fmt.Errorf("%w: BusyPollBudget %d is set but BusyPoll is not", ErrInvalidConfig, c.BusyPollBudget)
	}
	return nil
}

// busyPollUsec is BusyPoll in whole microseconds, rounded up; 0 when off.
func (c Config) busyPollUsec() int {
	return int((c.BusyPoll + time.Microsecond - 1) / time.Microsecond)
}

func isPowerOfTwo(n int) bool { return n > 0 && n&(n-1) == 0 }
