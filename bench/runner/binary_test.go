package runner

import (
	"testing"

	"github.com/xdproxy/xdproxy/control/config"
)

// TestBinaryConfigParses: the config the benchmark writes for the xdproxy
// binary is one that binary accepts.
func TestBinaryConfigParses(t *testing.T) {
	in := binaryConfig("/tmp/services.yaml", "/tmp/admin.sock", 1)
	c, err := config.ParseWith([]byte(in), config.Options{Host: &config.Host{CPUs: []int{0, 1}}})
	if err != nil {
		t.Fatalf("%v\n%s", err, in)
	}
	if !c.Masquerade.ReservePorts || c.Conntrack.MaxEntries != 1048576 {
		t.Errorf("parsed %+v", c)
	}
}
