package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

// The tests of "take only what is ours": the node's own traffic on any port
// never meets a worker, every queue is served, and a frame that reached a
// worker but is not ours goes to the kernel.

// workerTotals sums the workers' counters.
func (a *daemon) workerTotals() dataplane.Snapshot {
	var ws []workerReply
	var s dataplane.Snapshot
	if err := a.query("workers", &ws); err != nil {
		a.t.Fatal(err)
	}
	for _, w := range ws {
		s.Add(w.Counters)
	}
	return s
}

// TestNodesOwnTrafficUntouched: while masqueraded service flows use the
// node's address and SNAT ports, the node's own TCP, UDP and ICMP through
// both served interfaces (replies to ports from ip_local_port_range) keep
// working, and none of it reaches a worker.
func TestNodesOwnTrafficUntouched(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	np := webSvc
	np.nodePort = 30080
	// The client is outside the cluster CIDR: its NodePort flows are
	// masqueraded to the node's LAN address.
	a := newAgent(t, tb, serviceFile(np, dnsSvc), agentOptions{clusterCIDR: "10.244.0.0/16"})
	if out, _ := tb.Exec(tb.NodeNS(), "sysctl", "-n", "net.ipv4.ip_local_port_range"); !strings.HasPrefix(string(out), "32768") {
		t.Fatalf("the node's ephemeral ports are %q, want the stock 32768-60999", out)
	}
	node := tb.NodeClientSide().Addr.String()
	client := tb.Client().Addr.String()
	// A server in the client namespace for the node's connections out of
	// n0, as the backends' are for those out of n1.
	var srv *testserver.Server
	if err := tb.Do(tb.ClientNS(), func() (err error) {
		srv, err = testserver.Listen(testserver.Config{Name: "client", HTTPAddr: client + ":8080", UDPAddr: client + ":5353"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	const rounds = 100
	var wg sync.WaitGroup
	errs := make(chan error, 8*rounds)
	wg.Add(1)
	go func() { // masqueraded service flows, all the while
		defer wg.Done()
		for i := range rounds {
			if _, err := get(tb, "http://"+node+":30080/"); err != nil {
				errs <- fmt.Errorf("NodePort request %d: %w", i, err)
			}
		}
	}()
	nodeHTTP := tb.HTTPClient(tb.NodeNS(), 5*time.Second)
	for i := range rounds {
		for _, url := range []string{"http://198.18.1.11/", "http://" + client + ":8080/"} {
			resp, err := nodeHTTP.Get(url)
			if err != nil {
				errs <- fmt.Errorf("the node's own request %d to %s: %w", i, url, err)
				continue
			}
			resp.Body.Close()
		}
		for _, to := range []string{"198.18.1.12:53", client + ":5353"} {
			if err := udpEcho(tb, tb.NodeNS(), to, fmt.Sprintf("n%d", i)); err != nil {
				errs <- fmt.Errorf("the node's own UDP %d to %s: %w", i, to, err)
			}
		}
	}
	for _, dst := range []netip.Addr{tb.Backend(0).Addr, tb.Client().Addr} {
		if err := tb.Ping(tb.NodeNS(), dst, 3*time.Second); err != nil {
			errs <- fmt.Errorf("the node's ping to %v: %w", dst, err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	s := a.workerTotals()
	// ToKernel also counts translated frames the kernel delivers
	// (ViaKernel: a next hop not resolved yet), which are xdproxy's.
	if s.ByReason["pass_no_service"] != 0 || s.ToKernel != s.ViaKernel || s.ViaKernel != s.Unresolved {
		t.Errorf("frames that were not xdproxy's reached workers: %+v\n%s", s, a.dump())
	}
	if s.NewFlows < rounds {
		t.Errorf("%d new flows: the NodePort traffic did not go through xdproxy", s.NewFlows)
	}
}

// udpEcho sends msg from ns to the echo server at to and checks the echo.
func udpEcho(tb *testbed.Testbed, ns, to, msg string) error {
	c, err := tb.Dial(context.Background(), ns, "udp", to)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if !strings.HasSuffix(string(buf[:n]), " "+msg) {
		return fmt.Errorf("echo %q", buf[:n])
	}
	return nil
}

// TestPMTUAboutNodesConnection: an ICMP "fragmentation needed" about a
// datagram the node sent itself reaches the node's kernel, which lowers
// the route's MTU; xdproxy does not claim it.
func TestPMTUAboutNodesConnection(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{})
	backend, node := tb.Backend(0).Addr, tb.NodeLANSide().Addr
	c, err := tb.Dial(context.Background(), tb.NodeNS(), "udp", netip.AddrPortFrom(backend, 53).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	local := c.LocalAddr().(*net.UDPAddr)
	// The router's complaint, from the backend's side, quoting the
	// node's datagram.
	qip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolUDP, SrcIP: net.IP(node.AsSlice()), DstIP: net.IP(backend.AsSlice()), Length: 20 + 8 + 5}
	qudp := &layers.UDP{SrcPort: layers.UDPPort(local.Port), DstPort: 53, Length: 13}
	_ = qudp.SetNetworkLayerForChecksum(qip)
	quote := serializeLayers(t, qip, qudp)
	icmp := make([]byte, 8, 8+len(quote))
	icmp[0], icmp[1] = 3, 4 // destination unreachable, fragmentation needed
	binary.BigEndian.PutUint16(icmp[6:], 1280)
	icmp = append(icmp, quote[:28]...)
	binary.BigEndian.PutUint16(icmp[2:], ^onesSum(icmp, 0))
	before, _ := a.xdp()
	err = tb.Do(tb.BackendNS(0), func() error {
		rc, err := net.ListenPacket("ip4:icmp", backend.String())
		if err != nil {
			return err
		}
		defer rc.Close()
		_, err = rc.WriteTo(icmp, &net.IPAddr{IP: net.IP(node.AsSlice())})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []byte
	if !waitUntil(50*time.Millisecond, 5*time.Second, func() bool {
		out, _ = tb.Exec(tb.NodeNS(), "ip", "route", "get", backend.String())
		return strings.Contains(string(out), "mtu 1280")
	}) {
		nstat, _ := tb.Exec(tb.NodeNS(), "nstat", "-az")
		t.Fatalf("the node's route to %v did not learn the MTU:\n%s\n%s\n%s", backend, out, nstat, a.dump())
	}
	after, _ := a.xdp()
	if after["MatchICMPError"] != before["MatchICMPError"] {
		t.Errorf("xdproxy claimed an ICMP error about the node's own datagram")
	}
}

// xdp reads the XDP programs' counters from the admin socket.
func (a *daemon) xdp() (map[string]uint64, error) {
	var st struct {
		XDP map[string]uint64 `json:"xdp"`
	}
	err := a.query("stats", &st)
	return st.XDP, err
}

func serializeLayers(t *testing.T, ls ...gopacket.SerializableLayer) []byte {
	t.Helper()
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{ComputeChecksums: true}, ls...); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// servedQueues reads which queues of ifc have workers.
func (a *daemon) servedQueues(ifc string) []int {
	var ifs []dataplane.InterfaceStatus
	if err := a.query("interfaces", &ifs); err != nil {
		return nil
	}
	for _, s := range ifs {
		if s.Name == ifc {
			return s.Served
		}
	}
	return nil
}

// TestEveryQueueServedAcrossChannelChanges: on a 4-queue veth with queues
// left out of the config, every queue gets a worker and traffic spread over
// all of them is served; taking the interface to 2 queues (through the
// agent, since Linux refuses ethtool -L while AF_XDP sockets hold the
// queues) and back to 4 with plain ethtool -L, with traffic running, loses
// no flow for longer than the re-attach.
func TestEveryQueueServedAcrossChannelChanges(t *testing.T) {
	tb := newTopology(t, testbed.Options{Queues: 4})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{allQueues: true})
	n0, c0 := tb.NodeClientSide().Iface, tb.Client().Iface
	if got := a.servedQueues(n0); !slices.Equal(got, []int{0, 1, 2, 3}) {
		t.Fatalf("%s served %v, want every queue", n0, got)
	}
	// Flows spread over the client's 4 transmit queues, so over n0's 4
	// receive queues.
	for i := range 64 {
		if err := udpEcho(tb, tb.ClientNS(), "198.19.0.20:53", fmt.Sprintf("s%d", i)); err != nil {
			t.Fatalf("query %d: %v\n%s", i, err, a.dump())
		}
	}
	var ws []workerReply
	if err := a.query("workers", &ws); err != nil {
		t.Fatal(err)
	}
	busy := map[int]bool{}
	for _, w := range ws {
		if w.Interface == n0 && w.Counters.RxFrames > 0 {
			busy[w.Queue] = true
		}
	}
	if len(busy) < 3 {
		t.Errorf("traffic reached queues %v of %s, want it spread over (nearly) all 4", busy, n0)
	}

	// Traffic all through the changes: a new flow every 10 ms.
	var sent, lost atomic.Int64
	var gapMu sync.Mutex
	var lastOK time.Time
	var longestGap time.Duration
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// A failing step ends the test at once: the sender stops with it.
	stopped := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopped)
	wg.Add(1)
	go func() {
		defer wg.Done()
		lastOK = time.Now()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			sent.Add(1)
			err := udpEcho(tb, tb.ClientNS(), "198.19.0.20:53", fmt.Sprintf("c%d", i))
			gapMu.Lock()
			if err != nil {
				lost.Add(1)
			} else {
				longestGap = max(longestGap, time.Since(lastOK))
				lastOK = time.Now()
			}
			gapMu.Unlock()
			time.Sleep(10 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond)
	// Down to 2: the sender's side first (a veth with XDP must keep as many
	// receive queues as its peer has transmit queues), then xdproxy lets
	// go of queues 2 and 3 and sets the count.
	if out, err := tb.Exec(tb.ClientNS(), "ethtool", "-L", c0, "tx", "2"); err != nil {
		t.Fatalf("ethtool -L %s tx 2: %v %s", c0, err, out)
	}
	if out, err := tb.Exec(tb.NodeNS(), "ethtool", "-L", n0, "rx", "2"); err == nil {
		t.Errorf("ethtool -L took queues away from AF_XDP sockets (%s); Linux refuses that", out)
	}
	cmd := xdproxyCommand("admin", "--socket", a.admin, "channels", n0, "2")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("xdproxy admin channels %s 2: %v\n%s", n0, err, out)
	}
	if got := a.servedQueues(n0); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("after going to 2 queues: served %v", got)
	}
	time.Sleep(500 * time.Millisecond)
	// Back to 4 with plain ethtool: xdproxy follows.
	if out, err := tb.Exec(tb.NodeNS(), "ethtool", "-L", n0, "rx", "4", "tx", "4"); err != nil {
		t.Fatalf("ethtool -L %s 4: %v %s", n0, err, out)
	}
	if out, err := tb.Exec(tb.ClientNS(), "ethtool", "-L", c0, "tx", "4"); err != nil {
		t.Fatalf("ethtool -L %s tx 4: %v %s", c0, err, out)
	}
	if !waitUntil(50*time.Millisecond, 10*time.Second, func() bool {
		return slices.Equal(a.servedQueues(n0), []int{0, 1, 2, 3})
	}) {
		t.Fatalf("queues 2 and 3 not served again: %v\n%s", a.servedQueues(n0), a.dump())
	}
	time.Sleep(500 * time.Millisecond)
	stopped()
	t.Logf("%d queries during the changes, %d lost, longest gap %v", sent.Load(), lost.Load(), longestGap)
	if longestGap > 3*time.Second {
		t.Errorf("service interrupted for %v across the channel changes", longestGap)
	}
	var h struct {
		Healthz struct{ Healthy bool } `json:"healthz"`
	}
	if err := a.query("health", &h); err != nil || !h.Healthz.Healthy {
		t.Errorf("unhealthy after the changes: %+v %v", h, err)
	}
}

// TestNotOursAfterAllGoesToTheKernel: a masqueraded UDP flow expires in
// conntrack (a short udpTimeout) while its reply tuple is still in the XDP
// flow table (the sweep has not reached it); the backend's late reply
// reaches a worker, which finds no flow and hands the frame to the kernel
// through the exception link; the kernel, which has no socket on the SNAT
// port, answers the backend with a port unreachable. The kernel may keep
// an ICMP error to itself (its rate limits are not ours to change), so a
// missing answer is tried again, twice, with a new flow; the attempts that
// failed are logged with the kernel's counters.
func TestNotOursAfterAllGoesToTheKernel(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{clusterCIDR: "10.244.0.0/16",
		extraCfg: "conntrack: {udpTimeout: 1s, udpStreamTimeout: 1s}\n"})
	// Listen for ICMP in every backend: the one that answers will get it.
	got := make(chan string, 16)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range 3 {
		go func() {
			_ = tb.Do(tb.BackendNS(i), func() error {
				rc, err := net.ListenPacket("ip4:icmp", tb.Backend(i).Addr.String())
				if err != nil {
					return err
				}
				go func() { <-ctx.Done(); rc.Close() }()
				buf := make([]byte, 1500)
				for {
					n, from, err := rc.ReadFrom(buf)
					if err != nil {
						return err
					}
					// Port unreachable, quoting a UDP datagram from the
					// backend's echo port.
					if n >= 8+20+8 && buf[0] == 3 && buf[1] == 3 && buf[8+9] == 17 &&
						binary.BigEndian.Uint16(buf[8+20:]) == testbed.UDPPort {
						select {
						case got <- from.String():
						default:
						}
					}
				}
			})
		}()
	}
	time.Sleep(200 * time.Millisecond)
	// The sweeper may have reached the expired flow first and taken its
	// tuple out of the XDP table: then the reply goes to the kernel
	// straight from XDP and no worker sees it. That attempt proves less,
	// so the test goes on until a reply went through a worker.
	const attempts = 5
	for attempt := 1; ; attempt++ {
		before, _ := a.xdp()
		// Not counting translated frames the kernel delivers
		// (ViaKernel: a next hop not resolved yet).
		s0 := a.workerTotals()
		toKernel, passed := s0.ToKernel-s0.ViaKernel, s0.ByReason["pass_no_service"]
		from, ok := lateReplyAnswered(t, tb, got)
		after, _ := a.xdp()
		viaWorker := after["MatchFlow"] > before["MatchFlow"]
		switch {
		case !ok:
			diag := kernelCounters(tb)
			if attempt == attempts {
				t.Fatalf("the kernel's answer never came\n%s\n%s", diag, a.dump())
			}
			t.Logf("attempt %d: the kernel's answer never came\n%s", attempt, diag)
			continue
		case from != tb.NodeLANSide().Addr.String():
			t.Fatalf("port unreachable from %s, want the node %v", from, tb.NodeLANSide().Addr)
		case !viaWorker:
			if attempt == attempts {
				t.Fatalf("in %d attempts, every expired flow was swept before its late reply", attempts)
			}
			t.Logf("attempt %d: the expired flow was swept before its late reply; the kernel got it from XDP directly", attempt)
			continue
		}
		s := a.workerTotals()
		if s.ToKernel-s.ViaKernel == toKernel || s.ByReason["pass_no_service"] == passed {
			t.Errorf("counters %+v: want the frame counted pass_no_service and handed to the kernel", s)
		}
		return
	}
}

// lateReplyAnswered opens a new masqueraded flow, asks the backend to
// answer after the flow has expired, and waits for the port unreachable
// the node's kernel sends the backend; it returns the ICMP error's source.
func lateReplyAnswered(t *testing.T, tb *testbed.Testbed, got <-chan string) (string, bool) {
	t.Helper()
	c, err := tb.Dial(context.Background(), tb.ClientNS(), "udp", "198.19.0.20:53")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for len(got) > 0 {
		<-got // a late answer of an earlier attempt
	}
	// The backend answers after 1.5 s, when the flow (1 s) has expired.
	if _, err := testserver.EchoDelayed(c, 1500*time.Millisecond, "late", 3*time.Second); err == nil {
		t.Fatal("the late reply reached the client through an expired flow")
	}
	select {
	case from := <-got:
		return from, true
	case <-time.After(5 * time.Second):
		return "", false
	}
}

// kernelCounters returns the node's and the backends' kernel counters
// that say where a datagram handed to the kernel, or its ICMP answer,
// went: a failure message shows them.
func kernelCounters(tb *testbed.Testbed) string {
	keep := regexp.MustCompile(`^(Ip(In|Out|Ext|Forw)\w*|Udp\w*|Icmp\w*|TcpExtIPReversePathFilter)\s+[1-9]`)
	var b strings.Builder
	show := func(ns string, args ...string) {
		out, err := tb.Exec(ns, args...)
		fmt.Fprintf(&b, "%s: %s:", ns, strings.Join(args, " "))
		if err != nil {
			fmt.Fprintf(&b, " %v", err)
		}
		b.WriteString("\n")
		for _, line := range strings.Split(string(out), "\n") {
			if args[0] != "nstat" || keep.MatchString(line) {
				fmt.Fprintf(&b, "  %s\n", line)
			}
		}
	}
	show(tb.NodeNS(), "nstat", "-asz")
	show(tb.NodeNS(), "ip", "-s", "link", "show", config.DefaultExceptionInterface)
	for i := range 3 {
		show(tb.BackendNS(i), "nstat", "-asz")
	}
	return b.String()
}
