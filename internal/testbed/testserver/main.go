package testserver

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// The first line a server process writes to its standard output is
// ReadyLine once every listener is open, or FailedLine, ": " and the reason
// when it cannot serve. Whoever starts one waits for either.
const (
	ReadyLine  = "xdproxy-testserver ready"
	FailedLine = "xdproxy-testserver failed"
)

// Main runs a server process. args are its command-line flags (without the
// program name): -name, -http, -udp, -tcp and -follow-parent. It listens,
// writes ReadyLine (or FailedLine) to stdout and serves until SIGTERM or SIGINT, or until
// its parent process goes away (a killed test run leaves its servers
// re-parented). It returns the exit status. The command
// xdproxy-testserver and testbed.ServeIfRequested both run it.
func Main(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("xdproxy-testserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg Config
	fs.StringVar(&cfg.Name, "name", "", "name the servers answer with")
	fs.StringVar(&cfg.HTTPAddr, "http", ":80", "HTTP listen address (empty: off)")
	fs.StringVar(&cfg.UDPAddr, "udp", ":53", "UDP echo listen address (empty: off)")
	fs.StringVar(&cfg.TCPAddr, "tcp", ":5001", "TCP stream listen address (empty: off)")
	followParent := fs.Bool("follow-parent", true, "exit when the parent process exits")
	if err := fs.Parse(args); err != nil {
		fmt.Fprintf(stdout, "%s: %v\n", FailedLine, err)
		return 2
	}
	if cfg.Name == "" || fs.NArg() > 0 {
		fmt.Fprintf(stdout, "%s: -name is required and there are no arguments\n", FailedLine)
		return 2
	}
	// Ask for the signals before announcing readiness, so a stop that
	// follows at once is not lost.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sig)
	srv, err := Listen(cfg)
	if err != nil {
		fmt.Fprintf(stdout, "%s: %v\n", FailedLine, err)
		return 1
	}
	fmt.Fprintln(stdout, ReadyLine)

	parent := os.Getppid()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-sig:
			_ = srv.Close()
			return 0
		case <-tick.C:
			if *followParent && os.Getppid() != parent {
				_ = srv.Close()
				return 0
			}
		}
	}
}
