package dataplane

import (
	"net"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

var (
	addr     = packet.MustParseAddr
	nodeAddr = addr("198.18.1.1")
	podA     = addr("198.18.0.2") // inside the cluster CIDR: a pod
	outside  = addr("203.0.113.7")
)

// testModel is the services of the packet-flow table below.
func testModel() *service.Model {
	ep := func(a string, port uint16, node string) service.Endpoint {
		return service.Endpoint{Addr: addr(a), Port: port, Ready: true, Serving: true, NodeName: node}
	}
	return &service.Model{
		Node: service.Node{Name: "node-1", Addresses: []packet.Addr{nodeAddr}},
		Ports: []service.ServicePort{
			{Name: service.PortName{Namespace: "default", Name: "web", Port: "http"}, Proto: packet.ProtoTCP,
				ClusterIPs: []packet.Addr{addr("198.19.0.10")}, Port: 80, NodePort: 30080,
				Endpoints: []service.Endpoint{ep("198.18.1.11", 8080, "node-1"), ep("198.18.1.12", 8080, "node-2")}},
			{Name: service.PortName{Namespace: "default", Name: "dns"}, Proto: packet.ProtoUDP,
				ClusterIPs: []packet.Addr{addr("198.19.0.20")}, Port: 53,
				Endpoints: []service.Endpoint{ep("198.18.1.13", 5353, "node-1")}},
			{Name: service.PortName{Namespace: "default", Name: "empty-tcp"}, Proto: packet.ProtoTCP,
				ClusterIPs: []packet.Addr{addr("198.19.0.30")}, Port: 80},
			{Name: service.PortName{Namespace: "default", Name: "empty-udp"}, Proto: packet.ProtoUDP,
				ClusterIPs: []packet.Addr{addr("198.19.0.31")}, Port: 53},
			{Name: service.PortName{Namespace: "default", Name: "local-lb"}, Proto: packet.ProtoTCP,
				ClusterIPs: []packet.Addr{addr("198.19.0.40")}, Port: 80, ExternalPolicyLocal: true,
				LoadBalancerIPs: []packet.Addr{addr("198.19.1.40")},
				Endpoints:       []service.Endpoint{ep("198.18.1.12", 80, "node-2")}},
			{Name: service.PortName{Namespace: "default", Name: "ranged-lb"}, Proto: packet.ProtoTCP,
				ClusterIPs: []packet.Addr{addr("198.19.0.50")}, Port: 443,
				LoadBalancerIPs: []packet.Addr{addr("198.19.1.50")},
				SourceRanges:    []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")},
				Endpoints:       []service.Endpoint{ep("198.18.1.11", 8443, "node-1")}},
		},
	}
}

type harness struct {
	proc *Processor
	ct   *conntrack.Table
	cur  *service.Current
}

func newHarness(t testing.TB, m *service.Model, capacity int) *harness {
	t.Helper()
	ct, err := conntrack.New(conntrack.Config{Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	cur := &service.Current{}
	cur.Store(service.Compile(m, service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}}))
	proc := NewProcessor(ProcessorConfig{
		Services: cur, Conntrack: ct, Affinity: service.NewAffinity(1024),
		SNATPorts:  conntrack.PortRange{First: 40000, Last: 40999},
		SNATSource: func(packet.Addr) (packet.Addr, bool) { return nodeAddr, true },
		Seed:       42,
	})
	proc.BeginBatch(1)
	return &harness{proc: proc, ct: ct, cur: cur}
}

// frame builds an Ethernet/IPv4 frame with valid checksums.
func frame(t testing.TB, proto packet.Proto, src, dst packet.Addr, sport, dport uint16, tcpFlags uint8, payload []byte) []byte {
	t.Helper()
	return frameWithOptions(t, proto, src, dst, sport, dport, tcpFlags, payload, nil)
}

// frameWithOptions is frame with TCP options.
func frameWithOptions(t testing.TB, proto packet.Proto, src, dst packet.Addr, sport, dport uint16, tcpFlags uint8, payload []byte,
	opts []layers.TCPOption) []byte {
	t.Helper()
	ip := &layers.IPv4{Version: 4, TTL: 64, Id: 1, SrcIP: net.IP(src.Netip().AsSlice()), DstIP: net.IP(dst.Netip().AsSlice())}
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, EthernetType: layers.EthernetTypeIPv4}
	var l4 gopacket.SerializableLayer
	switch proto {
	case packet.ProtoTCP:
		ip.Protocol = layers.IPProtocolTCP
		tcp := &layers.TCP{SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(dport), Seq: 100, Window: 1000,
			SYN: tcpFlags&packet.TCPSyn != 0, ACK: tcpFlags&packet.TCPAck != 0, FIN: tcpFlags&packet.TCPFin != 0, RST: tcpFlags&packet.TCPRst != 0,
			Options: opts}
		_ = tcp.SetNetworkLayerForChecksum(ip)
		l4 = tcp
	case packet.ProtoUDP:
		ip.Protocol = layers.IPProtocolUDP
		udp := &layers.UDP{SrcPort: layers.UDPPort(sport), DstPort: layers.UDPPort(dport)}
		_ = udp.SetNetworkLayerForChecksum(ip)
		l4 = udp
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		eth, ip, l4, gopacket.Payload(payload)); err != nil {
		t.Fatal(err)
	}
	// Give the frame the capacity of a UMEM frame, as a worker does.
	out := make([]byte, len(buf.Bytes()), 2048)
	copy(out, buf.Bytes())
	return out
}

// synWithWScale is frame for a TCP SYN that carries the window scale
// option (shift) after a no-op.
func synWithWScale(t testing.TB, src, dst packet.Addr, sport, dport uint16, shift uint8) []byte {
	t.Helper()
	return frameWithOptions(t, packet.ProtoTCP, src, dst, sport, dport, packet.TCPSyn, nil, []layers.TCPOption{
		{OptionType: layers.TCPOptionKindNop},
		{OptionType: layers.TCPOptionKindWindowScale, OptionLength: 3, OptionData: []byte{shift}}})
}

func parse(t testing.TB, f []byte) packet.Packet {
	t.Helper()
	var p packet.Packet
	if r := packet.Parse(f, &p); r != packet.OK {
		t.Fatalf("output does not parse: %v", r)
	}
	if !nat.ValidIPHeader(f, &p) || !nat.ValidL4(f, &p) {
		t.Fatalf("output has a bad checksum: %x", f)
	}
	return p
}

// TestPacketFlows traces packets through the real Process, in the style of
// kube-proxy's packet-flow tests.
func TestPacketFlows(t *testing.T) {
	web := []packet.Addr{addr("198.18.1.11"), addr("198.18.1.12")}
	cases := []struct {
		name     string
		src      packet.Addr
		proto    packet.Proto
		dst      string
		port     uint16
		action   Action
		reason   packet.Reason
		backends []packet.Addr // one of these, after DNAT
		masq     bool
	}{
		{"pod to cluster IP", podA, packet.ProtoTCP, "198.19.0.10", 80, Forward, packet.OK, web, false},
		{"off-cluster client to cluster IP is masqueraded", outside, packet.ProtoTCP, "198.19.0.10", 80, Forward, packet.OK, web, true},
		{"cluster IP, wrong port", podA, packet.ProtoTCP, "198.19.0.10", 81, Pass, packet.PassNoService, nil, false},
		{"cluster IP, wrong protocol", podA, packet.ProtoUDP, "198.19.0.10", 80, Pass, packet.PassNoService, nil, false},
		{"udp cluster IP", podA, packet.ProtoUDP, "198.19.0.20", 53, Forward, packet.OK, []packet.Addr{addr("198.18.1.13")}, false},
		{"node port masquerades", outside, packet.ProtoTCP, "198.18.1.1", 30080, Forward, packet.OK, web, true},
		{"no endpoints, tcp: reset", podA, packet.ProtoTCP, "198.19.0.30", 80, Reply, packet.DropNoBackend, nil, false},
		{"no endpoints, udp: port unreachable", podA, packet.ProtoUDP, "198.19.0.31", 53, Reply, packet.DropNoBackend, nil, false},
		{"policy Local, no local endpoint: drop", outside, packet.ProtoTCP, "198.19.1.40", 80, Drop, packet.DropNoBackend, nil, false},
		{"policy Local, pod short-circuits to cluster list", podA, packet.ProtoTCP, "198.19.1.40", 80, Forward, packet.OK, []packet.Addr{addr("198.18.1.12")}, false},
		{"source range admits", outside, packet.ProtoTCP, "198.19.1.50", 443, Forward, packet.OK, []packet.Addr{addr("198.18.1.11")}, true},
		{"source range refuses", addr("192.0.2.9"), packet.ProtoTCP, "198.19.1.50", 443, Drop, packet.DropSourceRange, nil, false},
		{"not a service", podA, packet.ProtoTCP, "198.18.1.11", 22, Pass, packet.PassNoService, nil, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, testModel(), 4096)
			sport := uint16(50000 + i)
			f := frame(t, c.proto, c.src, addr(c.dst), sport, c.port, packet.TCPSyn, []byte("hello"))
			v := h.proc.Process(f, 1)
			if v.Action != c.action || (c.action != Forward && v.Reason != c.reason) {
				t.Fatalf("verdict %v/%v, want %v/%v", v.Action, v.Reason, c.action, c.reason)
			}
			switch v.Action {
			case Forward:
				p := parse(t, f[:v.Len])
				found := false
				for _, b := range c.backends {
					found = found || p.Dst == b
				}
				if !found || h.proc.Destination() != p.Dst {
					t.Fatalf("sent to %v (next hop %v), want one of %v", p.Dst, h.proc.Destination(), c.backends)
				}
				if masq := p.Src == nodeAddr; masq != c.masq {
					t.Fatalf("source %v:%d, masquerade %v, want %v", p.Src, p.SrcPort, masq, c.masq)
				}
				if !c.masq && p.SrcPort != sport {
					t.Fatalf("source port changed without masquerade")
				}
			case Reply:
				p := parse(t, f[:v.Len])
				if p.Dst != c.src || h.proc.Destination() != c.src || p.Src != addr(c.dst) {
					t.Fatalf("reply %v -> %v, want %v -> %v", p.Src, p.Dst, c.dst, c.src)
				}
				if c.proto == packet.ProtoTCP && p.TCPFlags&packet.TCPRst == 0 {
					t.Fatalf("reply is not a reset")
				}
				if c.proto == packet.ProtoUDP && (p.Proto != packet.ProtoICMP || p.ICMPType != packet.ICMPv4DestUnreach || p.ICMPCode != 3) {
					t.Fatalf("reply is not port unreachable: %+v", p)
				}
			}
		})
	}
}

// TestReplyDirection checks that the backend's answer finds its flow and is
// translated back to VIP -> client, with and without masquerade.
func TestReplyDirection(t *testing.T) {
	for _, client := range []packet.Addr{podA, outside} {
		h := newHarness(t, testModel(), 4096)
		vip := addr("198.19.0.10")
		f := frame(t, packet.ProtoTCP, client, vip, 41000, 80, packet.TCPSyn, nil)
		v := h.proc.Process(f, 1)
		out := parse(t, f[:v.Len])
		reply := frame(t, packet.ProtoTCP, out.Dst, out.Src, out.DstPort, out.SrcPort, packet.TCPSyn|packet.TCPAck, nil)
		v = h.proc.Process(reply, 2)
		if v.Action != Forward {
			t.Fatalf("reply verdict %v/%v", v.Action, v.Reason)
		}
		back := parse(t, reply[:v.Len])
		if back.Src != vip || back.SrcPort != 80 || back.Dst != client || back.DstPort != 41000 || h.proc.Destination() != client {
			t.Fatalf("reply became %v:%d -> %v:%d", back.Src, back.SrcPort, back.Dst, back.DstPort)
		}
		// The flow is established now: the next client packet keeps its backend.
		f2 := frame(t, packet.ProtoTCP, client, vip, 41000, 80, packet.TCPAck, []byte("GET /"))
		v = h.proc.Process(f2, 3)
		again := parse(t, f2[:v.Len])
		if again.Dst != out.Dst || again.Src != out.Src || again.SrcPort != out.SrcPort {
			t.Fatalf("second packet translated differently: %v:%d->%v vs %v:%d->%v", again.Src, again.SrcPort, again.Dst, out.Src, out.SrcPort, out.Dst)
		}
	}
}

// TestICMPErrorFromBackendPath: fragmentation needed from a router between
// node and backend reaches the client quoting the packet the client sent.
func TestICMPErrorFromBackendPath(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	vip := addr("198.19.0.10")
	f := frame(t, packet.ProtoTCP, outside, vip, 42000, 80, packet.TCPSyn, nil)
	v := h.proc.Process(f, 1)
	sent := parse(t, f[:v.Len])
	// The router quotes the translated packet (IP header + 8 bytes).
	quote := append([]byte(nil), f[sent.L3:sent.L4+8]...)
	router := addr("198.18.1.254")
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolICMPv4,
		SrcIP: net.IP(router.Netip().AsSlice()), DstIP: net.IP(sent.Src.Netip().AsSlice())}
	buf := gopacket.NewSerializeBuffer()
	_ = gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		&layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 3}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 4}, EthernetType: layers.EthernetTypeIPv4},
		ip, &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(3, 4), Seq: 1400}, gopacket.Payload(quote))
	icmp := append(make([]byte, 0, 2048), buf.Bytes()...)
	v = h.proc.Process(icmp, 2)
	if v.Action != Forward || h.proc.Destination() != outside {
		t.Fatalf("verdict %v/%v to %v", v.Action, v.Reason, h.proc.Destination())
	}
	p := parse(t, icmp[:v.Len])
	if p.Src != router || p.Dst != outside || p.Inner.Src != outside || p.Inner.SrcPort != 42000 || p.Inner.Dst != vip || p.Inner.DstPort != 80 {
		t.Fatalf("translated error: outer %v->%v inner %+v", p.Src, p.Dst, p.Inner)
	}
}

// TestFragmentsFollowFirst: a later fragment gets the addresses its first
// fragment was translated to.
func TestFragmentsFollowFirst(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	vip := addr("198.19.0.20")
	first := frame(t, packet.ProtoUDP, podA, vip, 43000, 53, 0, make([]byte, 64))
	first[20] |= 0x20 // more fragments
	fixIPChecksum(first)
	v := h.proc.Process(first, 1)
	if v.Action != Forward {
		t.Fatalf("first fragment: %v/%v", v.Action, v.Reason)
	}
	var fp packet.Packet
	packet.Parse(first[:v.Len], &fp)
	later := frame(t, packet.ProtoUDP, podA, vip, 0, 0, 0, make([]byte, 64))
	later[20], later[21] = 0, 9 // offset 72 bytes, last fragment
	fixIPChecksum(later)
	v = h.proc.Process(later, 2)
	if v.Action != Forward {
		t.Fatalf("later fragment: %v/%v", v.Action, v.Reason)
	}
	var lp packet.Packet
	packet.Parse(later[:v.Len], &lp)
	if lp.Dst != fp.Dst || lp.Src != fp.Src || !nat.ValidIPHeader(later, &lp) {
		t.Fatalf("later fragment to %v, first to %v", lp.Dst, fp.Dst)
	}
	// A later fragment of an unknown datagram is not translated.
	stray := frame(t, packet.ProtoUDP, podA, vip, 0, 0, 0, make([]byte, 64))
	stray[18], stray[19] = 0x77, 0x77
	stray[20], stray[21] = 0, 9
	fixIPChecksum(stray)
	if v := h.proc.Process(stray, 3); v.Action != Pass || v.Reason != packet.PassFragment {
		t.Fatalf("stray fragment: %v/%v", v.Action, v.Reason)
	}
}

func fixIPChecksum(f []byte) {
	f[24], f[25] = 0, 0
	c := nat.Checksum(f[14:34], 0)
	f[24], f[25] = byte(c>>8), byte(c)
}

// TestPartialChecksumCompleted: a SYN sent by a local stack with checksum
// offload carries only the pseudo-header sum; the output must be valid.
func TestPartialChecksumCompleted(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	f := frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), 44000, 80, packet.TCPSyn, nil)
	var p packet.Packet
	packet.Parse(f, &p)
	ps := nat.Fold(nat.PseudoHeaderSum(p.Src, p.Dst, p.Proto, p.End-p.L4))
	f[p.L4+16], f[p.L4+17] = byte(ps>>8), byte(ps)
	v := h.proc.Process(f, 1)
	if v.Action != Forward {
		t.Fatal(v)
	}
	parse(t, f[:v.Len]) // fails on a bad checksum
}

func TestBackendsSpread(t *testing.T) {
	h := newHarness(t, testModel(), 1<<16)
	hits := map[packet.Addr]int{}
	for i := 0; i < 2000; i++ {
		f := frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), uint16(10000+i), 80, packet.TCPSyn, nil)
		v := h.proc.Process(f, 1)
		var p packet.Packet
		packet.Parse(f[:v.Len], &p)
		hits[p.Dst]++
	}
	for _, b := range []string{"198.18.1.11", "198.18.1.12"} {
		if n := hits[addr(b)]; n < 850 || n > 1150 {
			t.Errorf("backend %s got %d of 2000 flows", b, n)
		}
	}
}

// TestProcessAllocs proves the established and the new-flow paths allocate
// nothing.
func TestProcessAllocs(t *testing.T) {
	h := newHarness(t, testModel(), 1<<16)
	est := frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), 45000, 80, packet.TCPAck, []byte("x"))
	tmpl := append([]byte(nil), est...)
	buf := make([]byte, len(est), 2048)
	copy(buf, tmpl)
	h.proc.Process(buf, 1)
	if n := testing.AllocsPerRun(1000, func() {
		copy(buf, tmpl)
		if v := h.proc.Process(buf, 2); v.Action != Forward {
			t.Fatal(v)
		}
	}); n != 0 {
		t.Errorf("established path: %v allocs per packet", n)
	}
	port := uint16(1)
	if n := testing.AllocsPerRun(1000, func() {
		copy(buf, tmpl)
		port++
		buf[34], buf[35] = byte(port>>8), byte(port) // new source port: new flow
		if v := h.proc.Process(buf, 3); v.Action != Forward {
			t.Fatal(v)
		}
	}); n != 0 {
		t.Errorf("new-flow path: %v allocs per packet", n)
	}
}

// TestNewRepliesForXDP: every new flow's reply tuple, DNAT-only and
// masqueraded alike, is handed to the worker for the XDP flow map, with
// its conntrack handle: the XDP program claims replies only by their
// exact tuple.
func TestNewRepliesForXDP(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	for _, client := range []packet.Addr{podA, outside} {
		h.proc.NewReplies, h.proc.NewHandles = h.proc.NewReplies[:0], h.proc.NewHandles[:0]
		f := frame(t, packet.ProtoTCP, client, addr("198.19.0.10"), 46000, 80, packet.TCPSyn, nil)
		v := h.proc.Process(f, 1)
		var out packet.Packet
		packet.Parse(f[:v.Len], &out)
		if len(h.proc.NewReplies) != 1 || h.proc.NewReplies[0] != out.Tuple().Reverse() || len(h.proc.NewHandles) != 1 {
			t.Fatalf("client %v: NewReplies %v, want the reply of %v with its handle", client, h.proc.NewReplies, out.Tuple())
		}
	}
}

// tcpFrame builds a TCP frame with the given sequence and ack numbers.
func tcpFrame(t testing.TB, src, dst packet.Addr, sport, dport uint16, flags uint8, seq, ack uint32, payload []byte) []byte {
	t.Helper()
	ip := &layers.IPv4{Version: 4, TTL: 64, Id: 1, Protocol: layers.IPProtocolTCP,
		SrcIP: net.IP(src.Netip().AsSlice()), DstIP: net.IP(dst.Netip().AsSlice())}
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, EthernetType: layers.EthernetTypeIPv4}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(dport), Seq: seq, Ack: ack, Window: 1000,
		SYN: flags&packet.TCPSyn != 0, ACK: flags&packet.TCPAck != 0, FIN: flags&packet.TCPFin != 0, RST: flags&packet.TCPRst != 0}
	_ = tcp.SetNetworkLayerForChecksum(ip)
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		eth, ip, tcp, gopacket.Payload(payload)); err != nil {
		t.Fatal(err)
	}
	out := make([]byte, len(buf.Bytes()), 2048)
	copy(out, buf.Bytes())
	return out
}

// TestBlindResetIgnored: a reset whose sequence number is outside the
// receiver's window (someone guessing) is dropped and leaves the
// connection alone; a reset inside the window closes it.
func TestBlindResetIgnored(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	vip := addr("198.19.0.10")
	syn := tcpFrame(t, podA, vip, 42000, 80, packet.TCPSyn, 1000, 0, nil)
	v := h.proc.Process(syn, 1)
	out := parse(t, syn[:v.Len])
	be, bePort := out.Dst, out.DstPort
	steps := []struct {
		name   string
		f      []byte
		action Action
		reason packet.Reason
	}{
		{"syn-ack", tcpFrame(t, be, podA, bePort, 42000, packet.TCPSyn|packet.TCPAck, 5000, 1001, nil), Forward, packet.OK},
		{"ack", tcpFrame(t, podA, vip, 42000, 80, packet.TCPAck, 1001, 5001, nil), Forward, packet.OK},
		{"data", tcpFrame(t, podA, vip, 42000, 80, packet.TCPAck, 1001, 5001, []byte("hello")), Forward, packet.OK},
		{"blind reset far ahead", tcpFrame(t, podA, vip, 42000, 80, packet.TCPRst, 1001+1<<30, 0, nil), Drop, packet.DropOutOfWindow},
		{"blind reset from the backend side", tcpFrame(t, be, podA, bePort, 42000, packet.TCPRst, 5001+1<<31, 0, nil), Drop, packet.DropOutOfWindow},
		{"data after the blind resets", tcpFrame(t, podA, vip, 42000, 80, packet.TCPAck, 1006, 5001, []byte("again")), Forward, packet.OK},
		{"reset in the window", tcpFrame(t, podA, vip, 42000, 80, packet.TCPRst, 1011, 0, nil), Forward, packet.OK},
	}
	for i, s := range steps {
		v := h.proc.Process(s.f, int64(i+2))
		if v.Action != s.action || (s.action == Drop && v.Reason != s.reason) {
			t.Fatalf("%s: %v/%v, want %v/%v", s.name, v.Action, v.Reason, s.action, s.reason)
		}
	}
	flow, _, ok := h.ct.Lookup(packet.Tuple{Src: podA, Dst: vip, SrcPort: 42000, DstPort: 80, Proto: packet.ProtoTCP}, 20)
	if !ok || flow.State != conntrack.TCPClose {
		t.Errorf("after the in-window reset: found %v, state %v; want the flow closing", ok, flow.State)
	}
	if st := h.ct.Stats(); st.OutOfWindowRST != 2 {
		t.Errorf("out-of-window resets counted %d, want 2", st.OutOfWindowRST)
	}
}

// TestNewConnectionOnEndedTupleTranslatedAfresh: a client that reuses the
// tuple of a connection that ended (here by a reset) opens a new one, and
// the new connection is translated afresh, as netfilter does, not handed the
// old connection's backend: after the service lost that backend, the new
// SYN goes to the one it has now.
func TestNewConnectionOnEndedTupleTranslatedAfresh(t *testing.T) {
	m := testModel()
	h := newHarness(t, m, 4096)
	vip := addr("198.19.0.10")
	syn := tcpFrame(t, podA, vip, 42001, 80, packet.TCPSyn, 1000, 0, nil)
	v := h.proc.Process(syn, 1)
	if v.Action != Forward {
		t.Fatalf("first SYN: %+v", v)
	}
	out := parse(t, syn[:v.Len])
	old, oldPort := out.Dst, out.DstPort
	for i, f := range [][]byte{
		tcpFrame(t, old, podA, oldPort, 42001, packet.TCPSyn|packet.TCPAck, 5000, 1001, nil),
		tcpFrame(t, podA, vip, 42001, 80, packet.TCPAck, 1001, 5001, nil),
		tcpFrame(t, podA, vip, 42001, 80, packet.TCPRst, 1001, 0, nil),
	} {
		if v := h.proc.Process(f, int64(i+2)); v.Action != Forward {
			t.Fatalf("segment %d of the first connection: %+v", i, v)
		}
	}
	tu := packet.Tuple{Src: podA, Dst: vip, SrcPort: 42001, DstPort: 80, Proto: packet.ProtoTCP}
	if flow, _, ok := h.ct.Lookup(tu, 10); !ok || flow.State != conntrack.TCPClose {
		t.Fatalf("after the reset: found %v, state %v; want the flow closed", ok, flow.State)
	}

	// The service keeps only the endpoint the first connection did not get.
	web := &m.Ports[0]
	for _, ep := range web.Endpoints {
		if ep.Addr != old {
			web.Endpoints = []service.Endpoint{ep}
			break
		}
	}
	h.cur.Store(service.Compile(m, service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}}))
	h.proc.BeginBatch(20)

	again := tcpFrame(t, podA, vip, 42001, 80, packet.TCPSyn, 9000, 0, nil)
	v = h.proc.Process(again, 21)
	if v.Action != Forward {
		t.Fatalf("SYN of the new connection: %+v", v)
	}
	if got := parse(t, again[:v.Len]).Dst; got != web.Endpoints[0].Addr {
		t.Errorf("the new connection went to %v, want %v (the old connection's backend was %v)", got, web.Endpoints[0].Addr, old)
	}
	if flow, _, ok := h.ct.Lookup(tu, 22); !ok || flow.State != conntrack.TCPSynSent || flow.Rewrite.Dst != web.Endpoints[0].Addr {
		t.Errorf("the table holds %+v (found %v), want a new flow to %v in SYN_SENT", flow, ok, web.Endpoints[0].Addr)
	}
}
