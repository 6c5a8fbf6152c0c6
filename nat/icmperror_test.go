package nat

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// icmpErrorSpec is an ICMP error from outerSrc to outerDst quoting the
// first cut bytes (all if cut is 0) of the IP datagram inner describes.
type icmpErrorSpec struct {
	vlan               bool
	outerSrc, outerDst netip.Addr
	typ, code          uint8
	rest               uint32 // unused field or MTU
	inner              frameSpec
	cut                int
}

func (e icmpErrorSpec) build(t testing.TB) []byte {
	t.Helper()
	inner := e.inner.build(t)
	quote := inner[l4Offset(e.inner)-ipHeaderLen(e.inner) : ipEnd(inner, e.inner)]
	if e.cut > 0 {
		quote = quote[:e.cut]
	}
	outer := frameSpec{vlan: e.vlan, src: e.outerSrc, dst: e.outerDst}
	var ls []gopacket.SerializableLayer
	var nl gopacket.NetworkLayer
	if e.outerSrc.Is4() {
		ls, _ = outer.ipLayers(t, packet.ProtoICMP)
		ls = append(ls, &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(e.typ, e.code),
			Id: uint16(e.rest >> 16), Seq: uint16(e.rest)}, gopacket.Payload(quote))
	} else {
		ls, nl = outer.ipLayers(t, packet.ProtoICMPv6)
		icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(e.typ, e.code)}
		must(t, icmp.SetNetworkLayerForChecksum(nl))
		ls = append(ls, icmp, gopacket.Payload(binary.BigEndian.AppendUint32(nil, e.rest)), gopacket.Payload(quote))
	}
	buf := gopacket.NewSerializeBuffer()
	must(t, gopacket.SerializeLayers(buf, serializeOpts, ls...))
	return append([]byte(nil), buf.Bytes()...)
}

func ipHeaderLen(s frameSpec) int {
	switch {
	case s.src.Is6():
		return packet.IPv6Len
	case s.ipOpts:
		return 24
	}
	return packet.IPv4MinLen
}

func TestTranslateICMPError(t *testing.T) {
	payload := []byte("some request payload that was too big or unwanted")
	// The translated packet that provoked the error went from node:61000
	// (SNAT) to backend:8080 (DNAT); the client knows it as client:40000 to
	// vip:80. The error comes from the backend or a router on the way.
	udp := frameSpec{proto: packet.ProtoUDP, src: node, dst: backend, sport: 61000, dport: 8080, payload: payload}
	tcp := frameSpec{proto: packet.ProtoTCP, src: node, dst: backend, sport: 61000, dport: 8080, seq: 99, ack: 77, tcpFlags: packet.TCPAck, payload: payload}
	echo := frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: node, dst: backend, sport: 0x9999, payload: payload}
	udp6 := frameSpec{proto: packet.ProtoUDP, src: node6, dst: backend6, sport: 61000, dport: 8080, payload: payload}
	tcp6 := frameSpec{proto: packet.ProtoTCP, src: node6, dst: backend6, sport: 61000, dport: 8080, payload: payload}
	echo6 := frameSpec{proto: packet.ProtoICMPv6, icmpType: packet.ICMPv6Echo, src: node6, dst: backend6, sport: 0x9999, payload: payload}
	router := netip.MustParseAddr("198.18.9.1")
	router6 := netip.MustParseAddr("2001:db8:9::1")
	with := func(s frameSpec, f func(*frameSpec)) frameSpec { f(&s); return s }

	cases := []struct {
		name string
		e    icmpErrorSpec
	}{
		{"udp port unreachable", icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 3, inner: udp}},
		{"udp port unreachable 8 bytes", icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 3, inner: udp, cut: 28}},
		{"udp no checksum", icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 3, inner: with(udp, func(s *frameSpec) { s.udpNoCheck = true })}},
		{"udp frag needed vlan", icmpErrorSpec{vlan: true, outerSrc: router, outerDst: node, typ: 3, code: 4, rest: 1400, inner: udp}},
		{"tcp frag needed full quote", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 3, code: 4, rest: 1280, inner: tcp}},
		{"tcp 8 bytes, no checksum quoted", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 3, code: 4, rest: 1280, inner: tcp, cut: 28}},
		{"tcp 18 bytes, checksum quoted", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 3, code: 4, rest: 1280, inner: tcp, cut: 38}},
		{"tcp header only", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 11, code: 0, inner: tcp, cut: 40}},
		{"tcp inner options", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 11, code: 0, inner: with(tcp, func(s *frameSpec) { s.ipOpts = true })}},
		{"host unreachable echo", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 3, code: 1, inner: echo}},
		{"time exceeded echo 8 bytes", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 11, code: 0, inner: echo, cut: 28}},
		{"param problem udp", icmpErrorSpec{outerSrc: router, outerDst: node, typ: 12, code: 0, rest: 20 << 24, inner: udp}},
		{"udp6 port unreachable", icmpErrorSpec{outerSrc: backend6, outerDst: node6, typ: 1, code: 4, inner: udp6}},
		{"udp6 vlan 8 bytes", icmpErrorSpec{vlan: true, outerSrc: backend6, outerDst: node6, typ: 1, code: 4, inner: udp6, cut: 48}},
		{"tcp6 packet too big", icmpErrorSpec{outerSrc: router6, outerDst: node6, typ: 2, code: 0, rest: 1280, inner: tcp6}},
		{"tcp6 8 bytes", icmpErrorSpec{outerSrc: router6, outerDst: node6, typ: 3, code: 0, inner: tcp6, cut: 48}},
		{"echo6 time exceeded", icmpErrorSpec{outerSrc: router6, outerDst: node6, typ: 3, code: 0, inner: echo6}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			frame := c.e.build(t)
			p := mustParse(t, frame)
			if !p.IsICMPError {
				t.Fatal("test setup: not an ICMP error")
			}
			// Reverse the translation: the error goes to the client, from
			// the VIP if the backend sent it, and quotes client -> vip.
			want := c.e
			cl, v := client, vip
			if c.e.outerSrc.Is6() {
				cl, v = client6, vip6
			}
			want.outerDst = cl
			if c.e.outerSrc == c.e.inner.dst {
				want.outerSrc = v
			}
			want.inner.src, want.inner.dst = cl, v
			want.inner.sport, want.inner.dport = 40000, 80
			if c.e.inner.proto == packet.ProtoICMP || c.e.inner.proto == packet.ProtoICMPv6 {
				want.inner.sport, want.inner.dport = 0x4242, 0x4242
			}
			ok := TranslateICMPError(frame, p,
				packet.AddrFromNetip(want.outerSrc), packet.AddrFromNetip(want.outerDst),
				packet.AddrFromNetip(want.inner.src), packet.AddrFromNetip(want.inner.dst),
				want.inner.sport, want.inner.dport)
			if !ok {
				t.Fatal("refused")
			}
			wantFrame := want.build(t)
			diffBytes(t, "frame", frame, wantFrame)
			pkt := verifyChecksums(t, frame)

			// The quote, decoded on its own, carries the client's view and
			// a valid IPv4 header checksum.
			var quote []byte
			if icmp, ok := pkt.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4); ok {
				quote = icmp.Payload
				if binary.BigEndian.Uint32(icmp.Contents[4:8]) != c.e.rest {
					t.Errorf("rest of header (MTU) changed")
				}
			} else {
				quote = pkt.Layer(layers.LayerTypeICMPv6).LayerPayload()[4:]
			}
			first := layers.LayerTypeIPv4
			if cl.Is6() {
				first = layers.LayerTypeIPv6
			}
			in := gopacket.NewPacket(quote, first, gopacket.Default)
			if ip, ok := in.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok {
				if refSum(ip.Contents, 0) != 0xffff {
					t.Error("quoted IPv4 header checksum wrong")
				}
			}
			nl := in.NetworkLayer()
			if nl == nil {
				t.Fatal("gopacket: quote has no IP header")
			}
			if got := fmt.Sprint(nl.NetworkFlow()); got != fmt.Sprintf("%v->%v", cl, v) {
				t.Errorf("quoted addresses %s", got)
			}
			if tl := in.TransportLayer(); tl != nil && in.ErrorLayer() == nil {
				if got := fmt.Sprint(tl.TransportFlow()); got != "40000->80" {
					t.Errorf("quoted ports %s", got)
				}
			}
			l4 := quote[ipHeaderLen(c.e.inner):]
			if c.e.inner.proto == packet.ProtoICMP || c.e.inner.proto == packet.ProtoICMPv6 {
				if id := binary.BigEndian.Uint16(l4[4:]); id != want.inner.sport {
					t.Errorf("quoted echo identifier %#x", id)
				}
			} else if sp, dp := binary.BigEndian.Uint16(l4[0:]), binary.BigEndian.Uint16(l4[2:]); sp != 40000 || dp != 80 {
				t.Errorf("quoted ports %d->%d", sp, dp)
			}
			if p.InnerTuple() != want.inner.tuple() || p.Src != packet.AddrFromNetip(want.outerSrc) || p.Dst != packet.AddrFromNetip(want.outerDst) {
				t.Errorf("packet not updated: outer %v %v inner %v", p.Src, p.Dst, p.InnerTuple())
			}
			if again := mustParse(t, frame); *again != *p {
				t.Errorf("packet does not match the frame:\n got %+v\nwant %+v", *p, *again)
			}
		})
	}
}

func TestTranslateICMPErrorRefuses(t *testing.T) {
	s := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2}
	frame := s.build(t)
	orig := append([]byte(nil), frame...)
	a := packet.AddrFromNetip(node)
	if TranslateICMPError(frame, mustParse(t, frame), a, a, a, a, 1, 2) {
		t.Error("a UDP packet translated as ICMP error")
	}
	e := icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 3, inner: s}
	frame = e.build(t)
	orig = append(orig[:0], frame...)
	if TranslateICMPError(frame, mustParse(t, frame), a, a, packet.AddrFromNetip(client6), a, 1, 2) {
		t.Error("IPv6 inner address accepted for IPv4")
	}
	diffBytes(t, "refused", frame, orig)
}
