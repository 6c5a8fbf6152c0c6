package nat

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/nat/packet"
)

var (
	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
)

// frameSpec describes a frame that gopacket builds with every length and
// checksum computed from scratch: the reference each rewrite is held to.
type frameSpec struct {
	vlan     bool
	ipOpts   bool // IPv4 only: a router alert option (IHL 6)
	proto    packet.Proto
	src, dst netip.Addr
	// TCP/UDP ports; for ICMP echo sport is the identifier.
	sport, dport uint16
	icmpType     uint8 // ICMP echo request or reply
	seq, ack     uint32
	tcpFlags     uint8
	payload      []byte
	udpNoCheck   bool // send the UDP checksum as zero
	ttl          uint8
}

func (s frameSpec) tuple() packet.Tuple {
	t := packet.Tuple{
		Src: packet.AddrFromNetip(s.src), Dst: packet.AddrFromNetip(s.dst),
		SrcPort: s.sport, DstPort: s.dport, Proto: s.proto,
	}
	if s.proto == packet.ProtoICMP || s.proto == packet.ProtoICMPv6 {
		t.DstPort = s.sport
	}
	return t
}

// withTuple returns s sending as t.
func (s frameSpec) withTuple(t packet.Tuple) frameSpec {
	s.src, s.dst = t.Src.Netip(), t.Dst.Netip()
	s.sport, s.dport = t.SrcPort, t.DstPort
	return s
}

var serializeOpts = gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}

// ipLayers returns the Ethernet, optional VLAN and IP layers of s.
func (s frameSpec) ipLayers(t testing.TB, proto packet.Proto) ([]gopacket.SerializableLayer, gopacket.NetworkLayer) {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: macA, DstMAC: macB}
	ls := []gopacket.SerializableLayer{eth}
	etherType := layers.EthernetTypeIPv4
	if s.src.Is6() {
		etherType = layers.EthernetTypeIPv6
	}
	if s.vlan {
		eth.EthernetType = layers.EthernetTypeDot1Q
		ls = append(ls, &layers.Dot1Q{VLANIdentifier: 42, Priority: 3, Type: etherType})
	} else {
		eth.EthernetType = etherType
	}
	ttl := s.ttl
	if ttl == 0 {
		ttl = 64
	}
	var nl gopacket.NetworkLayer
	if s.src.Is4() {
		ip := &layers.IPv4{
			Version: 4, TTL: ttl, TOS: 0x10, Id: 0x1234, Flags: layers.IPv4DontFragment,
			Protocol: layers.IPProtocol(proto), SrcIP: s.src.AsSlice(), DstIP: s.dst.AsSlice(),
		}
		if s.ipOpts {
			ip.Options = []layers.IPv4Option{{OptionType: 148, OptionLength: 4, OptionData: []byte{0, 0}}}
		}
		ls, nl = append(ls, ip), ip
	} else {
		ip := &layers.IPv6{
			Version: 6, HopLimit: ttl, TrafficClass: 0x10, FlowLabel: 0x12345,
			NextHeader: layers.IPProtocol(proto), SrcIP: s.src.AsSlice(), DstIP: s.dst.AsSlice(),
		}
		ls, nl = append(ls, ip), ip
	}
	return ls, nl
}

// build serializes s with gopacket.
func (s frameSpec) build(t testing.TB) []byte {
	t.Helper()
	ls, nl := s.ipLayers(t, s.proto)
	switch s.proto {
	case packet.ProtoTCP:
		tcp := &layers.TCP{
			SrcPort: layers.TCPPort(s.sport), DstPort: layers.TCPPort(s.dport),
			Seq: s.seq, Ack: s.ack, Window: 64240,
			FIN: s.tcpFlags&packet.TCPFin != 0, SYN: s.tcpFlags&packet.TCPSyn != 0,
			RST: s.tcpFlags&packet.TCPRst != 0, PSH: s.tcpFlags&packet.TCPPsh != 0,
			ACK: s.tcpFlags&packet.TCPAck != 0,
		}
		must(t, tcp.SetNetworkLayerForChecksum(nl))
		ls = append(ls, tcp)
	case packet.ProtoUDP:
		udp := &layers.UDP{SrcPort: layers.UDPPort(s.sport), DstPort: layers.UDPPort(s.dport)}
		must(t, udp.SetNetworkLayerForChecksum(nl))
		ls = append(ls, udp)
	case packet.ProtoICMP:
		ls = append(ls, &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(s.icmpType, 0), Id: s.sport, Seq: 7})
	case packet.ProtoICMPv6:
		icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(s.icmpType, 0)}
		must(t, icmp.SetNetworkLayerForChecksum(nl))
		ls = append(ls, icmp, &layers.ICMPv6Echo{Identifier: s.sport, SeqNumber: 7})
	default:
		t.Fatalf("no builder for %v", s.proto)
	}
	ls = append(ls, gopacket.Payload(s.payload))
	buf := gopacket.NewSerializeBuffer()
	must(t, gopacket.SerializeLayers(buf, serializeOpts, ls...))
	frame := append([]byte(nil), buf.Bytes()...)
	if s.proto == packet.ProtoUDP {
		off := l4Offset(s) + 6
		switch {
		case s.udpNoCheck:
			frame[off], frame[off+1] = 0, 0
		case binary.BigEndian.Uint16(frame[off:]) == 0:
			// gopacket writes a computed zero as is; RFC 768 sends it as
			// 0xffff, which is what nat must produce.
			frame[off], frame[off+1] = 0xff, 0xff
		}
	}
	return frame
}

// l4Offset is where the L4 header of a frame built from s starts.
func l4Offset(s frameSpec) int {
	off := packet.EthernetLen
	if s.vlan {
		off += packet.VLANLen
	}
	if s.src.Is6() {
		return off + packet.IPv6Len
	}
	if s.ipOpts {
		return off + 24
	}
	return off + packet.IPv4MinLen
}

func l4ChecksumOffset(proto packet.Proto) int {
	switch proto {
	case packet.ProtoTCP:
		return 16
	case packet.ProtoUDP:
		return 6
	}
	return 2
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func mustParse(t testing.TB, frame []byte) *packet.Packet {
	t.Helper()
	var p packet.Packet
	if r := packet.Parse(frame, &p); r != packet.OK {
		t.Fatalf("parse: %v", r)
	}
	return &p
}

// refSum is the textbook RFC 1071 sum, 16 bits at a time, kept apart from
// the fast Sum so that one checks the other.
func refSum(b []byte, s uint32) uint16 {
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

// refPseudo is the pseudo-header sum, written out as the RFCs lay it out.
func refPseudo(src, dst netip.Addr, proto packet.Proto, l4Len int) uint32 {
	var b []byte
	if src.Is4() {
		b = append(b, src.AsSlice()...)
		b = append(b, dst.AsSlice()...)
		b = append(b, 0, byte(proto), byte(l4Len>>8), byte(l4Len))
	} else {
		b = append(b, src.AsSlice()...)
		b = append(b, dst.AsSlice()...)
		b = binary.BigEndian.AppendUint32(b, uint32(l4Len))
		b = append(b, 0, 0, 0, byte(proto))
	}
	return uint32(refSum(b, 0))
}

// verifyChecksums decodes frame with gopacket and checks every checksum
// in it against the reference sum. It returns the decoded packet.
func verifyChecksums(t testing.TB, frame []byte) gopacket.Packet {
	t.Helper()
	pkt := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default)
	// Payloads that gopacket mistakes for an application protocol (DNS on
	// port 53) fail to decode above L4; only failures below matter here.
	if el := pkt.ErrorLayer(); el != nil && pkt.TransportLayer() == nil && pkt.Layer(layers.LayerTypeICMPv4) == nil && pkt.Layer(layers.LayerTypeICMPv6) == nil {
		t.Fatalf("gopacket: %v", el.Error())
	}
	var src, dst netip.Addr
	if ip, ok := pkt.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok {
		if refSum(ip.Contents, 0) != 0xffff {
			t.Errorf("IPv4 header checksum %#04x is wrong", ip.Checksum)
		}
		src, _ = netip.AddrFromSlice(ip.SrcIP.To4())
		dst, _ = netip.AddrFromSlice(ip.DstIP.To4())
	}
	if ip, ok := pkt.Layer(layers.LayerTypeIPv6).(*layers.IPv6); ok {
		src, _ = netip.AddrFromSlice(ip.SrcIP)
		dst, _ = netip.AddrFromSlice(ip.DstIP)
	}
	if tcp, ok := pkt.Layer(layers.LayerTypeTCP).(*layers.TCP); ok {
		seg := append(append([]byte(nil), tcp.Contents...), tcp.Payload...)
		if refSum(seg, refPseudo(src, dst, packet.ProtoTCP, len(seg))) != 0xffff {
			t.Errorf("TCP checksum %#04x is wrong", tcp.Checksum)
		}
		// gopacket's own sum over a segment with a valid checksum is zero.
		must(t, tcp.SetNetworkLayerForChecksum(pkt.NetworkLayer()))
		if c, err := tcp.ComputeChecksum(); err != nil || c != 0 {
			t.Errorf("gopacket: TCP checksum does not verify (%#04x, %v)", c, err)
		}
	}
	if udp, ok := pkt.Layer(layers.LayerTypeUDP).(*layers.UDP); ok && !(udp.Checksum == 0 && src.Is4()) {
		seg := append(append([]byte(nil), udp.Contents...), udp.Payload...)
		if refSum(seg, refPseudo(src, dst, packet.ProtoUDP, len(seg))) != 0xffff {
			t.Errorf("UDP checksum %#04x is wrong", udp.Checksum)
		}
	}
	if icmp, ok := pkt.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4); ok {
		msg := append(append([]byte(nil), icmp.Contents...), icmp.Payload...)
		if refSum(msg, 0) != 0xffff {
			t.Errorf("ICMPv4 checksum %#04x is wrong", icmp.Checksum)
		}
	}
	if icmp, ok := pkt.Layer(layers.LayerTypeICMPv6).(*layers.ICMPv6); ok {
		msg := append(append([]byte(nil), icmp.Contents...), icmp.Payload...)
		if refSum(msg, refPseudo(src, dst, packet.ProtoICMPv6, len(msg))) != 0xffff {
			t.Errorf("ICMPv6 checksum %#04x is wrong", icmp.Checksum)
		}
	}
	return pkt
}

// diffBytes reports the first difference between got and want.
func diffBytes(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: length %d, want %d", what, len(got), len(want))
		return
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("%s: byte %d is %#02x, want %#02x\n got % x\nwant % x", what, i, got[i], want[i], got, want)
			return
		}
	}
}
