package main

import (
	"fmt"
	"os"
)

const usage = `usage:
  xdproxy run --config FILE [--node-name NAME]
                                     run the agent; NAME replaces the file's nodeName
  xdproxy check --config FILE [--node-name NAME]
                                     validate a config file and exit
  xdproxy admin [--socket PATH] CMD  query a running agent; CMD is one of
                                     stats, services, conntrack, workers
  xdproxy version
`

// version is what `xdproxy version` prints: `make build` and `make image` set it
// to git describe's answer with -ldflags "-X main.version=$(VERSION)".
var version = "dev"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = runCmd(os.Args[2:])
	case "check":
		err = checkCmd(os.Args[2:])
	case "admin":
		err = adminCmd(os.Args[2:])
	case "version":
		fmt.Println("xdproxy", version)
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "xdproxy: unknown command %q\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdproxy:", err)
		os.Exit(1)
	}
}
