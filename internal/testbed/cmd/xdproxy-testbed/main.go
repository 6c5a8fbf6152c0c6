// Command xdproxy-testbed keeps a testbed topology up for a demo or a manual
// experiment: it builds it, optionally starts the backend servers, prints
// the namespaces as shell variables, and deletes everything on SIGINT or
// SIGTERM. With -cleanup it deletes what killed runs left behind and exits.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

func main() {
	var opts testbed.Options
	flag.IntVar(&opts.Backends, "backends", 3, "number of backend namespaces")
	flag.IntVar(&opts.Queues, "queues", 1, "queues on the node's veths")
	flag.IntVar(&opts.MTU, "mtu", 0, "MTU of every veth (0: kernel default)")
	flag.BoolVar(&opts.IPv6, "ipv6", false, "add IPv6 addresses and routes")
	servers := flag.Bool("servers", true, "start the backend servers (needs the go tool and the xdproxy module)")
	cleanup := flag.Bool("cleanup", false, "delete namespaces of testbeds whose process is gone, then exit")
	flag.Parse()

	if *cleanup {
		deleted, err := testbed.CleanupStale()
		for _, d := range deleted {
			fmt.Println("deleted", d)
		}
		if err != nil {
			log.Fatal(err)
		}
		return
	}
	tb, err := testbed.New(opts)
	if err != nil {
		log.Fatal(err)
	}
	if *servers {
		if err := tb.StartServers(); err != nil {
			tb.Close()
			log.Fatal(err)
		}
	}
	fmt.Printf("CLIENT_NS=%s\nNODE_NS=%s\nLAN_NS=%s\n", tb.ClientNS(), tb.NodeNS(), tb.LANNS())
	for i := range tb.NumBackends() {
		b := tb.Backend(i)
		fmt.Printf("BACKEND%d_NS=%s\nBACKEND%d_ADDR=%s\n", i, b.NS, i, b.Addr)
	}
	fmt.Println("# ready; interrupt to delete")

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	if err := tb.Close(); err != nil {
		log.Fatal(err)
	}
}
