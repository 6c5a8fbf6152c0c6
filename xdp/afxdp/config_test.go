package afxdp

import (
	"errors"
	"strings"
	"testing"
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
