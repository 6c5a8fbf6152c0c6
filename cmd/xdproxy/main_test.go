package main

import (
	"os"
	"testing"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// TestMain lets the testbed run this test binary again as its backend
// servers (see testbed.ServeIfRequested), and the tests run it again as
// the daemon (xdproxyCommand).
func TestMain(m *testing.M) {
	testbed.ServeIfRequested()
	if os.Getenv(clientEnv) == "1" {
		os.Exit(runClient(os.Args[1:]))
	}
	if os.Getenv(daemonEnv) == "1" {
		os.Unsetenv(daemonEnv)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}
