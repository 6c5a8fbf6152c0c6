package xdp

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Verdicts of the program (enum xdp_action).
const (
	xdpDrop     = 1
	xdpPass     = 2
	xdpRedirect = 4
)

// rule is the outcome a frame should get: the counter it lands in.
type rule int

const (
	passed rule = iota
	parseFailed
	frontend
	flow
	fragment
	icmpError
)

var ruleNames = map[rule]string{passed: "passed", parseFailed: "parse_failed", frontend: "frontend",
	flow: "flow", fragment: "fragment", icmpError: "icmp_error"}

func (r rule) String() string { return ruleNames[r] }

// testFrontends and testVIPs are the frontends and VIP addresses of the
// tables every verdict case runs against.
var (
	testFrontends = func() []Key {
		a := packet.MustParseAddr
		return []Key{
			{a(vip4), 80, packet.ProtoTCP},
			{a(vip4), 53, packet.ProtoUDP},
			{a(node4), 30080, packet.ProtoTCP}, // a NodePort
			{a(vip6), 443, packet.ProtoTCP},
			{a(vip6), 53, packet.ProtoUDP},
		}
	}()
	testVIPs = []packet.Addr{packet.MustParseAddr(vip4), packet.MustParseAddr(vip6)} // node addresses are no VIPs
)

// testTables loads the tables every verdict case runs against:
// testFrontends, testVIPs and testFlows.
func testTables(t testing.TB, o *Objects) {
	t.Helper()
	if err := o.SetTables(testFrontends, testVIPs); err != nil {
		t.Fatal(err)
	}
	w := o.NewFlowWriter(len(testFlows))
	for _, k := range testFlows {
		if !w.Add(k) {
			t.Fatal("FlowWriter full")
		}
	}
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
}

// testFlows are the replies the verdict cases' tables expect, as they
// arrive: from an endpoint back to the client xdproxy forwarded for.
var testFlows = func() []FlowKey {
	a := packet.MustParseAddr
	return []FlowKey{
		{a(backend4), a(client4), 8080, 12345, packet.ProtoTCP},
		{a(backend4), a(client4), 5353, 5000, packet.ProtoUDP},
		{a(backend4), a(node4), 8080, 61001, packet.ProtoTCP},   // masqueraded
		{a(backend4), a(node4), 5353, 61002, packet.ProtoUDP},   // masqueraded
		{a(backend4), a(node4), 62000, 62000, packet.ProtoICMP}, // masqueraded echo
		{a(backend6), a(client6), 8443, 12345, packet.ProtoTCP},
		{a(backend6), a(node6), 8443, 61001, packet.ProtoTCP}, // masqueraded
		{a(backend4), a(client4), 777, 777, packet.ProtoICMP},
		{a(backend6), a(client6), 777, 777, packet.ProtoICMPv6},
	}
}()

type verdictCase struct {
	name  string
	frame []byte
	want  rule
}

func verdictCases(t testing.TB) []verdictCase {
	tcpTo := func(dst string, dport uint16) []byte { return tcp4(t, client4, 12345, dst, dport) }
	ip := ip4
	quoteTCP4 := func(src string, sport uint16, dst string, dport uint16) []byte {
		return ipPacket(t, ip(src, dst, layers.IPProtocolTCP), tcp(sport, dport))
	}
	quoteTCP6 := func(src string, sport uint16, dst string, dport uint16) []byte {
		return ipPacket(t, ip6(src, dst, layers.IPProtocolTCP), tcp(sport, dport))
	}
	laterPayload := gopacket.Payload(make([]byte, 64))

	return []verdictCase{
		// Frontends.
		{"tcp4 to cluster IP", tcpTo(vip4, 80), frontend},
		{"udp4 to cluster IP", udp4(t, client4, 5000, vip4, 53), frontend},
		{"tcp4 to node port", tcpTo(node4, 30080), frontend},
		{"tcp4 to cluster IP, other port", tcpTo(vip4, 81), passed},
		{"udp4 to a TCP frontend port", udp4(t, client4, 5000, vip4, 80), passed},
		{"tcp4 ssh to node", tcpTo(node4, 22), passed},
		{"tcp4 unrelated", tcp4(t, client4, 1000, remote4, 80), passed},
		{"tcp4 to cluster IP in VLAN", serialize(t, eth(layers.EthernetTypeDot1Q),
			&layers.Dot1Q{VLANIdentifier: 7, Type: layers.EthernetTypeIPv4},
			ip4(client4, vip4, layers.IPProtocolTCP), tcp(12345, 80)), frontend},
		{"tcp4 to cluster IP with IP options", func() []byte {
			h := ip4(client4, vip4, layers.IPProtocolTCP)
			h.Options = []layers.IPv4Option{{OptionType: 148, OptionLength: 4, OptionData: []byte{0, 0}}}
			return serialize(t, eth(layers.EthernetTypeIPv4), h, tcp(12345, 80))
		}(), frontend},
		{"tcp6 to cluster IP", tcp6(t, client6, 12345, vip6, 443), frontend},
		{"udp6 to cluster IP", udp6(t, client6, 5000, vip6, 53), frontend},
		{"tcp6 unrelated", tcp6(t, client6, 12345, remote6, 443), passed},

		// Replies xdproxy expects: exactly a tuple in flows.
		{"tcp4 reply in flows", tcp4(t, backend4, 8080, client4, 12345), flow},
		{"udp4 reply in flows", udp4(t, backend4, 5353, client4, 5000), flow},
		{"tcp6 reply in flows", tcp6(t, backend6, 8443, client6, 12345), flow},
		{"echo4 reply in flows", echo4(t, backend4, client4, 0, 777), flow},
		{"echo6 reply in flows", echo6(t, backend6, client6, 129, 777), flow},
		// From an endpoint but no reply to xdproxy: a client that
		// talks to the pod directly, not through a service.
		{"tcp4 from backend, other client port", tcp4(t, backend4, 8080, client4, 23456), passed},
		{"tcp4 from backend, other client", tcp4(t, backend4, 8080, remote4, 12345), passed},
		{"udp4 from backend, other client port", udp4(t, backend4, 5353, client4, 5001), passed},
		{"tcp6 from backend, other client port", tcp6(t, backend6, 8443, client6, 23456), passed},
		{"tcp4 from backend, other port", tcp4(t, backend4, 9999, client4, 12345), passed},
		{"tcp4 with the ports of a UDP flow", tcp4(t, backend4, 5353, client4, 5000), passed},
		{"tcp4 the other way of a flow", tcp4(t, client4, 12345, backend4, 8080), passed},
		{"echo4 reply from backend, other id", echo4(t, backend4, client4, 0, 778), passed},
		{"echo6 reply from backend, other id", echo6(t, backend6, client6, 129, 778), passed},

		// Masqueraded flows: their replies are in flows like any other.
		{"tcp4 reply of a masqueraded flow", tcp4(t, backend4, 8080, node4, 61001), flow},
		{"udp4 reply of a masqueraded flow", udp4(t, backend4, 5353, node4, 61002), flow},
		{"echo4 reply of a masqueraded echo", echo4(t, backend4, node4, 0, 62000), flow},
		{"tcp6 reply of a masqueraded flow", tcp6(t, backend6, 8443, node6, 61001), flow},
		{"echo4 request to node with a masqueraded echo's id", echo4(t, backend4, node4, 8, 62000), passed},

		// The node's own traffic, on any port: replies to its own
		// connections (ephemeral ports, the old SNAT range, our SNAT
		// range), pings, services it listens on. None is in flows.
		{"tcp4 reply to the node's ephemeral port", tcp4(t, remote4, 443, node4, 40000), passed},
		{"tcp4 reply to the node, ephemeral range start", tcp4(t, remote4, 443, node4, 32768), passed},
		{"tcp4 reply to the node in our SNAT range", tcp4(t, remote4, 443, node4, 61001), passed},
		{"tcp4 from a backend to the node, other port", tcp4(t, backend4, 8080, node4, 61003), passed},
		{"udp4 dns reply to the node", udp4(t, remote4, 53, node4, 45000), passed},
		{"udp6 dns reply to the node", udp6(t, remote6, 53, node6, 45000), passed},
		{"tcp6 reply to the node's ephemeral port", tcp6(t, remote6, 443, node6, 40001), passed},
		{"echo4 reply to the node", echo4(t, remote4, node4, 0, 41000), passed},
		{"echo4 request to node", echo4(t, client4, node4, 8, 100), passed},
		{"echo6 reply to the node", echo6(t, remote6, node6, 129, 41000), passed},
		{"echo6 request to node", echo6(t, client6, node6, 128, 41000), passed},
		{"tcp4 to the node's kubelet", tcpTo(node4, 10250), passed},

		// Fragments: a later fragment follows a first fragment the
		// program redirected (same src, dst, id, protocol); with its
		// head unseen, only a fragment to a VIP is ours.
		{"ipv4 first fragment to cluster IP", frag4(t, client4, vip4, 0, true, tcp(12345, 80)), frontend},
		{"ipv4 later fragment of it", frag4(t, client4, vip4, 1480, true, laterPayload), fragment},
		{"ipv4 last fragment of it", frag4(t, client4, vip4, 2960, false, laterPayload), fragment},
		{"ipv4 later fragment to VIP, head unseen", frag4ID(t, 78, client4, vip4, 1480, false, laterPayload), fragment},
		{"ipv4 first fragment to a node port", frag4ID(t, 79, client4, node4, 0, true, tcp(12345, 30080)), frontend},
		{"ipv4 later fragment to the node port", frag4ID(t, 79, client4, node4, 1480, false, laterPayload), fragment},
		{"ipv4 later fragment to node, head unseen", frag4ID(t, 80, client4, node4, 1480, false, laterPayload), passed},
		{"ipv4 first fragment of a reply in flows", frag4ID(t, 81, backend4, client4, 0, true, tcp(8080, 12345)), flow},
		{"ipv4 later fragment of that reply", frag4ID(t, 81, backend4, client4, 1480, false, laterPayload), fragment},
		{"ipv4 later fragment from backend, head unseen", frag4ID(t, 82, backend4, client4, 1480, false, laterPayload), passed},
		{"ipv4 later fragment, other id than a seen head", frag4ID(t, 83, client4, node4, 1480, false, laterPayload), passed},
		{"ipv4 first fragment of node traffic", frag4ID(t, 84, remote4, node4, 0, true, tcp(443, 40000)), passed},
		{"ipv4 later fragment of node traffic", frag4ID(t, 84, remote4, node4, 1480, false, laterPayload), passed},
		{"ipv4 later fragment unrelated", frag4(t, client4, remote4, 1480, false, laterPayload), passed},
		{"ipv6 first fragment to cluster IP", frag6(t, client6, vip6, layers.IPProtocolUDP, 0, true, udp(5000, 53)), frontend},
		{"ipv6 later fragment of it", frag6(t, client6, vip6, layers.IPProtocolUDP, 1448, false, laterPayload), fragment},
		{"ipv6 later fragment to VIP, head unseen", frag6ID(t, 7, client6, vip6, layers.IPProtocolUDP, 1448, false, laterPayload), fragment},
		{"ipv6 first fragment of a reply in flows", frag6ID(t, 8, backend6, client6, layers.IPProtocolTCP, 0, true, tcp(8443, 12345)), flow},
		{"ipv6 later fragment of that reply", frag6ID(t, 8, backend6, client6, layers.IPProtocolTCP, 1448, true, laterPayload), fragment},
		{"ipv6 later fragment from backend, head unseen", frag6ID(t, 9, backend6, client6, layers.IPProtocolTCP, 1448, true, laterPayload), passed},
		{"ipv6 later fragment unrelated", frag6(t, client6, remote6, layers.IPProtocolUDP, 1448, false, laterPayload), passed},

		// ICMP errors: ours when the quoted packet is one xdproxy sent,
		// i.e. its reverse is in flows, or it came from a frontend.
		{"icmp4 unreachable about a packet to a backend", icmpErr4(t, client4, 3, 3, quoteTCP4(client4, 12345, backend4, 8080)), icmpError},
		{"icmp4 frag needed about a masqueraded packet", icmpErr4(t, router4, 3, 4, quoteTCP4(node4, 61001, backend4, 8080)), icmpError},
		{"icmp4 time exceeded about a reply from a VIP", icmpErr4(t, router4, 11, 0, quoteTCP4(vip4, 80, client4, 12345)), icmpError},
		{"icmp4 time exceeded about a reply from a node port", icmpErr4(t, router4, 11, 0, quoteTCP4(node4, 30080, client4, 12345)), icmpError},
		{"icmp4 param problem about a masqueraded udp packet", icmpErr4(t, router4, 12, 0,
			ipPacket(t, ip(node4, backend4, layers.IPProtocolUDP), udp(61002, 5353))), icmpError},
		{"icmp4 unreachable about a masqueraded echo", icmpErr4(t, router4, 3, 1,
			ipPacket(t, ip(node4, backend4, layers.IPProtocolICMPv4), &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0), Id: 62000})), icmpError},
		{"icmp4 unreachable about a packet to a VIP", icmpErr4(t, router4, 3, 1, quoteTCP4(client4, 12345, vip4, 80)), passed},
		{"icmp4 unreachable about a direct packet to a backend", icmpErr4(t, router4, 3, 3, quoteTCP4(client4, 23456, backend4, 8080)), passed},
		{"icmp4 frag needed about the node's own connection", icmpErr4(t, router4, 3, 4, quoteTCP4(node4, 40000, remote4, 443)), passed},
		{"icmp4 frag needed about the node's connection from our SNAT range", icmpErr4(t, router4, 3, 4, quoteTCP4(node4, 61001, remote4, 443)), passed},
		{"icmp4 unreachable about node ssh", icmpErr4(t, node4, 3, 3, quoteTCP4(node4, 22, client4, 5555)), passed},
		{"icmp4 unreachable about the node's udp dns query", icmpErr4(t, router4, 3, 3,
			ipPacket(t, ip(node4, remote4, layers.IPProtocolUDP), udp(45000, 53))), passed},
		{"icmp4 redirect quoting a masqueraded packet", icmpErr4(t, router4, 5, 0, quoteTCP4(node4, 61001, backend4, 8080)), passed},
		{"icmp4 error with quote cut short", icmpErr4(t, router4, 3, 4, quoteTCP4(node4, 61001, backend4, 8080)[:22]), passed},
		{"icmp4 error quoting a later fragment", icmpErr4(t, router4, 11, 1, edit(quoteTCP4(client4, 12345, backend4, 8080), func(b []byte) []byte {
			b[6], b[7] = 0, 10
			return b
		})), passed},
		{"icmp4 error in a fragment", edit(icmpErr4(t, router4, 3, 4, quoteTCP4(node4, 61001, backend4, 8080)), func(b []byte) []byte {
			b[14+6] |= 0x20 // more fragments
			return b
		}), passed},
		{"icmp6 too big about a masqueraded packet", icmpErr6(t, router6, 2, 0, quoteTCP6(node6, 61001, backend6, 8443)), icmpError},
		{"icmp6 unreachable about a packet to a backend", icmpErr6(t, client6, 1, 4, quoteTCP6(client6, 12345, backend6, 8443)), icmpError},
		{"icmp6 time exceeded about a reply from a VIP", icmpErr6(t, router6, 3, 0, quoteTCP6(vip6, 443, client6, 12345)), icmpError},
		{"icmp6 too big about the node's own connection", icmpErr6(t, router6, 2, 0, quoteTCP6(node6, 40001, remote6, 443)), passed},
		{"icmp6 unreachable about node traffic", icmpErr6(t, node6, 1, 4, quoteTCP6(node6, 22, client6, 5555)), passed},
		{"icmp6 neighbour solicitation", serialize(t, eth(layers.EthernetTypeIPv6), ip6(client6, node6, layers.IPProtocolICMPv6),
			&layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(135, 0)}, gopacket.Payload(make([]byte, 20))), passed},

		// Not IP, or IP xdproxy does not handle.
		{"arp", arp(t), passed},
		{"two VLAN tags", serialize(t, eth(layers.EthernetTypeQinQ),
			&layers.Dot1Q{VLANIdentifier: 7, Type: layers.EthernetTypeDot1Q},
			&layers.Dot1Q{VLANIdentifier: 8, Type: layers.EthernetTypeIPv4},
			ip4(client4, vip4, layers.IPProtocolTCP), tcp(12345, 80)), passed},
		{"ipv6 hop-by-hop header to cluster IP", serialize(t, eth(layers.EthernetTypeIPv6),
			ip6(client6, vip6, layers.IPProtocolIPv6HopByHop),
			gopacket.Payload(append([]byte{byte(layers.IPProtocolTCP), 0, 1, 4, 0, 0, 0, 0}, ipPacket(t, tcp(12345, 443))...))), passed},
		{"icmpv4 inside ipv6", serialize(t, eth(layers.EthernetTypeIPv6), ip6(remote6, node6, layers.IPProtocolICMPv4),
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(0, 0), Id: 41000}), passed},
		{"gre to VIP", serialize(t, eth(layers.EthernetTypeIPv4), ip4(client4, vip4, layers.IPProtocolGRE), gopacket.Payload(make([]byte, 8))), passed},

		// Malformed: passed and counted.
		{"ethernet header only", tcpTo(vip4, 80)[:14], parseFailed},
		{"vlan tag cut", serialize(t, eth(layers.EthernetTypeDot1Q), gopacket.Payload([]byte{0, 7}))[:16], parseFailed}, // gopacket pads to 60 bytes
		{"ipv4 header cut", tcpTo(vip4, 80)[:14+19], parseFailed},
		{"ipv4 version 6", edit(tcpTo(vip4, 80), func(b []byte) []byte { b[14] = 0x65; return b }), parseFailed},
		{"ipv4 ihl 4", edit(tcpTo(vip4, 80), func(b []byte) []byte { b[14] = 0x44; return b }), parseFailed},
		{"ipv4 ihl beyond frame", edit(tcpTo(vip4, 80), func(b []byte) []byte { b[14] = 0x4f; return b[:14+40] }), parseFailed},
		{"tcp4 header cut", tcpTo(vip4, 80)[:14+20+19], parseFailed},
		{"udp4 header cut", udp4(t, client4, 5000, vip4, 53)[:14+20+7], parseFailed},
		{"icmp4 header cut", echo4(t, remote4, node4, 0, 41000)[:14+20+7], parseFailed},
		{"ipv6 header cut", tcp6(t, client6, 12345, vip6, 443)[:14+39], parseFailed},
		{"ipv6 version 4", edit(tcp6(t, client6, 12345, vip6, 443), func(b []byte) []byte { b[14] = 0x40; return b }), parseFailed},
		{"ipv6 fragment header cut", frag6(t, client6, vip6, layers.IPProtocolUDP, 0, true, udp(5000, 53))[:14+40+7], parseFailed},
		{"tcp6 header cut", tcp6(t, client6, 12345, vip6, 443)[:14+40+19], parseFailed},
	}
}

// newTestInstance loads the program with the test tables, not attached.
func newTestInstance(t testing.TB) (*Objects, *Attachment) {
	t.Helper()
	requireRoot(t)
	o, err := Load(Options{MaxFrontends: 64, MaxAddrs: 64, MaxFlows: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	testTables(t, o)
	inst, err := o.newInstance(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.close() })
	// An Attachment without a link: RegisterSocket works on it, and
	// BPF_PROG_RUN needs no interface.
	return o, &Attachment{ifname: "test", inst: inst}
}

func (c Counters) minus(d Counters) Counters {
	return Counters{
		Redirected: c.Redirected - d.Redirected, Passed: c.Passed - d.Passed,
		NoSocket: c.NoSocket - d.NoSocket, ParseFailed: c.ParseFailed - d.ParseFailed,
		MatchFrontend: c.MatchFrontend - d.MatchFrontend, MatchFlow: c.MatchFlow - d.MatchFlow,
		MatchFragment: c.MatchFragment - d.MatchFragment, MatchICMPError: c.MatchICMPError - d.MatchICMPError,
		FragTrackFailed: c.FragTrackFailed - d.FragTrackFailed,
		SYNGuardDropped: c.SYNGuardDropped - d.SYNGuardDropped,
	}
}

// wantCounters is the counter change one frame under rule r causes.
func wantCounters(r rule, socket bool) Counters {
	var c Counters
	switch r {
	case passed:
		c.Passed = 1
		return c
	case parseFailed:
		c.ParseFailed = 1
		return c
	case frontend:
		c.MatchFrontend = 1
	case flow:
		c.MatchFlow = 1
	case fragment:
		c.MatchFragment = 1
	case icmpError:
		c.MatchICMPError = 1
	}
	if socket {
		c.Redirected = 1
	} else {
		c.NoSocket = 1
	}
	return c
}

// runFrame runs the program once on frame and returns its verdict and the
// counter change.
func runFrame(t testing.TB, o *Objects, a *Attachment, frame []byte) (uint32, Counters) {
	t.Helper()
	before, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	ret, err := a.inst.prog.Run(&ebpf.RunOptions{Data: frame})
	if err != nil {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	after, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	return ret, after.minus(before)
}

// xskSocket opens an AF_XDP socket. The XSKMAP accepts it unbound, which
// is all BPF_PROG_RUN needs: the redirect target is only looked up.
func xskSocket(t testing.TB) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_XDP, unix.SOCK_RAW, 0)
	if err != nil {
		t.Fatalf("AF_XDP socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func TestVerdicts(t *testing.T) {
	o, a := newTestInstance(t)
	cases := verdictCases(t)
	for _, socket := range []bool{false, true} {
		if socket {
			if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range cases {
			name := c.name
			if socket {
				name += " (socket)"
			}
			t.Run(name, func(t *testing.T) {
				ret, got := runFrame(t, o, a, c.frame)
				want := uint32(xdpPass)
				if c.want != passed && c.want != parseFailed {
					// Ours: into the socket, or dropped while there
					// is none (never to the kernel, which would reset
					// the connection).
					want = xdpDrop
					if socket {
						want = xdpRedirect
					}
				}
				if ret != want {
					t.Errorf("verdict %d, want %d (%v)", ret, want, c.want)
				}
				if w := wantCounters(c.want, socket); got != w {
					t.Errorf("counters changed by %+v, want %+v (%v)", got, w, c.want)
				}
			})
		}
	}
	if err := a.UnregisterSocket(0); err != nil {
		t.Fatal(err)
	}
	ret, got := runFrame(t, o, a, verdictCases(t)[0].frame)
	if ret != xdpDrop || got != wantCounters(frontend, false) {
		t.Errorf("after UnregisterSocket: verdict %d, counters %+v; want drop and no_socket", ret, got)
	}
}

// TestTruncatedFrames runs every case cut at every length the kernel lets
// BPF_PROG_RUN take (an Ethernet header and up): each must give a verdict
// and land in exactly one of the four outcome counters.
func TestTruncatedFrames(t *testing.T) {
	o, a := newTestInstance(t)
	if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	runs := 0
	for _, c := range verdictCases(t) {
		for n := 14; n < len(c.frame); n++ {
			ret, got := runFrame(t, o, a, c.frame[:n])
			if ret != xdpPass && ret != xdpRedirect && ret != xdpDrop {
				t.Fatalf("%s cut to %d bytes: verdict %d", c.name, n, ret)
			}
			if sum := got.Redirected + got.Passed + got.NoSocket + got.ParseFailed; sum != 1 {
				t.Fatalf("%s cut to %d bytes: counters %+v", c.name, n, got)
			}
			runs++
		}
	}
	t.Logf("%d truncated frames", runs)
}
