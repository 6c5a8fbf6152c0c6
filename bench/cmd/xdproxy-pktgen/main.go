// Command xdproxy-pktgen sends UDP or TCP SYN/ACK traffic at a paced rate
// from an interface of the network namespace it runs in (start it with
// "ip netns exec NS"), through AF_XDP transmit or BPF_PROG_RUN live frames,
// and can count what arrives at the far end with an XDP sink.
//
//	ip netns exec gen xdproxy-pktgen --dev g0 --dst 198.19.0.1 --dport 80 \
//	    --rate 300000 --duration 2s --flows 1000 --proto udp \
//	    --sink-netns sink --sink-dev s0
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/sink"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

type output struct {
	pktgen.Result
	Flows     int      `json:"flows"`
	FrameSize int      `json:"frameSize"`
	Proto     string   `json:"proto"`
	Received  *uint64  `json:"received,omitempty"`
	Loss      *float64 `json:"loss,omitempty"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "xdproxy-pktgen:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		dev      = flag.String("dev", "", "interface to send from (required)")
		queue    = flag.Int("queue", 0, "transmit queue (afxdp mode)")
		mode     = flag.String("mode", "afxdp", "afxdp or prog-run")
		rate     = flag.Float64("rate", 0, "packets per second; 0 sends as fast as the mode can")
		duration = flag.Duration("duration", 0, "how long to send")
		count    = flag.Uint64("count", 0, "how many packets to send (with --duration, whichever ends first)")
		size     = flag.Int("size", 64, "frame size in bytes including the 4-byte FCS (64..1518)")
		flows    = flag.Int("flows", 1, "distinct flows (source address/port pairs), 1..16M")
		proto    = flag.String("proto", "udp", "udp, tcp-syn or tcp-ack")
		src      = flag.String("src", "198.18.0.16", "source address of flow 0; flows take consecutive ports, then addresses")
		dst      = flag.String("dst", "", "destination address (required)")
		dsts     = flag.Int("dsts", 1, "spread flows over this many consecutive destination addresses")
		dport    = flag.Uint("dport", 80, "destination port")
		dstMAC   = flag.String("dst-mac", "", "next hop MAC; default: the neighbour entry of the route to --dst")
		srcMAC   = flag.String("src-mac", "", "source MAC; default: --dev's (set it when --dev only feeds another interface, as bench/feed's NIC feed does)")
		seq      = flag.Uint64("seq", 0, "sequence number of the first packet: packet i carries flow (seq+i) % flows (afxdp mode)")
		cpu      = flag.Int("cpu", -1, "pin the sending thread to this CPU")
		sinkNS   = flag.String("sink-netns", "", "namespace of the sink interface (empty: this one)")
		sinkDev  = flag.String("sink-dev", "", "attach an XDP counter here and report received packets and loss")
		settle   = flag.Duration("settle", 200*time.Millisecond, "wait after sending before reading the sink")
		asJSON   = flag.Bool("json", false, "print the result as JSON")
	)
	flag.Parse()
	if *dev == "" || *dst == "" {
		return errors.New("--dev and --dst are required")
	}
	if *duration <= 0 && *count == 0 {
		return errors.New("one of --duration and --count is required")
	}
	p, err := pktgen.ParseProto(*proto)
	if err != nil {
		return err
	}
	srcAddr, err := netip.ParseAddr(*src)
	if err != nil {
		return err
	}
	dstAddr, err := netip.ParseAddr(*dst)
	if err != nil {
		return err
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return err
	}
	// Everything below runs on one OS thread: the namespace, the socket
	// and the CPU pinning belong to it.
	runtime.LockOSThread()
	if *cpu >= 0 {
		var set unix.CPUSet
		set.Set(*cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return fmt.Errorf("pinning to CPU %d: %w", *cpu, err)
		}
	}
	link, err := netlink.LinkByName(*dev)
	if err != nil {
		return fmt.Errorf("interface %s: %w", *dev, err)
	}
	next, err := nextHopMAC(*dstMAC, link, dstAddr)
	if err != nil {
		return err
	}
	smac := link.Attrs().HardwareAddr
	if *srcMAC != "" {
		if smac, err = net.ParseMAC(*srcMAC); err != nil {
			return fmt.Errorf("--src-mac: %w", err)
		}
	}
	tpl, err := pktgen.NewTemplate(pktgen.FrameSpec{
		Proto: p, Size: *size, Flows: *flows, Dsts: *dsts, DstPort: uint16(*dport),
		SrcMAC: smac, DstMAC: next, Src: srcAddr, Dst: dstAddr,
	})
	if err != nil {
		return err
	}
	type sender interface {
		Send(pktgen.Budget, <-chan struct{}) (pktgen.Result, error)
		Close() error
	}
	var s sender
	switch *mode {
	case "afxdp":
		s, err = pktgen.OpenAFXDP(link.Attrs().Index, *queue, tpl)
	case "prog-run":
		s, err = pktgen.OpenProgRun(link.Attrs().Index, tpl)
	default:
		err = fmt.Errorf("--mode %q, want afxdp or prog-run", *mode)
	}
	if err != nil {
		return err
	}
	defer s.Close()

	var sk *sink.Sink
	if *sinkDev != "" {
		attach := func() error {
			l, err := netlink.LinkByName(*sinkDev)
			if err != nil {
				return err
			}
			sk, err = sink.Attach(l.Attrs().Index, sink.Native)
			return err
		}
		if *sinkNS != "" {
			err = testbed.DoIn(*sinkNS, attach)
		} else {
			err = attach()
		}
		if err != nil {
			return fmt.Errorf("sink: %w", err)
		}
		defer sk.Close()
	}
	var before sink.Counts
	if sk != nil {
		if before, err = sk.Read(); err != nil {
			return err
		}
	}
	stop := make(chan struct{})
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() { <-sigs; close(stop) }()

	res, err := s.Send(pktgen.Budget{Rate: *rate, Duration: *duration, Count: *count, Seq: *seq}, stop)
	if err != nil {
		return err
	}
	out := output{Result: res, Flows: *flows, FrameSize: *size, Proto: p.String()}
	if sk != nil {
		time.Sleep(*settle)
		after, err := sk.Read()
		if err != nil {
			return err
		}
		got := after.Sub(before).Packets
		loss := 0.0
		if res.Sent > 0 && got < res.Sent {
			loss = float64(res.Sent-got) / float64(res.Sent)
		}
		out.Received, out.Loss = &got, &loss
	}
	if *asJSON {
		return json.NewEncoder(os.Stdout).Encode(out)
	}
	fmt.Printf("mode %s: sent %d in %v = %.0f pps (offered %.0f, late %d, errors %d)\n",
		res.Mode, res.Sent, res.Elapsed.Round(time.Millisecond), res.Achieved, res.Offered, res.Late, res.SendErrors)
	if out.Received != nil {
		fmt.Printf("sink: received %d, loss %.4f%%\n", *out.Received, *out.Loss*100)
	}
	return nil
}

// nextHopMAC parses flagMAC, or finds the neighbour entry of the next hop
// towards dst on link.
func nextHopMAC(flagMAC string, link netlink.Link, dst netip.Addr) (net.HardwareAddr, error) {
	if flagMAC != "" {
		return net.ParseMAC(flagMAC)
	}
	routes, err := netlink.RouteGet(dst.AsSlice())
	if err != nil || len(routes) == 0 {
		return nil, fmt.Errorf("no route to %v: %v", dst, err)
	}
	hop := routes[0].Gw
	if hop == nil {
		hop = dst.AsSlice()
	}
	neighs, err := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		return nil, err
	}
	for _, n := range neighs {
		if n.IP.Equal(hop) && len(n.HardwareAddr) == 6 {
			return n.HardwareAddr, nil
		}
	}
	return nil, fmt.Errorf("no neighbour entry for next hop %v on %s; pass --dst-mac", hop, link.Attrs().Name)
}
