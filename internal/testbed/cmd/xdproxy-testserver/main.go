// Command xdproxy-testserver runs the testbed's backend servers (see package
// testserver) until it is signalled or its parent process goes away.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

func main() {
	var cfg testserver.Config
	flag.StringVar(&cfg.Name, "name", "", "name the servers answer with")
	flag.StringVar(&cfg.HTTPAddr, "http", ":80", "HTTP listen address (empty: off)")
	flag.StringVar(&cfg.UDPAddr, "udp", ":53", "UDP echo listen address (empty: off)")
	flag.StringVar(&cfg.TCPAddr, "tcp", ":5001", "TCP stream listen address (empty: off)")
	followParent := flag.Bool("follow-parent", true, "exit when the parent process exits")
	flag.Parse()
	if cfg.Name == "" {
		log.Fatal("xdproxy-testserver: -name is required")
	}
	srv, err := testserver.Listen(cfg)
	if err != nil {
		log.Fatalf("xdproxy-testserver: %v", err)
	}
	// The testbed waits for this line before it lets a test use the server.
	fmt.Println("ready")

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	parent := os.Getppid()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-sig:
			_ = srv.Close()
			return
		case <-tick.C:
			// A killed test run leaves us re-parented; do not outlive it.
			if *followParent && os.Getppid() != parent {
				_ = srv.Close()
				return
			}
		}
	}
}
