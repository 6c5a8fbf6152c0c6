// Command xdproxy-testbed keeps a testbed topology up for a demo or a manual
// experiment: it builds it (the client/node/backends shape, or with -node
// the node shape), optionally starts the servers, prints the namespaces as
// shell variables, and deletes everything on SIGINT or SIGTERM. With
// -cleanup it deletes what killed runs left behind and exits.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

func main() {
	testbed.ServeIfRequested() // the servers are this program run again
	var opts testbed.Options
	flag.IntVar(&opts.Backends, "backends", 3, "number of backend namespaces")
	flag.IntVar(&opts.Queues, "queues", 0, "queues on the node's veths (default 1, or 4 with -node)")
	flag.IntVar(&opts.MTU, "mtu", 0, "MTU of every veth (0: kernel default)")
	flag.BoolVar(&opts.IPv6, "ipv6", false, "add IPv6 addresses and routes")
	node := flag.Bool("node", false, "build the node shape (LAN, two nodes, pods, an off-cluster client) instead")
	servers := flag.Bool("servers", true, "start the servers")
	cleanup := flag.Bool("cleanup", false, "delete namespaces and cgroups of testbeds whose process is gone, then exit")
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
	var closer interface{ Close() error }
	if *node {
		nb, err := testbed.NewNode(testbed.NodeOptions{Queues: opts.Queues, MTU: opts.MTU})
		if err != nil {
			log.Fatal(err)
		}
		closer = nb
		if *servers {
			if err := nb.StartServers(); err != nil {
				nb.Close()
				log.Fatal(err)
			}
		}
		fmt.Printf("LAN_NS=%s\nNODE_NS=%s\nNODE2_NS=%s\nCLIENT_NS=%s\nCGROUP=%s\n",
			nb.LANNS(), nb.NodeNS(), nb.Node2NS(), nb.ClientNS(), nb.Cgroup())
		for _, p := range nb.Pods() {
			v := strings.ToUpper(strings.ReplaceAll(p.Name, "-", "_"))
			fmt.Printf("%s_NS=%s\n%s_ADDR=%s\n", v, p.NS, v, p.Addr)
		}
	} else {
		tb, err := testbed.New(opts)
		if err != nil {
			log.Fatal(err)
		}
		closer = tb
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
	}
	fmt.Println("# ready; interrupt to delete")

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	if err := closer.Close(); err != nil {
		log.Fatal(err)
	}
}
