package nat

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/nat/packet"
)

var (
	client  = netip.MustParseAddr("198.18.0.10")
	vip     = netip.MustParseAddr("198.19.0.1")
	backend = netip.MustParseAddr("198.18.5.20")
	node    = netip.MustParseAddr("198.18.0.2")

	client6  = netip.MustParseAddr("2001:db8::10")
	vip6     = netip.MustParseAddr("2001:db8:ffff::1")
	backend6 = netip.MustParseAddr("2001:db8:5::20")
	node6    = netip.MustParseAddr("2001:db8::2")
)

type rewriteOp int

const (
	opBoth rewriteOp = iota
	opSrc
	opDst
)

func (o rewriteOp) String() string { return [...]string{"Rewrite", "RewriteSrc", "RewriteDst"}[o] }

// apply runs o to reach tuple to and returns the tuple the frame must
// carry afterwards.
func (o rewriteOp) apply(frame []byte, p *packet.Packet, to packet.Tuple) (packet.Tuple, bool) {
	want := p.Tuple()
	echo := p.Proto == packet.ProtoICMP || p.Proto == packet.ProtoICMPv6
	var ok bool
	switch o {
	case opBoth:
		ok = Rewrite(frame, p, to)
		want.Src, want.Dst, want.SrcPort, want.DstPort = to.Src, to.Dst, to.SrcPort, to.DstPort
	case opSrc:
		ok = RewriteSrc(frame, p, to.Src, to.SrcPort)
		want.Src, want.SrcPort = to.Src, to.SrcPort
		if echo {
			want.DstPort = to.SrcPort
		}
	case opDst:
		ok = RewriteDst(frame, p, to.Dst, to.DstPort)
		want.Dst, want.DstPort = to.Dst, to.DstPort
		if echo {
			want.SrcPort = to.DstPort
		}
	}
	return want, ok
}

func TestRewriteTable(t *testing.T) {
	payload := []byte("GET / HTTP/1.1\r\nHost: example\r\n\r\n")
	odd := []byte("odd length!")
	tcp := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 1000, ack: 2000, tcpFlags: packet.TCPAck | packet.TCPPsh, payload: payload}
	udp := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 5353, dport: 53, payload: odd}
	echo := frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: client, dst: vip, sport: 0x4242, payload: payload}
	reply := frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4EchoReply, src: backend, dst: node, sport: 0x1111, payload: payload}
	tcp6 := frameSpec{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn, payload: nil}
	udp6 := frameSpec{proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 5353, dport: 53, payload: odd}
	echo6 := frameSpec{proto: packet.ProtoICMPv6, icmpType: packet.ICMPv6Echo, src: client6, dst: vip6, sport: 0x4242, payload: payload}

	with := func(s frameSpec, f func(*frameSpec)) frameSpec { f(&s); return s }
	dnat := func(s frameSpec, b netip.Addr, port uint16) packet.Tuple {
		t := s.tuple()
		t.Dst, t.DstPort = packet.AddrFromNetip(b), port
		if s.proto == packet.ProtoICMP || s.proto == packet.ProtoICMPv6 {
			t.DstPort = t.SrcPort
		}
		return t
	}
	snat := func(s frameSpec, n netip.Addr, port uint16) packet.Tuple {
		t := s.tuple()
		t.Src, t.SrcPort = packet.AddrFromNetip(n), port
		if s.proto == packet.ProtoICMP || s.proto == packet.ProtoICMPv6 {
			t.DstPort = port
		}
		return t
	}
	both := func(s frameSpec, n netip.Addr, sp uint16, b netip.Addr, dp uint16) packet.Tuple {
		t := dnat(s, b, dp)
		t.Src, t.SrcPort = packet.AddrFromNetip(n), sp
		if s.proto == packet.ProtoICMP || s.proto == packet.ProtoICMPv6 {
			t.DstPort = sp
		}
		return t
	}

	cases := []struct {
		name string
		spec frameSpec
		op   rewriteOp
		to   packet.Tuple
	}{
		{"tcp dnat", tcp, opDst, dnat(tcp, backend, 8080)},
		{"tcp dnat same port", tcp, opDst, dnat(tcp, backend, 80)},
		{"tcp snat", tcp, opSrc, snat(tcp, node, 61000)},
		{"tcp dnat+snat", tcp, opBoth, both(tcp, node, 61000, backend, 8080)},
		{"tcp reverse", tcp.withTuple(both(tcp, node, 61000, backend, 8080).Reverse()), opBoth, tcp.tuple().Reverse()},
		{"tcp no change", tcp, opBoth, tcp.tuple()},
		{"tcp vlan", with(tcp, func(s *frameSpec) { s.vlan = true }), opBoth, both(tcp, node, 1, backend, 65535)},
		{"tcp ip options", with(tcp, func(s *frameSpec) { s.ipOpts = true }), opBoth, both(tcp, node, 61000, backend, 8080)},
		{"tcp vlan ip options syn", with(tcp, func(s *frameSpec) { s.vlan, s.ipOpts, s.tcpFlags, s.payload = true, true, packet.TCPSyn, nil }), opDst, dnat(tcp, backend, 8080)},
		{"udp dnat", udp, opDst, dnat(udp, backend, 5300)},
		{"udp snat", udp, opSrc, snat(udp, node, 33333)},
		{"udp both vlan", with(udp, func(s *frameSpec) { s.vlan = true }), opBoth, both(udp, node, 33333, backend, 5300)},
		{"udp zero checksum", with(udp, func(s *frameSpec) { s.udpNoCheck = true }), opBoth, both(udp, node, 33333, backend, 5300)},
		{"udp zero checksum options", with(udp, func(s *frameSpec) { s.udpNoCheck, s.ipOpts = true, true }), opDst, dnat(udp, backend, 5300)},
		{"udp empty payload", with(udp, func(s *frameSpec) { s.payload = nil }), opBoth, both(udp, node, 1024, backend, 53)},
		{"icmp echo dnat", echo, opDst, dnat(echo, backend, 0)},
		{"icmp echo snat new id", echo, opSrc, snat(echo, node, 0x9999)},
		{"icmp echo both", echo, opBoth, both(echo, node, 0x9999, backend, 0)},
		{"icmp echo reply un-snat", reply, opDst, func() packet.Tuple {
			t := reply.tuple()
			t.Dst, t.SrcPort, t.DstPort = packet.AddrFromNetip(client), 0x4242, 0x4242
			return t
		}()},
		{"icmp echo reply both", reply, opBoth, packet.Tuple{Src: packet.AddrFromNetip(vip), Dst: packet.AddrFromNetip(client), SrcPort: 0x4242, DstPort: 0x4242}},
		{"icmp echo vlan options", with(echo, func(s *frameSpec) { s.vlan, s.ipOpts = true, true }), opBoth, both(echo, node, 7, backend, 0)},
		{"tcp6 both", tcp6, opBoth, both(tcp6, node6, 61000, backend6, 8080)},
		{"tcp6 vlan dnat", with(tcp6, func(s *frameSpec) { s.vlan = true }), opDst, dnat(tcp6, backend6, 8080)},
		{"udp6 snat", udp6, opSrc, snat(udp6, node6, 2000)},
		{"icmp6 echo both", echo6, opBoth, both(echo6, node6, 0x9999, backend6, 0)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			frame := c.spec.build(t)
			p := mustParse(t, frame)
			wantTuple, ok := c.op.apply(frame, p, c.to)
			if !ok {
				t.Fatalf("%v refused", c.op)
			}
			want := c.spec.withTuple(wantTuple).build(t)
			diffBytes(t, "frame", frame, want)
			verifyChecksums(t, frame)
			if p.Tuple() != wantTuple {
				t.Errorf("packet tuple %v, want %v", p.Tuple(), wantTuple)
			}
			if again := mustParse(t, frame); *again != *p {
				t.Errorf("packet not updated to match the frame:\n got %+v\nwant %+v", *p, *again)
			}
		})
	}
}

// TestRewriteRandom compares incremental rewrites with gopacket's full
// recomputation over random packets.
func TestRewriteRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	randAddr := func(v6 bool) netip.Addr {
		if v6 {
			var b [16]byte
			for i := range b {
				b[i] = byte(rng.Uint32())
			}
			b[0] = 0x20 // never IPv4-mapped
			return netip.AddrFrom16(b)
		}
		return netip.AddrFrom4([4]byte{byte(rng.Uint32()), byte(rng.Uint32()), byte(rng.Uint32()), byte(rng.Uint32())})
	}
	n := 3000
	if testing.Short() {
		n = 300
	}
	for i := 0; i < n; i++ {
		v6 := rng.IntN(3) == 0
		s := frameSpec{
			vlan:  rng.IntN(3) == 0,
			src:   randAddr(v6),
			dst:   randAddr(v6),
			sport: uint16(rng.Uint32()), dport: uint16(rng.Uint32()),
			seq: rng.Uint32(), ack: rng.Uint32(), tcpFlags: uint8(rng.IntN(32)) &^ packet.TCPRst,
			payload: make([]byte, rng.IntN(1400)),
		}
		for j := range s.payload {
			s.payload[j] = byte(rng.Uint32())
		}
		switch rng.IntN(4) {
		case 0, 1:
			s.proto = packet.ProtoTCP
		case 2:
			s.proto = packet.ProtoUDP
			s.udpNoCheck = !v6 && rng.IntN(5) == 0
		case 3:
			s.proto, s.icmpType = packet.ProtoICMP, packet.ICMPv4Echo
			if rng.IntN(2) == 0 {
				s.icmpType = packet.ICMPv4EchoReply
			}
			if v6 {
				s.proto, s.icmpType = packet.ProtoICMPv6, packet.ICMPv6Echo
				if rng.IntN(2) == 0 {
					s.icmpType = packet.ICMPv6EchoReply
				}
			}
		}
		s.ipOpts = !v6 && rng.IntN(4) == 0
		to := packet.Tuple{Src: packet.AddrFromNetip(randAddr(v6)), Dst: packet.AddrFromNetip(randAddr(v6)),
			SrcPort: uint16(rng.Uint32()), DstPort: uint16(rng.Uint32())}
		if s.proto == packet.ProtoICMP || s.proto == packet.ProtoICMPv6 {
			to.DstPort = to.SrcPort
		}
		op := rewriteOp(rng.IntN(3))
		name := fmt.Sprintf("case %d: %v %v %v", i, op, s.proto, s.tuple())

		frame := s.build(t)
		p := mustParse(t, frame)
		wantTuple, ok := op.apply(frame, p, to)
		if !ok {
			t.Fatalf("%s: refused", name)
		}
		want := s.withTuple(wantTuple).build(t)
		diffBytes(t, name, frame, want)
		if t.Failed() {
			return
		}
	}
}

// TestRewriteUDPChecksumComputingToZero builds a UDP datagram whose correct
// checksum is zero after translation, which must be sent as 0xffff.
func TestRewriteUDPChecksumComputingToZero(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		s := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1000, dport: 53, payload: make([]byte, 20)}
		to := packet.Tuple{Src: packet.AddrFromNetip(node), Dst: packet.AddrFromNetip(backend), SrcPort: 2000, DstPort: 5353}
		if v6 {
			s.src, s.dst = client6, vip6
			to.Src, to.Dst = packet.AddrFromNetip(node6), packet.AddrFromNetip(backend6)
		}
		// With payload word w = the checksum over w = 0, the data sums to
		// 0xffff and the checksum to zero.
		target := s.withTuple(to)
		f := target.build(t)
		c := binary.BigEndian.Uint16(f[l4Offset(s)+6:])
		binary.BigEndian.PutUint16(s.payload[4:], c)
		want := target.build(t)
		if got := binary.BigEndian.Uint16(want[l4Offset(s)+6:]); got != 0xffff {
			t.Fatalf("test setup: checksum %#04x, want one computing to zero", got)
		}

		frame := s.build(t)
		p := mustParse(t, frame)
		if !Rewrite(frame, p, to) {
			t.Fatal("refused")
		}
		diffBytes(t, fmt.Sprintf("v6=%v", v6), frame, want)
	}
}

func TestRewriteRefusesOtherFamily(t *testing.T) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2}
	frame := s.build(t)
	orig := append([]byte(nil), frame...)
	p := mustParse(t, frame)
	before := *p
	if RewriteDst(frame, p, packet.AddrFromNetip(backend6), 80) {
		t.Fatal("IPv6 address accepted for an IPv4 packet")
	}
	if Rewrite(frame, p, packet.Tuple{Src: packet.AddrFromNetip(node), Dst: packet.Addr{}}) {
		t.Fatal("zero address accepted")
	}
	diffBytes(t, "frame", frame, orig)
	if *p != before {
		t.Error("packet changed")
	}
}

// TestRewriteLaterFragment: a fragment without L4 header gets its
// addresses changed and nothing else.
func TestRewriteLaterFragment(t *testing.T) {
	build := func(src, dst netip.Addr) []byte {
		ip := &layers.IPv4{Version: 4, TTL: 64, Id: 77, FragOffset: 185, Protocol: layers.IPProtocolUDP,
			SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		buf := gopacket.NewSerializeBuffer()
		must(t, gopacket.SerializeLayers(buf, serializeOpts,
			&layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: layers.EthernetTypeIPv4}, ip,
			gopacket.Payload("the rest of a datagram, no header here")))
		return append([]byte(nil), buf.Bytes()...)
	}
	frame := build(client, vip)
	p := mustParse(t, frame)
	if !p.IsLaterFragment() {
		t.Fatal("test setup: not a later fragment")
	}
	to := packet.Tuple{Src: packet.AddrFromNetip(node), Dst: packet.AddrFromNetip(backend), SrcPort: 1, DstPort: 2}
	if !Rewrite(frame, p, to) {
		t.Fatal("refused")
	}
	diffBytes(t, "frame", frame, build(node, backend))
	if p.SrcPort != 0 || p.DstPort != 0 {
		t.Errorf("ports %d, %d set on a fragment without ports", p.SrcPort, p.DstPort)
	}
}

func TestDecrementTTL(t *testing.T) {
	for _, s := range []frameSpec{
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2, ttl: 64},
		{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, ttl: 255, ipOpts: true, vlan: true},
		{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, ttl: 2},
		{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 1, dport: 2, ttl: 64},
	} {
		frame := s.build(t)
		p := mustParse(t, frame)
		if !DecrementTTL(frame, p) {
			t.Fatalf("TTL %d: refused", s.ttl)
		}
		s.ttl--
		diffBytes(t, fmt.Sprintf("TTL %d", s.ttl+1), frame, s.build(t))
	}
	for _, s := range []frameSpec{
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2, ttl: 1},
		{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 1, dport: 2, ttl: 1},
	} {
		frame := s.build(t)
		orig := append([]byte(nil), frame...)
		p := mustParse(t, frame)
		if DecrementTTL(frame, p) {
			t.Fatal("TTL 1 decremented to 0")
		}
		diffBytes(t, "refused frame", frame, orig)
	}
	// TTL 0 (an invalid packet) is refused too.
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2}
	frame := s.build(t)
	frame[packet.EthernetLen+8] = 0
	if DecrementTTL(frame, mustParse(t, frame)) {
		t.Fatal("TTL 0 decremented")
	}
}
