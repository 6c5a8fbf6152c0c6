package testbed

import (
	"errors"
	"os"

	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

// serveEnv marks a process that the testbed started as a server: it holds
// "1", and the server's flags are the process's arguments.
const serveEnv = "XDPROXY_TESTBED_SERVER"

// ErrNoServeHook says that a program was started as a testbed server but
// went on with its own work: it does not call ServeIfRequested first.
var ErrNoServeHook = errors.New("testbed: the program did not start as a test server: " +
	"does it call testbed.ServeIfRequested() first in main (or TestMain)?")

// ServeIfRequested turns the process into a test server when the testbed
// started it as one, and otherwise returns at once. Every program that
// starts servers (StartServers) must call it first in main, and every test
// package that does in TestMain, before flags are parsed:
//
//	func TestMain(m *testing.M) {
//		testbed.ServeIfRequested()
//		os.Exit(m.Run())
//	}
//
// The testbed starts servers by running the program's own binary
// (/proc/self/exe) again, inside the backend's network namespace, with the
// environment variable XDPROXY_TESTBED_SERVER=1 and the server's flags as
// arguments (see testserver.Main); no Go toolchain is needed at run time.
// A server process never returns from here: it serves until it is stopped
// and exits.
func ServeIfRequested() {
	if os.Getenv(serveEnv) != "1" {
		return
	}
	_ = os.Unsetenv(serveEnv)
	os.Exit(testserver.Main(os.Args[1:], os.Stdout, os.Stderr))
}

// startedAsServer reports a process that was started as a server but did
// not call ServeIfRequested: such a process must not build testbeds or
// start servers of its own (it would start itself again, and again).
func startedAsServer() error {
	if os.Getenv(serveEnv) != "" {
		return ErrNoServeHook
	}
	return nil
}
