package main

import (
	"os"
	"testing"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// TestMain lets the testbed run this test binary again as its backend
// servers (see testbed.ServeIfRequested).
func TestMain(m *testing.M) {
	testbed.ServeIfRequested()
	os.Exit(m.Run())
}
