// Command xdproxy-testserver runs the testbed's backend servers (see package
// testserver) until it is signalled or its parent process goes away. The
// testbed itself re-executes the program that uses it (see
// testbed.ServeIfRequested); this command is for starting a server by hand.
package main

import (
	"os"

	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

func main() { os.Exit(testserver.Main(os.Args[1:], os.Stdout, os.Stderr)) }
