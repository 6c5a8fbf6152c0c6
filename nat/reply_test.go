package nat

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func TestBuildTCPReset(t *testing.T) {
	data := []byte("0123456789")
	cases := []struct {
		name             string
		spec             frameSpec
		wantSeq, wantAck uint32
		wantACK          bool
	}{
		{"syn", frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 1000, tcpFlags: packet.TCPSyn},
			0, 1001, true},
		{"syn with data", frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 0xffffffff, tcpFlags: packet.TCPSyn, payload: data},
			0, 10, true}, // sequence numbers wrap
		{"ack with data", frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 5, ack: 777, tcpFlags: packet.TCPAck | packet.TCPPsh, payload: data},
			777, 0, false},
		{"fin no ack", frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 5, tcpFlags: packet.TCPFin, payload: data},
			0, 16, true},
		{"vlan options syn", frameSpec{vlan: true, ipOpts: true, proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 1000, tcpFlags: packet.TCPSyn},
			0, 1001, true},
		{"ipv6 syn", frameSpec{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 443, seq: 1000, tcpFlags: packet.TCPSyn},
			0, 1001, true},
		{"ipv6 vlan ack", frameSpec{vlan: true, proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 443, seq: 1, ack: 2, tcpFlags: packet.TCPAck, payload: data},
			2, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			frame := c.spec.build(t)
			p := mustParse(t, frame)
			orig := *p
			n, ok := BuildTCPReset(frame, p)
			if !ok {
				t.Fatal("refused")
			}
			wantLen := orig.L3 + ipHeaderLen(frameSpec{src: c.spec.src}) + packet.TCPMinLen
			if n != wantLen {
				t.Fatalf("length %d, want %d", n, wantLen)
			}
			reply := frame[:n]
			pkt := verifyChecksums(t, reply)
			eth := pkt.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
			if !bytes.Equal(eth.SrcMAC, macB) || !bytes.Equal(eth.DstMAC, macA) {
				t.Errorf("MACs %v -> %v not swapped", eth.SrcMAC, eth.DstMAC)
			}
			if c.spec.vlan != (pkt.Layer(layers.LayerTypeDot1Q) != nil) {
				t.Error("VLAN tag not kept")
			}
			if got := pkt.NetworkLayer().NetworkFlow().String(); got != c.spec.dst.String()+"->"+c.spec.src.String() {
				t.Errorf("addresses %s", got)
			}
			if ip, ok := pkt.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok && (ip.IHL != 5 || ip.TTL != replyTTL || int(ip.Length) != 40) {
				t.Errorf("IPv4 header IHL %d TTL %d length %d", ip.IHL, ip.TTL, ip.Length)
			}
			tcp := pkt.Layer(layers.LayerTypeTCP).(*layers.TCP)
			if uint16(tcp.SrcPort) != c.spec.dport || uint16(tcp.DstPort) != c.spec.sport {
				t.Errorf("ports %d -> %d", tcp.SrcPort, tcp.DstPort)
			}
			if !tcp.RST || tcp.ACK != c.wantACK || tcp.SYN || tcp.FIN || tcp.PSH {
				t.Errorf("flags RST %v ACK %v SYN %v FIN %v PSH %v", tcp.RST, tcp.ACK, tcp.SYN, tcp.FIN, tcp.PSH)
			}
			if tcp.Seq != c.wantSeq || tcp.Ack != c.wantAck {
				t.Errorf("seq %d ack %d, want %d %d", tcp.Seq, tcp.Ack, c.wantSeq, c.wantAck)
			}
			if tcp.DataOffset != 5 || len(tcp.Payload) != 0 || tcp.Window != 0 {
				t.Errorf("data offset %d, payload %d bytes, window %d", tcp.DataOffset, len(tcp.Payload), tcp.Window)
			}
			var rp packet.Packet
			if r := packet.Parse(reply, &rp); r != packet.OK || rp.Tuple() != orig.Tuple().Reverse() {
				t.Errorf("reply parses as %v %v, want %v", r, rp.Tuple(), orig.Tuple().Reverse())
			}
		})
	}
}

func TestBuildTCPResetRefuses(t *testing.T) {
	for _, s := range []frameSpec{
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2, tcpFlags: packet.TCPRst},
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2, tcpFlags: packet.TCPRst | packet.TCPAck},
		{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2},
	} {
		frame := s.build(t)
		orig := append([]byte(nil), frame...)
		if _, ok := BuildTCPReset(frame, mustParse(t, frame)); ok {
			t.Errorf("%v flags %#x answered with RST", s.proto, s.tcpFlags)
		}
		diffBytes(t, "refused", frame, orig)
	}
}

func TestBuildICMPUnreachable(t *testing.T) {
	big := make([]byte, 1400)
	for i := range big {
		big[i] = byte(i)
	}
	cases := []struct {
		name      string
		spec      frameSpec
		code      uint8
		room      int // buffer size, the frame size by default
		wantQuote int // bytes of the original IP datagram quoted
	}{
		{"udp small", frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 53, payload: []byte("q")}, 3, 2048, 29},
		{"udp big", frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 53, payload: big}, 3, 2048, 548},
		{"udp vlan options", frameSpec{vlan: true, ipOpts: true, proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, payload: big[:100]}, 3, 2048, 24 + 8 + 100},
		{"udp tight buffer", frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 53, payload: big[:40]}, 3, 0, 68 - 28},
		{"tcp syn", frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn}, 3, 2048, 40},
		{"icmp echo", frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: client, dst: vip, sport: 9}, 3, 2048, 28},
		{"udp6 small", frameSpec{proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 40000, dport: 53, payload: []byte("q")}, 4, 2048, 49},
		{"udp6 big", frameSpec{proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 40000, dport: 53, payload: big}, 4, 2048, 1232},
		{"udp6 vlan", frameSpec{vlan: true, proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 40000, dport: 53, payload: big[:10]}, 4, 2048, 58},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			frame := c.spec.build(t)
			orig := append([]byte(nil), frame...)
			room := c.room
			if room == 0 {
				room = len(frame)
			}
			buf := make([]byte, room+16)
			for i := range buf {
				buf[i] = 0xa5 // beyond the room: must stay as it is
			}
			copy(buf, frame)
			p := mustParse(t, buf[:len(frame)])
			op := *p
			n, ok := BuildICMPUnreachable(buf[:room], len(frame), p, c.code)
			if !ok {
				t.Fatal("refused")
			}
			ipLen := ipHeaderLen(frameSpec{src: c.spec.src})
			if want := op.L3 + ipLen + 8 + c.wantQuote; n != want {
				t.Fatalf("length %d, want %d (quote %d)", n, want, c.wantQuote)
			}
			for i, b := range buf[room:] {
				if b != 0xa5 {
					t.Fatalf("byte %d past the buffer written", room+i)
				}
			}
			reply := buf[:n]
			pkt := verifyChecksums(t, reply)
			eth := pkt.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
			if !bytes.Equal(eth.SrcMAC, macB) || !bytes.Equal(eth.DstMAC, macA) {
				t.Errorf("MACs %v -> %v not swapped", eth.SrcMAC, eth.DstMAC)
			}
			if c.spec.vlan != (pkt.Layer(layers.LayerTypeDot1Q) != nil) {
				t.Error("VLAN tag not kept")
			}
			if got := pkt.NetworkLayer().NetworkFlow().String(); got != c.spec.dst.String()+"->"+c.spec.src.String() {
				t.Errorf("addresses %s, want from the VIP to the client", got)
			}
			var quote []byte
			if c.spec.src.Is4() {
				ip := pkt.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
				if int(ip.Length) != n-op.L3 || ip.Length > 576 || ip.IHL != 5 || ip.Protocol != layers.IPProtocolICMPv4 {
					t.Errorf("IPv4 length %d IHL %d proto %v", ip.Length, ip.IHL, ip.Protocol)
				}
				icmp := pkt.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4)
				if icmp.TypeCode != layers.CreateICMPv4TypeCode(3, c.code) || icmp.Id != 0 || icmp.Seq != 0 {
					t.Errorf("ICMP %v id %d seq %d", icmp.TypeCode, icmp.Id, icmp.Seq)
				}
				quote = icmp.Payload
			} else {
				ip := pkt.Layer(layers.LayerTypeIPv6).(*layers.IPv6)
				if int(ip.Length)+40 != n-op.L3 || int(ip.Length)+40 > 1280 || ip.NextHeader != layers.IPProtocolICMPv6 {
					t.Errorf("IPv6 payload length %d next header %v", ip.Length, ip.NextHeader)
				}
				icmp := pkt.Layer(layers.LayerTypeICMPv6).(*layers.ICMPv6)
				if icmp.TypeCode != layers.CreateICMPv6TypeCode(1, c.code) {
					t.Errorf("ICMPv6 %v", icmp.TypeCode)
				}
				quote = icmp.Payload[4:]
			}
			diffBytes(t, "quote", quote, orig[op.L3:op.L3+c.wantQuote])

			// The dataplane's parser reads the quote back as the flow.
			var rp packet.Packet
			if r := packet.Parse(reply, &rp); r != packet.OK || !rp.IsICMPError || rp.InnerTuple() != op.Tuple() {
				t.Errorf("reply parses as %v error=%v inner %v", r, rp.IsICMPError, rp.InnerTuple())
			}
		})
	}
}

func TestBuildICMPErrorFragNeeded(t *testing.T) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, payload: make([]byte, 1400)}
	frame := s.build(t)
	buf := make([]byte, 2048)
	copy(buf, frame)
	p := mustParse(t, buf[:len(frame)])
	from := packet.AddrFromNetip(node)
	n, ok := BuildICMPError(buf, len(frame), p, from, packet.ICMPv4DestUnreach, packet.ICMPv4CodeFragNeeded, 1450)
	if !ok {
		t.Fatal("refused")
	}
	pkt := verifyChecksums(t, buf[:n])
	icmp := pkt.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4)
	if icmp.TypeCode != layers.CreateICMPv4TypeCode(3, 4) || icmp.Id != 0 || icmp.Seq != 1450 {
		t.Errorf("ICMP %v unused %d MTU %d", icmp.TypeCode, icmp.Id, icmp.Seq)
	}
	if got := pkt.NetworkLayer().NetworkFlow().Src().String(); got != node.String() {
		t.Errorf("from %s", got)
	}
}

func TestBuildICMPErrorRefuses(t *testing.T) {
	udp := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, payload: make([]byte, 100)}
	with := func(s frameSpec, f func(*frameSpec)) frameSpec { f(&s); return s }
	cases := []struct {
		name string
		spec frameSpec
		room int
	}{
		{"multicast destination", with(udp, func(s *frameSpec) { s.dst = netip.MustParseAddr("239.1.1.1") }), 2048},
		{"broadcast destination", with(udp, func(s *frameSpec) { s.dst = netip.MustParseAddr("255.255.255.255") }), 2048},
		{"unspecified source", with(udp, func(s *frameSpec) { s.src = netip.MustParseAddr("0.0.0.0") }), 2048},
		{"loopback source", with(udp, func(s *frameSpec) { s.src = netip.MustParseAddr("127.0.0.1") }), 2048},
		{"multicast source", with(udp, func(s *frameSpec) { s.src = netip.MustParseAddr("224.0.0.5") }), 2048},
		{"ipv6 multicast destination", with(udp, func(s *frameSpec) { s.src, s.dst = client6, netip.MustParseAddr("ff02::1") }), 2048},
		{"ipv6 unspecified source", with(udp, func(s *frameSpec) { s.src, s.dst = netip.MustParseAddr("::"), vip6 }), 2048},
		{"no room for ip header + 8", with(udp, func(s *frameSpec) { s.payload = nil }), 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			frame := c.spec.build(t)
			buf := make([]byte, max(c.room, len(frame)))
			copy(buf, frame)
			orig := append([]byte(nil), buf...)
			if _, ok := BuildICMPUnreachable(buf, len(frame), mustParse(t, buf[:len(frame)]), 3); ok {
				t.Fatal("answered")
			}
			diffBytes(t, "refused", buf, orig)
		})
	}

	// ICMP errors are never answered with ICMP errors.
	e := icmpErrorSpec{outerSrc: backend, outerDst: client, typ: 3, code: 3, inner: udp}
	frame := e.build(t)
	buf := make([]byte, 2048)
	copy(buf, frame)
	if _, ok := BuildICMPUnreachable(buf, len(frame), mustParse(t, buf[:len(frame)]), 3); ok {
		t.Error("ICMP error answered")
	}
	// Nor with a source address of the other family.
	frame = udp.build(t)
	copy(buf, frame)
	if _, ok := BuildICMPError(buf, len(frame), mustParse(t, buf[:len(frame)]), packet.AddrFromNetip(vip6), 3, 3, 0); ok {
		t.Error("IPv6 source for an IPv4 error accepted")
	}
}
