package packet

import (
	"bytes"
	"net"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
)

var (
	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 1}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 2}
)

// build serializes layers with lengths and checksums computed by gopacket.
func build(t testing.TB, ls ...gopacket.SerializableLayer) []byte {
	t.Helper()
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	for _, l := range ls {
		if n, ok := l.(interface {
			SetNetworkLayerForChecksum(gopacket.NetworkLayer) error
		}); ok {
			for _, o := range ls {
				if nl, ok := o.(gopacket.NetworkLayer); ok {
					_ = n.SetNetworkLayerForChecksum(nl)
				}
			}
		}
	}
	if err := gopacket.SerializeLayers(buf, opts, ls...); err != nil {
		t.Fatal(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

func eth(et layers.EthernetType) *layers.Ethernet {
	return &layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: et}
}

func ip4(proto layers.IPProtocol) *layers.IPv4 {
	return &layers.IPv4{Version: 4, TTL: 64, Protocol: proto, Id: 0x1234,
		SrcIP: net.IPv4(198, 18, 0, 2), DstIP: net.IPv4(198, 19, 0, 10)}
}

func TestParseTable(t *testing.T) {
	tcpSyn := &layers.TCP{SrcPort: 40000, DstPort: 80, SYN: true, Seq: 1, Window: 1000}
	udp := &layers.UDP{SrcPort: 5353, DstPort: 53}
	withOptions := ip4(layers.IPProtocolTCP)
	withOptions.Options = []layers.IPv4Option{{OptionType: 1}, {OptionType: 1}, {OptionType: 1}, {OptionType: 0}}
	frag := ip4(layers.IPProtocolUDP)
	frag.Flags = layers.IPv4MoreFragments
	laterFrag := ip4(layers.IPProtocolUDP)
	laterFrag.FragOffset = 185 // 1480 bytes

	cases := []struct {
		name     string
		frame    []byte
		want     Reason
		proto    Proto
		srcPort  uint16
		dstPort  uint16
		vlan     bool
		l4       int
		fragment bool
	}{
		{"tcp syn", build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), tcpSyn), OK, ProtoTCP, 40000, 80, false, 34, false},
		{"udp", build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolUDP), udp, gopacket.Payload("q")), OK, ProtoUDP, 5353, 53, false, 34, false},
		{"ipv4 options skipped", build(t, eth(layers.EthernetTypeIPv4), withOptions, tcpSyn), OK, ProtoTCP, 40000, 80, false, 38, false},
		{"vlan", build(t, &layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: layers.EthernetTypeDot1Q},
			&layers.Dot1Q{VLANIdentifier: 7, Type: layers.EthernetTypeIPv4}, ip4(layers.IPProtocolTCP), tcpSyn), OK, ProtoTCP, 40000, 80, true, 38, false},
		{"icmp echo", build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolICMPv4),
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0), Id: 77, Seq: 1}), OK, ProtoICMP, 77, 77, false, 34, false},
		{"first fragment", build(t, eth(layers.EthernetTypeIPv4), frag, udp, gopacket.Payload(make([]byte, 64))), OK, ProtoUDP, 5353, 53, false, 34, true},
		{"later fragment", build(t, eth(layers.EthernetTypeIPv4), laterFrag, gopacket.Payload(make([]byte, 64))), OK, ProtoUDP, 0, 0, false, 0, true},
		{"arp", build(t, eth(layers.EthernetTypeARP), &layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4,
			HwAddressSize: 6, ProtAddressSize: 4, SourceHwAddress: macA, SourceProtAddress: []byte{1, 2, 3, 4},
			DstHwAddress: macB, DstProtAddress: []byte{1, 2, 3, 5}}), PassNotIP, 0, 0, 0, false, 0, false},
		{"gre", build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolGRE), gopacket.Payload(make([]byte, 8))), PassOtherProto, 47, 0, 0, false, 0, false},
		{"short ethernet", make([]byte, 10), DropShortEthernet, 0, 0, 0, false, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var p Packet
			got := Parse(c.frame, &p)
			if got != c.want {
				t.Fatalf("Parse = %v, want %v", got, c.want)
			}
			if got != OK {
				return
			}
			if p.Proto != c.proto || p.SrcPort != c.srcPort || p.DstPort != c.dstPort || p.HasVLAN != c.vlan || p.L4 != c.l4 || p.Fragmented != c.fragment {
				t.Fatalf("got %+v", p)
			}
			if p.Src != MustParseAddr("198.18.0.2") || p.Dst != MustParseAddr("198.19.0.10") {
				t.Fatalf("addresses %v -> %v", p.Src, p.Dst)
			}
		})
	}
}

func TestParseICMPErrorQuote(t *testing.T) {
	inner := build(t, ip4(layers.IPProtocolUDP), &layers.UDP{SrcPort: 5353, DstPort: 53})
	outer := ip4(layers.IPProtocolICMPv4)
	outer.SrcIP, outer.DstIP = net.IPv4(198, 18, 1, 11), net.IPv4(198, 18, 0, 2)
	frame := build(t, eth(layers.EthernetTypeIPv4), outer,
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(3, 3)}, gopacket.Payload(inner))
	var p Packet
	if r := Parse(frame, &p); r != OK {
		t.Fatal(r)
	}
	if !p.IsICMPError || p.Inner.Proto != ProtoUDP || p.Inner.SrcPort != 5353 || p.Inner.DstPort != 53 ||
		p.Inner.Dst != MustParseAddr("198.19.0.10") {
		t.Fatalf("inner %+v", p.Inner)
	}
	// A quote cut before the ports is dropped, not misread.
	short := frame[:len(frame)-6]
	short[17] -= 6 // IPv4 total length low byte
	if r := Parse(short, &p); r != DropShortICMPQuote {
		t.Fatalf("short quote: %v", r)
	}
	// A quoted echo is one of the error's own ICMP version.
	for _, q := range []struct {
		name  string
		proto layers.IPProtocol
		typ   uint8
		want  Reason
	}{
		{"echo request", layers.IPProtocolICMPv4, ICMPv4Echo, OK},
		{"echo reply", layers.IPProtocolICMPv4, ICMPv4EchoReply, OK},
		{"ICMPv6 echo request type", layers.IPProtocolICMPv4, ICMPv6Echo, PassICMPOther},
		{"ICMPv6 protocol", layers.IPProtocolICMPv6, ICMPv6Echo, PassICMPOther},
	} {
		inner := append(build(t, ip4(q.proto)), q.typ, 0, 0, 0, 0x30, 0x39, 0, 1)
		frame := build(t, eth(layers.EthernetTypeIPv4), outer,
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(3, 1)}, gopacket.Payload(inner))
		if r := Parse(frame, &p); r != q.want || (r == OK && p.Inner.SrcPort != 0x3039) {
			t.Errorf("quoted %s: %v, inner %+v; want %v", q.name, r, p.Inner, q.want)
		}
	}
}

func TestParseIPv6(t *testing.T) {
	ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolTCP,
		SrcIP: net.ParseIP("2001:db8::2"), DstIP: net.ParseIP("2001:db8:1::10")}
	frame := build(t, eth(layers.EthernetTypeIPv6), ip6, &layers.TCP{SrcPort: 1, DstPort: 443, SYN: true})
	var p Packet
	if r := Parse(frame, &p); r != OK {
		t.Fatal(r)
	}
	if p.Family != 6 || p.DstPort != 443 || p.Dst != MustParseAddr("2001:db8:1::10") || p.L4 != 54 {
		t.Fatalf("%+v", p)
	}
}

// TestParseTruncations cuts a valid frame at every length: Parse must never
// panic and must never accept a frame whose headers are cut.
func TestParseTruncations(t *testing.T) {
	frames := [][]byte{
		build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2}),
		build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolUDP), &layers.UDP{SrcPort: 1, DstPort: 2}),
	}
	for _, f := range frames {
		ipEnd := EthernetLen + (int(f[16])<<8 | int(f[17])) // gopacket pads short frames
		for n := 0; n < ipEnd; n++ {
			var p Packet
			if r := Parse(f[:n], &p); r == OK {
				t.Fatalf("truncated to %d bytes accepted", n)
			}
		}
	}
}

func TestBadHeaderFields(t *testing.T) {
	base := build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2})
	mut := func(f func(b []byte)) []byte { b := bytes.Clone(base); f(b); return b }
	cases := map[string]struct {
		frame []byte
		want  Reason
	}{
		"ihl 4":       {mut(func(b []byte) { b[14] = 0x44 }), DropBadIPHeaderLen},
		"version 6":   {mut(func(b []byte) { b[14] = 0x65 }), DropBadIPVersion},
		"total big":   {mut(func(b []byte) { b[16] = 0xff }), DropBadIPTotalLen},
		"tcp doff 4":  {mut(func(b []byte) { b[46] = 0x40 }), DropBadTCPOffset},
		"tcp doff 15": {mut(func(b []byte) { b[46] = 0xf0 }), DropBadTCPOffset},
	}
	for name, c := range cases {
		var p Packet
		if r := Parse(c.frame, &p); r != c.want {
			t.Errorf("%s: %v, want %v", name, r, c.want)
		}
	}
}

func TestParseAllocs(t *testing.T) {
	f := build(t, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2})
	var p Packet
	if n := testing.AllocsPerRun(1000, func() { Parse(f, &p) }); n != 0 {
		t.Fatalf("%v allocs per Parse", n)
	}
}

func BenchmarkParseTCP(b *testing.B) {
	f := build(b, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2})
	var p Packet
	b.ReportAllocs()
	for b.Loop() {
		Parse(f, &p)
	}
}

// FuzzParse checks that no frame makes Parse panic or report offsets
// outside the frame.
func FuzzParse(f *testing.F) {
	f.Add(build(f, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2}))
	f.Add(build(f, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolUDP), &layers.UDP{SrcPort: 1, DstPort: 2}))
	inner := build(f, ip4(layers.IPProtocolTCP), &layers.TCP{SrcPort: 1, DstPort: 2})
	f.Add(build(f, eth(layers.EthernetTypeIPv4), ip4(layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(3, 4)}, gopacket.Payload(inner)))
	f.Fuzz(func(t *testing.T, frame []byte) {
		var p Packet
		if Parse(frame, &p) != OK {
			return
		}
		if p.End > len(frame) || p.L3 >= p.End || p.L4 > p.End || (p.L4 != 0 && p.L4 <= p.L3) {
			t.Fatalf("offsets out of frame: %+v len %d", p, len(frame))
		}
		if p.IsICMPError && (p.Inner.L4+8 > p.End) {
			t.Fatalf("inner offsets out of frame: %+v", p.Inner)
		}
	})
}
