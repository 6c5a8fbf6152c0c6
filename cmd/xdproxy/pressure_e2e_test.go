package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// agentStats is what the pressure tests read from the admin socket's
// stats: the workers' drop reasons and the connection table's counters.
type agentStats struct {
	Workers struct {
		RxFrames, NewFlows, FlowPublishErrors uint64
		ByReason                              map[string]uint64
	} `json:"workers"`
	Conntrack ctStats           `json:"conntrack"`
	XDP       map[string]uint64 `json:"xdp"`
	SYNGuard  bool              `json:"synGuard"`
}

func (a *daemon) pressureStats() (agentStats, error) {
	var st agentStats
	err := a.query("stats", &st)
	return st, err
}

// TestSpoofedRSTIgnored proves that a reset an attacker forges for an
// established connection through a VIP, with a sequence number far outside
// the window, neither reaches the backend nor closes the flow: the daemon
// drops and counts it (drop_out_of_window, OutOfWindowRST), the flow stays
// established and data still flows both ways. A reset with the right
// sequence number then does close the connection, so the check is not a
// blanket drop of resets.
func TestSpoofedRSTIgnored(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	echo := startEchoServers(t, tb)
	one := echoSvc
	one.name, one.clusterIP, one.backends = "echo1", "198.19.0.71", []int{0}
	a := newAgent(t, tb, serviceFile(one), agentOptions{})
	clientCap := startSniffer(t, tb.ClientNS(), netip.Addr{})
	backendCap := startSniffer(t, tb.BackendNS(0), netip.Addr{})
	vip := netip.AddrPortFrom(netip.MustParseAddr(one.clusterIP), echoPort)

	c, err := dialFrom(tb, netip.Addr{}, vip.String(), 10*time.Second)
	if err != nil {
		t.Fatalf("%v\n%s", err, a.dump())
	}
	defer c.Close()
	local := netip.MustParseAddrPort(c.LocalAddr().String())
	var off int64
	round := func(when string, n int) {
		t.Helper()
		if err := echoRound(c, off, n, 10*time.Second); err != nil {
			t.Fatalf("%s: %v\n%s", when, err, a.dump())
		}
		off += int64(n)
	}
	round("before the resets", 1000)
	orig := fmt.Sprintf("%v->%v", local, vip)
	if st, _, _ := a.flowState(orig); st != "tcp_established" {
		t.Fatalf("flow %s is %q, want tcp_established", orig, st)
	}
	// The backend's side of the flow: the client's address is kept (the
	// client is inside the cluster CIDR).
	toBackend := func(g tcpSeg) bool {
		return g.src == local && g.dst == netip.AddrPortFrom(tb.Backend(0).Addr, echoPort) && g.flags&tcpRST != 0
	}

	before, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}
	sndNxt, rcvNxt := learnSeq(t, clientCap, local, vip)
	sendTCPv4(t, tb.ClientNS(), local, vip, sndNxt+1<<30, rcvNxt, tcpRST|tcpACK)
	var after agentStats
	if !waitUntil(50*time.Millisecond, 5*time.Second, func() bool {
		after, err = a.pressureStats()
		return err == nil && after.Workers.ByReason["drop_out_of_window"] > before.Workers.ByReason["drop_out_of_window"] &&
			after.Conntrack.OutOfWindowRST > before.Conntrack.OutOfWindowRST
	}) {
		t.Fatalf("the forged reset was not counted: drop_out_of_window %d -> %d, OutOfWindowRST %d -> %d\n%s",
			before.Workers.ByReason["drop_out_of_window"], after.Workers.ByReason["drop_out_of_window"],
			before.Conntrack.OutOfWindowRST, after.Conntrack.OutOfWindowRST, a.dump())
	}
	if st, _, _ := a.flowState(orig); st != "tcp_established" {
		t.Errorf("after the forged reset the flow is %q, want tcp_established", st)
	}
	// Data both ways, 16 KiB, after the forged reset.
	round("after the forged reset", 16<<10)
	if rs := backendCap.find(toBackend); len(rs) > 0 {
		t.Errorf("the forged reset reached the backend: %v", rs)
	}
	if n := echo.resets.Load(); n != 0 {
		t.Errorf("the backend's connection was reset")
	}
	t.Logf("forged reset (seq %d, %d past the client's next) dropped: drop_out_of_window %d, OutOfWindowRST %d",
		sndNxt+1<<30, 1<<30, after.Workers.ByReason["drop_out_of_window"], after.Conntrack.OutOfWindowRST)

	// The client's own reset, with its next sequence number, goes through.
	sndNxt, rcvNxt = learnSeq(t, clientCap, local, vip)
	sendTCPv4(t, tb.ClientNS(), local, vip, sndNxt, rcvNxt, tcpRST|tcpACK)
	if !waitUntil(20*time.Millisecond, 5*time.Second, func() bool { return echo.resets.Load() != 0 }) {
		t.Fatalf("an in-window reset did not reach the backend: captured there %v\n%s", backendCap.find(toBackend), a.dump())
	}
	if st, _, _ := a.flowState(orig); st != "tcp_close" {
		t.Errorf("after an in-window reset the flow is %q, want tcp_close", st)
	}
	// The client still believes in the connection; its next data meets
	// the backend's reset, which comes back through the closed flow.
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = c.Write([]byte("after the reset"))
	if err == nil {
		_, err = c.Read(make([]byte, 64))
	}
	if !errors.Is(err, unix.ECONNRESET) {
		t.Errorf("the client's connection after the reset: %v, want a reset from the backend", err)
	}
}

// learnSeq waits for the client's delayed ACKs and reads, from what the
// client sent on the flow local->vip, its next sequence number and the
// acknowledgement it last sent. Resets are left out: the forged ones are
// captured too.
func learnSeq(t *testing.T, cap *sniffer, local, vip netip.AddrPort) (sndNxt, rcvNxt uint32) {
	t.Helper()
	time.Sleep(300 * time.Millisecond)
	segs := cap.find(func(g tcpSeg) bool { return g.out && g.src == local && g.dst == vip && g.flags&tcpRST == 0 })
	if len(segs) == 0 {
		t.Fatalf("captured nothing the client sent on %v->%v", local, vip)
	}
	sndNxt, rcvNxt = segs[0].end(), segs[0].ack
	for _, g := range segs[1:] {
		if int32(g.end()-sndNxt) > 0 {
			sndNxt = g.end()
		}
		if g.flags&tcpACK != 0 && int32(g.ack-rcvNxt) > 0 {
			rcvNxt = g.ack
		}
	}
	return sndNxt, rcvNxt
}

// sendTCPv4 sends one TCP segment without payload from src to dst through
// a raw socket in ns, as src's own stack would.
func sendTCPv4(t *testing.T, ns string, src, dst netip.AddrPort, seq, ack uint32, flags uint8) {
	t.Helper()
	p := make([]byte, 40)
	p[0] = 0x45
	binary.BigEndian.PutUint16(p[2:], 40)
	binary.BigEndian.PutUint16(p[6:], 0x4000) // DF
	p[8], p[9] = 64, 6
	s4, d4 := src.Addr().As4(), dst.Addr().As4()
	copy(p[12:], s4[:])
	copy(p[16:], d4[:])
	binary.BigEndian.PutUint16(p[10:], ^onesSum(p[:20], 0))
	tcp := p[20:]
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], seq)
	binary.BigEndian.PutUint32(tcp[8:], ack)
	tcp[12], tcp[13] = 5<<4, flags
	pseudo := onesSum(p[12:20], 6+uint32(len(tcp)))
	binary.BigEndian.PutUint16(tcp[16:], ^onesSum(tcp, uint32(pseudo)))
	err := testbed.DoIn(ns, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, p, 0, &unix.SockaddrInet4{Addr: d4})
	})
	if err != nil {
		t.Fatalf("sending a crafted segment from %s: %v", ns, err)
	}
}

// onesSum is the folded one's complement sum of b (big-endian words)
// added to s.
func onesSum(b []byte, s uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return uint16(s)
}

// spoofBase is the first spoofed source of the SYN flood; the flood's
// 16M flows take 65,512 source ports per address from there on
// (10.99.0.0 - 10.99.1.4). The node routes 10.99.0.0/16 to the client
// namespace, so the backends' answers leave the node as they would
// towards real hosts (and die in the client's namespace, which does not
// forward).
var spoofBase = netip.MustParseAddr("10.99.0.0")

// TestSYNFloodLocksNobodyOut proves that a SYN flood from spoofed
// addresses at synFloodRate cannot lock legitimate clients out of a NodePort whose backends
// answer, although it offers far more new flows than the connection table
// holds (4,096): established connections are assured and never dropped,
// so 10 connections opened before the flood keep working; unassured flows
// are dropped early to make room (counted), and the SYN guard then drops
// each tuple's first SYN in XDP and admits its retransmission, so at least
// 99% of 400 new connections made during the flood (20 at a time) succeed;
// and the table never holds more flows than its capacity.
func TestSYNFloodLocksNobodyOut(t *testing.T) {
	if raceDetector {
		// A flood at the generator's top rate against a daemon slowed
		// down by the race detector measures the detector; make test's
		// run without it is where this test counts.
		t.Skip("a line-rate flood against a race-instrumented daemon says nothing about xdproxy")
	}
	tb := newTopology(t, testbed.Options{})
	echo := startEchoServers(t, tb)
	if out, err := tb.Exec(tb.NodeNS(), "ip", "route", "add", "10.99.0.0/16", "via", tb.Client().Addr.String()); err != nil {
		t.Fatalf("route for the spoofed sources: %v %s", err, out)
	}
	np := echoSvc
	np.nodePort = 30070
	// The client is outside the cluster CIDR: NodePort flows are
	// masqueraded, so flood and legitimate flows share the SNAT ports too.
	a := newAgent(t, tb, serviceFile(np), agentOptions{clusterCIDR: "10.244.0.0/16", extraCfg: "conntrack: {maxEntries: 4096}\n"})
	target := netip.AddrPortFrom(tb.NodeClientSide().Addr, uint16(np.nodePort))

	// Before the flood: 10 connections, each with a first echo.
	type oldConn struct {
		c   *net.TCPConn
		off int64
	}
	var old []*oldConn
	for i := range 10 {
		c, err := dialFrom(tb, netip.Addr{}, target.String(), 10*time.Second)
		if err == nil {
			err = echoRound(c, 0, 512, 10*time.Second)
		}
		if err != nil {
			t.Fatalf("connection %d before the flood: %v\n%s", i, err, a.dump())
		}
		defer c.Close()
		old = append(old, &oldConn{c: c, off: 512})
	}
	exerciseOld := func(when string) {
		t.Helper()
		for i, o := range old {
			if err := echoRound(o.c, o.off, 512, 10*time.Second); err != nil {
				t.Fatalf("%s: connection %d opened before the flood: %v\n%s", when, i, err, a.dump())
			}
			o.off += 512
		}
	}
	before, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}

	// The flood, on CPU 1 (the workers run on CPU 0), and the table,
	// sampled all along. Both end before the test does, however it ends.
	stop := make(chan struct{})
	stopAll := sync.OnceFunc(func() { close(stop) })
	var flood pktgen.Result
	var floodErr error
	var sender atomic.Pointer[pktgen.AFXDPSender]
	flooded, watched := make(chan struct{}), make(chan struct{})
	defer func() {
		stopAll()
		<-flooded
		<-watched
	}()
	go func() {
		defer close(flooded)
		flood, floodErr = synFlood(tb, target, 1, &sender, stop)
	}()
	var maxLive, capacity atomic.Uint64
	var overfull atomic.Int64
	go func() {
		defer close(watched)
		for {
			if st, err := a.conntrackStats(); err == nil {
				capacity.Store(st.Capacity)
				if st.Live > maxLive.Load() {
					maxLive.Store(st.Live)
				}
				if st.Live > st.Capacity {
					overfull.Add(1)
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	// Wait until the flood has overrun the table.
	var st agentStats
	if !waitUntil(100*time.Millisecond, 20*time.Second, func() bool {
		var err error
		st, err = a.pressureStats()
		// Full and overrun: the SYN guard turned on, or (with the guard
		// off) four tables' worth of flows went in.
		if err == nil && st.Conntrack.EvictedUnassured > 0 &&
			(st.SYNGuard || st.Conntrack.Inserts-before.Conntrack.Inserts > 4*st.Conntrack.Capacity) {
			return true
		}
		select {
		case <-flooded:
			t.Fatalf("the flood ended early: %+v %v", flood, floodErr)
		default:
		}
		return false
	}) {
		t.Fatalf("the flood did not fill the table in 20s (%+v)\n%s", st.Conntrack, a.dump())
	}
	floodStart := time.Now()
	// The legitimate client's segments, for the report.
	clientCap := startSniffer(t, tb.ClientNS(), tb.Client().Addr)

	// New connections, 20 at a time: with the SYN guard on, each first
	// SYN is dropped and the client's retransmission a second later
	// admitted. Each may take 20 s (SYNs at 0, 1, 3, 7 and 15 s); the
	// phase ends early once more than 1% have failed, since the test has
	// failed then, and after 90 s. 400 of them: the 1% bound is then
	// judged on enough connections that one unlucky second (a few
	// clients' SYNs lost together) does not decide it.
	const newConns, parallel = 400, 20
	maxFailures := newConns - newConns*99/100
	var (
		mu       sync.Mutex
		ok       int
		tried    int
		failures []string
		lat      []time.Duration
		next     int
	)
	legitDeadline := time.Now().Add(90 * time.Second)
	var dialers sync.WaitGroup
	for range parallel {
		dialers.Add(1)
		go func() {
			defer dialers.Done()
			for {
				mu.Lock()
				i := next
				if i >= newConns || len(failures) > maxFailures || time.Now().After(legitDeadline) {
					mu.Unlock()
					return
				}
				next++
				tried++
				mu.Unlock()
				start := time.Now()
				c, err := dialFrom(tb, netip.Addr{}, target.String(), 20*time.Second)
				if err == nil {
					err = echoRound(c, 0, 256, 10*time.Second)
					c.Close()
				}
				mu.Lock()
				if err != nil {
					failures = append(failures, fmt.Sprintf("%d: %v", i, err))
				} else {
					ok++
					lat = append(lat, time.Since(start))
				}
				mu.Unlock()
			}
		}()
	}
	dialed := make(chan struct{})
	lastMatched := st.XDP["MatchFrontend"]
	go func() {
		dialers.Wait()
		close(dialed)
	}()
	for done := false; !done; {
		select {
		case <-time.After(2 * time.Second):
			exerciseOld("during the flood")
			// A timeline, for a failure's report.
			if st, err := a.pressureStats(); err == nil {
				t.Logf("after %v: %d frames to frontends redirected, %d first SYNs dropped, %d flows inserted, guard on %v",
					time.Since(floodStart).Round(time.Second), st.XDP["MatchFrontend"], st.XDP["SYNGuardDropped"], st.Conntrack.Inserts, st.SYNGuard)
				// More than 10,000 flood SYNs a second past the guard:
				// say which of the generator's flows got in, and how
				// long ago the generator last sent each.
				if admitted := st.XDP["MatchFrontend"] - lastMatched; st.SYNGuard && admitted > 20000 {
					t.Logf("%d frames past the guard in 2s; flood flows in the table: %s", admitted, admittedFloodFlows(a, sender.Load()))
				}
				lastMatched = st.XDP["MatchFrontend"]
			}
		case <-dialed:
			done = true
		}
	}
	guardDuring, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}
	during := time.Since(floodStart)
	stopAll()
	<-flooded
	<-watched
	if floodErr != nil {
		t.Fatalf("the flood: %v", floodErr)
	}
	exerciseOld("after the flood")
	after, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(lat)
	ct := after.Conntrack
	t.Logf("flood: %d SYNs in %v, %.0f per second (afxdp, 64-byte frames, 16M spoofed flows); legitimate connections ran during %v of it",
		flood.Sent, flood.Elapsed.Round(time.Millisecond), flood.Achieved, during.Round(time.Millisecond))
	if seen := after.XDP["MatchFrontend"] + after.XDP["SYNGuardDropped"] - before.XDP["MatchFrontend"] - before.XDP["SYNGuardDropped"]; seen < flood.Sent {
		t.Logf("%d of the flood's SYNs (%.2f%%) were lost before the node's XDP program saw them (its receive ring was full)",
			flood.Sent-seen, 100*float64(flood.Sent-seen)/float64(flood.Sent))
	}
	if len(lat) > 0 {
		t.Logf("new connections: %d of %d tried succeeded; connect+echo median %v, slowest %v", ok, tried,
			lat[len(lat)/2].Round(time.Microsecond), lat[len(lat)-1].Round(time.Millisecond))
	}
	t.Logf("SYN guard: on at the end of the flood %v; %d first SYNs dropped by the XDP program",
		guardDuring.SYNGuard, after.XDP["SYNGuardDropped"]-before.XDP["SYNGuardDropped"])
	t.Logf("table: capacity %d, most live %d; %d inserts, %d early drops (%d never answered), %d reused expired, %d full drops, %d SNAT exhausted",
		capacity.Load(), maxLive.Load(), ct.Inserts-before.Conntrack.Inserts, ct.EvictedUnassured, ct.EvictedUnreplied,
		ct.EvictedExpired, ct.FullDrops, ct.SNATExhausted)
	redirected := after.XDP["Redirected"] - before.XDP["Redirected"]
	received := after.Workers.RxFrames - before.Workers.RxFrames
	t.Logf("workers: received %d of the %d frames the XDP programs redirected to them (%.0f%%; the rest found a full receive ring), drops %v, %d failed writes of the XDP flow table; echo servers accepted %d connections",
		received, redirected, 100*float64(received)/float64(max(redirected, 1)), after.Workers.ByReason,
		after.Workers.FlowPublishErrors, echo.accepted.Load())
	resets := clientCap.find(func(g tcpSeg) bool {
		return g.out && g.flags&tcpRST != 0 && g.dst == target
	})
	if len(resets) > 0 {
		// The client resets only a segment that acknowledges nothing it
		// sent (RFC 9293, SYN-SENT): a backend answering its SYN for an
		// older, half-open connection on the same translated tuple.
		t.Logf("the client answered %d segments from the NodePort with a reset (first: %v); out-of-window drops: %d",
			len(resets), resets[0], after.Workers.ByReason["drop_out_of_window"])
	}
	if len(failures) > 0 {
		t.Logf("the client's connections that never saw their SYN answered, segment by segment:\n%s",
			unansweredSYNs(clientCap, target, floodStart))
		t.Logf("the client's unanswered flows as translated, and the backends' sockets on their translated tuples:\n%s",
			halfOpenAtBackends(tb, a, tb.Client().Addr))
	}
	if ok < newConns*99/100 {
		t.Errorf("%d of %d new connections succeeded during the flood (%d tried; the phase stops at %d failures or after 90s), failures: %v\n%s",
			ok, newConns, tried, maxFailures+1, failures, a.dump())
	} else if len(failures) > 0 {
		t.Logf("failed: %v", failures)
	}
	if n := overfull.Load(); n > 0 || maxLive.Load() > capacity.Load() {
		t.Errorf("the table held %d flows, over its capacity %d (%d samples over)", maxLive.Load(), capacity.Load(), n)
	}
	if ct.EvictedUnassured == 0 {
		t.Errorf("no early drops counted, though the flood opened %d flows in a table of %d", ct.Inserts-before.Conntrack.Inserts, ct.Capacity)
	}
	if !guardDuring.SYNGuard || after.XDP["SYNGuardDropped"] == before.XDP["SYNGuardDropped"] {
		t.Errorf("the SYN guard was not on during the flood (on: %v, dropped %d first SYNs)",
			guardDuring.SYNGuard, after.XDP["SYNGuardDropped"]-before.XDP["SYNGuardDropped"])
	}
	// A new connection after the flood.
	c, err := dialFrom(tb, netip.Addr{}, target.String(), 10*time.Second)
	if err == nil {
		err = echoRound(c, 0, 256, 10*time.Second)
		c.Close()
	}
	if err != nil {
		t.Errorf("a new connection after the flood: %v", err)
	}
}

// synFloodRate is the SYN flood's rate: 122 times the table's capacity a
// second. It is held below what the node's receive CPU, which the
// generator shares here, takes in: a flood faster than that overflows the
// interface's receive ring before any XDP program runs (seen here at 1
// Mpps: 7% of all frames lost there), and then the legitimate client's
// segments are lost with the flood's at random, which tests the ring,
// not xdproxy. A NIC has the same limit; RSS across queues is its remedy.
const synFloodRate = 500_000

// synFlood sends TCP SYNs from spoofed sources (spoofBase on, 16M flows) to
// dst through an AF_XDP socket on the client's interface at synFloodRate,
// on a thread pinned to cpu, until stop closes (at most 90 s).
func synFlood(tb *testbed.Testbed, dst netip.AddrPort, cpu int, sender *atomic.Pointer[pktgen.AFXDPSender], stop <-chan struct{}) (pktgen.Result, error) {
	var res pktgen.Result
	err := tb.Do(tb.ClientNS(), func() error {
		var prev, set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &prev); err != nil {
			return err
		}
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return err
		}
		// The thread goes back to the runtime afterwards.
		defer unix.SchedSetaffinity(0, &prev)
		tpl, err := pktgen.NewTemplate(pktgen.FrameSpec{
			Proto: pktgen.TCPSyn, Size: pktgen.MinFrameSize, Flows: pktgen.MaxFlows,
			SrcMAC: tb.Client().MAC, DstMAC: tb.NodeClientSide().MAC,
			Src: spoofBase, Dst: dst.Addr(), DstPort: dst.Port(),
		})
		if err != nil {
			return err
		}
		var s *pktgen.AFXDPSender
		// A socket on the queue closed a moment ago leaves it busy for
		// a while (FIELD-NOTES).
		for try := 0; ; try++ {
			s, err = pktgen.OpenAFXDP(tb.Client().IfIndex, 0, tpl)
			if err == nil || !errors.Is(err, unix.EBUSY) || try == 50 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			return err
		}
		defer s.Close()
		sender.Store(s)
		res, err = s.Send(pktgen.Budget{Rate: synFloodRate, Duration: 90 * time.Second}, stop)
		return err
	})
	return res, err
}

// admittedFloodFlows lists up to 10 of the connection table's flows from
// the flood's spoofed sources, each with how many frames ago the generator
// sent its tuple last (its flow index against the generator's position,
// modulo the flood's 16M flows).
func admittedFloodFlows(a *daemon, s *pktgen.AFXDPSender) string {
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil || s == nil {
		return fmt.Sprint(err)
	}
	next := s.Next()
	var b strings.Builder
	n := 0
	for _, f := range flows {
		ap, _, ok := tupleEnds(f.Original)
		if !ok || !ap.Addr().Is4() || ap.Addr().As4()[1] != spoofBase.As4()[1] || ap.Addr().As4()[0] != spoofBase.As4()[0] {
			continue
		}
		a4, base := ap.Addr().As4(), spoofBase.As4()
		host := uint64(binary.BigEndian.Uint32(a4[:]) - binary.BigEndian.Uint32(base[:]))
		flow := host*pktgen.SourcePorts + uint64(ap.Port()) - pktgen.FirstSourcePort
		ago := (next%pktgen.MaxFlows - flow + pktgen.MaxFlows) % pktgen.MaxFlows
		fmt.Fprintf(&b, "\n  %s %s: flow %d, sent %d frames ago", f.Original, f.State, flow, ago)
		if n++; n == 10 {
			break
		}
	}
	return b.String()
}

// halfOpenAtBackends lists the connection table's flows from client that
// are not established, each with what the backends' TCP stacks hold on its
// translated tuple, and how many half-open (SYN-RECV) sockets each backend
// has: a flood flow dropped early leaves one at its backend, and a later
// flow translated to the same tuple meets it.
func halfOpenAtBackends(tb *testbed.Testbed, a *daemon, client netip.Addr) string {
	var b strings.Builder
	for i := range tb.NumBackends() {
		out, _ := tb.Exec(tb.BackendNS(i), "sh", "-c", "ss -Htan state syn-recv | wc -l")
		fmt.Fprintf(&b, "  backend %d: %s half-open sockets\n", i, strings.TrimSpace(string(out)))
	}
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		return b.String() + err.Error()
	}
	n := 0
	for _, f := range flows {
		if src, _, ok := tupleEnds(f.Original); !ok || src.Addr() != client || f.State == "established" {
			continue
		}
		fmt.Fprintf(&b, "  %s => %s %s\n", f.Original, f.Translated, f.State)
		if s, d, ok := tupleEnds(f.Translated); ok {
			for i := range tb.NumBackends() {
				filter := fmt.Sprintf("( sport = :%d and dport = :%d )", d.Port(), s.Port())
				out, _ := tb.Exec(tb.BackendNS(i), "ss", "-Htanoi", "state", "all", filter)
				if o := strings.TrimSpace(string(out)); o != "" {
					fmt.Fprintf(&b, "    backend %d: %s\n", i, o)
				}
			}
		}
		if n++; n == 10 {
			break
		}
	}
	return b.String()
}

// dnsQuery is a DNS query for name, type A, with the given id.
func dnsQuery(id uint16, name string) []byte {
	q := binary.BigEndian.AppendUint16(nil, id)
	q = append(q, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0) // RD; one question
	for _, label := range bytes.Split([]byte(name), []byte(".")) {
		q = append(append(q, byte(len(label))), label...)
	}
	return append(q, 0, 0, 1, 0, 1) // root; type A, class IN
}

// TestDNSChurnNoLockout proves that a churn of short UDP flows far beyond
// the connection table's size cannot lock clients out: with a table of
// 1,024 entries, 5,000 DNS-shaped queries per second for 5 s, each from a
// new source port (a new flow), through a UDP cluster IP are at least 99%
// answered, answered flows are dropped early to make room (counted), and
// new queries are still answered at the end.
func TestDNSChurnNoLockout(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{extraCfg: "conntrack: {maxEntries: 1024}\n"})
	vip := &net.UDPAddr{IP: net.ParseIP(dnsSvc.clusterIP), Port: dnsSvc.port}
	client := tb.Client().Addr.AsSlice()
	const (
		rate      = 5000
		duration  = 5 * time.Second
		total     = rate * 5
		firstPort = 1024 // below the ephemeral ports: every query its own port
	)
	every := time.Second / rate
	before, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}
	// query sends one query from port and waits for its answer in a
	// goroutine of its own; answered reports it.
	var wg sync.WaitGroup
	var answered, sendErrs atomic.Int64
	var perSecond [16]atomic.Int64 // answered, by the second the query was sent
	query := func(i, port int, answered func()) error {
		c, err := net.DialUDP("udp4", &net.UDPAddr{IP: client, Port: port}, vip)
		if err != nil {
			return err
		}
		q := dnsQuery(uint16(i), "kubernetes.default.svc.cluster.local")
		if _, err := c.Write(q); err != nil {
			c.Close()
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 512)
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			if _, echoed, ok := bytes.Cut(buf[:n], []byte(" ")); ok && bytes.Equal(echoed, q) {
				answered()
			}
		}()
		return nil
	}
	var elapsed time.Duration
	// The queries are paced, at most maxBurst at once: a sender that fell
	// behind (this machine is shared) skips ahead rather than sending its
	// backlog in one burst, which would be a churn faster than 5,000 per
	// second (a burst larger than the table evicts flows whose answers
	// are still on the way).
	const maxBurst = 50 // 10 ms of queries
	var behind int
	err = tb.Do(tb.ClientNS(), func() error {
		start := time.Now()
		sched := start // when query i is due
		for i := 0; i < total; {
			if late := time.Since(sched); late > maxBurst*every {
				skip := late - maxBurst*every
				sched = sched.Add(skip)
				behind++
			}
			for ; i < total && !sched.After(time.Now()); i++ {
				sec := int(time.Since(start) / time.Second)
				if err := query(i, firstPort+i, func() { answered.Add(1); perSecond[min(sec, 15)].Add(1) }); err != nil {
					sendErrs.Add(1)
				}
				sched = sched.Add(every)
			}
			if d := time.Until(sched); d > 0 {
				time.Sleep(d)
			}
		}
		elapsed = time.Since(start)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	after, err := a.pressureStats()
	if err != nil {
		t.Fatal(err)
	}
	got := answered.Load()
	var secs []int64
	for s := range perSecond {
		if v := perSecond[s].Load(); v > 0 || s < 5 {
			secs = append(secs, v)
		}
	}
	ct := after.Conntrack
	t.Logf("%d queries in %v (%.0f per second; the sender fell behind and skipped ahead %d times), %d answered (%.2f%%), %d not sent; answered per second sent: %v",
		total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds(), behind, got, 100*float64(got)/total, sendErrs.Load(), secs)
	t.Logf("table: capacity %d, live %d; %d inserts, %d early drops (%d never answered), %d reused expired, %d full drops",
		ct.Capacity, ct.Live, ct.Inserts-before.Conntrack.Inserts, ct.EvictedUnassured, ct.EvictedUnreplied, ct.EvictedExpired, ct.FullDrops)
	t.Logf("workers: drops %v, %d failed writes of the XDP flow table", after.Workers.ByReason, after.Workers.FlowPublishErrors)
	if elapsed > duration*3/2 {
		t.Errorf("sending %d queries took %v: the client could not offer %d per second here, so the churn was not what this test is about", total, elapsed, rate)
	}
	if got < total*99/100 {
		t.Errorf("%d of %d queries answered, want at least 99%%\n%s", got, total, a.dump())
	}
	if ct.EvictedUnassured == 0 {
		t.Errorf("no early drops counted, though %d flows went through a table of %d", ct.Inserts-before.Conntrack.Inserts, ct.Capacity)
	}
	if ct.Live > ct.Capacity {
		t.Errorf("the table holds %d flows, over its capacity %d", ct.Live, ct.Capacity)
	}
	// New queries at the end, each from a new port, one after another.
	var late atomic.Int64
	err = tb.Do(tb.ClientNS(), func() error {
		for i := range 20 {
			if err := query(total+i, firstPort+total+i, func() { late.Add(1) }); err != nil {
				return err
			}
			wg.Wait()
		}
		return nil
	})
	if err != nil || late.Load() != 20 {
		t.Errorf("after the churn %d of 20 new queries were answered (%v)\n%s", late.Load(), err, a.dump())
	}
}

// unansweredSYNs lists, for each of the client's connections to target
// whose SYN no SYN-ACK acknowledged, its segments in both directions with
// their times since start (at most ten connections).
func unansweredSYNs(c *sniffer, target netip.AddrPort, start time.Time) string {
	byPort := map[netip.AddrPort][]tcpSeg{}
	var order []netip.AddrPort
	for _, g := range c.find(func(g tcpSeg) bool { return g.dst == target || g.src == target }) {
		local := g.src
		if !g.out {
			local = g.dst
		}
		if byPort[local] == nil {
			order = append(order, local)
		}
		byPort[local] = append(byPort[local], g)
	}
	var b strings.Builder
	shown := 0
	for _, local := range order {
		segs := byPort[local]
		var isn uint32
		synSeen, answered := false, false
		for _, g := range segs {
			switch {
			case g.out && g.flags&(tcpSYN|tcpACK) == tcpSYN:
				isn, synSeen = g.seq, true
			case !g.out && g.flags&(tcpSYN|tcpACK) == tcpSYN|tcpACK && synSeen && g.ack == isn+1:
				answered = true
			}
		}
		if !synSeen || answered {
			continue
		}
		if shown++; shown > 10 {
			break
		}
		for _, g := range segs {
			fmt.Fprintf(&b, "  %8v %v\n", g.at.Sub(start).Round(time.Millisecond), g)
		}
		b.WriteString("\n")
	}
	return b.String()
}
