package afxdp

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	tests := []struct {
		name   string
		change func(*Config)
		field  string // must appear in the error
	}{
		{"zero frames", func(c *Config) { c.NumFrames = 0 }, "NumFrames"},
		{"frames not a power of two", func(c *Config) { c.NumFrames = 3000 }, "NumFrames"},
		{"too many frames", func(c *Config) { c.NumFrames = 1 << 21 }, "NumFrames"},
		{"frame size 1500", func(c *Config) { c.FrameSize = 1500 }, "FrameSize"},
		{"frame size 8192", func(c *Config) { c.FrameSize = 8192 }, "FrameSize"},
		{"fill ring not a power of two", func(c *Config) { c.FillRingSize = 1000 }, "FillRingSize"},
		{"completion ring zero", func(c *Config) { c.CompletionRingSize = 0 }, "CompletionRingSize"},
		{"rx ring negative", func(c *Config) { c.RxRingSize = -2 }, "RxRingSize"},
		{"tx ring larger than frames", func(c *Config) { c.TxRingSize = 8192 }, "TxRingSize"},
		{"fill ring larger than frames", func(c *Config) { c.NumFrames = 1024 }, "FillRingSize"},
		{"unknown mode", func(c *Config) { c.Mode = 7 }, "Mode"},
		{"negative busy poll", func(c *Config) { c.BusyPoll = -time.Microsecond }, "BusyPoll"},
		{"busy poll over a second", func(c *Config) { c.BusyPoll = 2 * time.Second }, "BusyPoll"},
		{"busy poll budget too big", func(c *Config) { c.BusyPoll, c.BusyPollBudget = time.Microsecond, 1<<16 }, "BusyPollBudget"},
		{"busy poll budget negative", func(c *Config) { c.BusyPoll, c.BusyPollBudget = time.Microsecond, -1 }, "BusyPollBudget"},
		{"budget without busy poll", func(c *Config) { c.BusyPollBudget = 64 }, "BusyPollBudget"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			tt.change(&c)
			err := c.Validate()
			if err == nil {
				t.Fatalf("Validate accepted %+v", c)
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("error %q does not wrap ErrInvalidConfig", err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("error %q does not name %s", err, tt.field)
			}
		})
	}
}

func TestOpenRejectsBadArguments(t *testing.T) {
	bad := DefaultConfig()
	bad.FrameSize = 1000
	if _, err := Open(1, 0, bad); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Open with a bad config: %v", err)
	}
	if _, err := Open(0, 0, DefaultConfig()); err == nil || !strings.Contains(err.Error(), "ifindex") {
		t.Errorf("Open with ifindex 0: %v", err)
	}
	if _, err := Open(1, -1, DefaultConfig()); err == nil || !strings.Contains(err.Error(), "queue") {
		t.Errorf("Open with queue -1: %v", err)
	}
}

func TestBusyPollMicroseconds(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		usec int
	}{{0, 0}, {time.Nanosecond, 1}, {20 * time.Microsecond, 20}, {20*time.Microsecond + 1, 21}} {
		if got := (Config{BusyPoll: tt.d}).busyPollUsec(); got != tt.usec {
			t.Errorf("BusyPoll %v: %d us, want %d", tt.d, got, tt.usec)
		}
	}
}
