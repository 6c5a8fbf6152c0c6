package nat

import (
	"encoding/binary"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// partial returns frame as a sender with checksum offload hands it over:
// the L4 checksum field holds the folded pseudo-header sum.
func partial(s frameSpec, frame []byte) []byte {
	f := append([]byte(nil), frame...)
	off := l4Offset(s)
	l4Len := ipEnd(f, s) - off
	binary.BigEndian.PutUint16(f[off+l4ChecksumOffset(s.proto):], uint16(refPseudo(s.src, s.dst, s.proto, l4Len)))
	return f
}

// ipEnd is where the IP datagram in a frame built from s ends: gopacket
// pads short frames to the Ethernet minimum.
func ipEnd(frame []byte, s frameSpec) int {
	l3 := l4Offset(s) - ipHeaderLen(s)
	if s.src.Is6() {
		return l3 + packet.IPv6Len + int(binary.BigEndian.Uint16(frame[l3+4:]))
	}
	return l3 + int(binary.BigEndian.Uint16(frame[l3+2:]))
}

func partialSpecs() map[string]frameSpec {
	return map[string]frameSpec{
		"tcp syn":         {proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, seq: 12345, tcpFlags: packet.TCPSyn},
		"tcp data":        {proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPAck, payload: []byte("hello, partial world")},
		"tcp vlan opts":   {proto: packet.ProtoTCP, src: client, dst: vip, sport: 1, dport: 2, vlan: true, ipOpts: true, payload: []byte("x")},
		"udp":             {proto: packet.ProtoUDP, src: client, dst: vip, sport: 5353, dport: 9053, payload: []byte("query")},
		"udp vlan":        {proto: packet.ProtoUDP, src: client, dst: vip, sport: 5353, dport: 9053, vlan: true, payload: make([]byte, 1000)},
		"tcp6":            {proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn},
		"udp6":            {proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 5353, dport: 9053, payload: []byte("query6")},
		"udp6 vlan empty": {proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 5353, dport: 9053, vlan: true},
	}
}

func TestCompleteIfPartial(t *testing.T) {
	for name, s := range partialSpecs() {
		t.Run(name, func(t *testing.T) {
			want := s.build(t)
			frame := partial(s, want)
			p := mustParse(t, frame)
			if ValidL4(frame, p) {
				t.Fatal("test setup: partial checksum already valid")
			}
			if !CompleteIfPartial(frame, p) {
				t.Fatal("partial checksum not detected")
			}
			diffBytes(t, "completed", frame, want)
			verifyChecksums(t, frame)
			if !ValidL4(frame, p) {
				t.Error("ValidL4 false after completion")
			}

			// A complete checksum is left alone.
			again := append([]byte(nil), want...)
			if CompleteIfPartial(again, mustParse(t, again)) {
				t.Error("complete checksum taken for partial")
			}
			diffBytes(t, "complete frame", again, want)

			// Completion followed by a rewrite gives what gopacket
			// computes for the translated packet.
			frame = partial(s, want)
			p = mustParse(t, frame)
			CompleteIfPartial(frame, p)
			to := s.tuple()
			to.Dst = packet.AddrFromNetip(backend)
			if s.src.Is6() {
				to.Dst = packet.AddrFromNetip(backend6)
			}
			to.DstPort = 8080
			Rewrite(frame, p, to)
			diffBytes(t, "completed and rewritten", frame, s.withTuple(to).build(t))
		})
	}
}

// TestCompleteIfPartialFalsePositive builds a valid packet whose correct
// checksum equals the folded pseudo-header sum: it is taken for partial,
// and recomputing it changes nothing.
func TestCompleteIfPartialFalsePositive(t *testing.T) {
	for _, proto := range []packet.Proto{packet.ProtoTCP, packet.ProtoUDP} {
		s := frameSpec{proto: proto, src: client, dst: vip, sport: 40000, dport: 9080, payload: make([]byte, 16)}
		frame := s.build(t)
		off := l4Offset(s)
		seg := append([]byte(nil), frame[off:ipEnd(frame, s)]...)
		cs := l4ChecksumOffset(proto)
		seg[cs], seg[cs+1] = 0, 0
		pseudo := uint32(refPseudo(s.src, s.dst, proto, len(seg)))
		// Want ~(P + D + w) = P, so w = ~P + ~P + ~D in one's complement.
		d := uint32(refSum(seg, 0))
		w := refSum(nil, (^pseudo&0xffff)*2+(^d&0xffff))
		binary.BigEndian.PutUint16(s.payload[6:], w)
		frame = s.build(t)
		if got := binary.BigEndian.Uint16(frame[off+cs:]); got != uint16(pseudo) {
			t.Fatalf("%v: test setup: checksum %#04x, pseudo-header sum %#04x", proto, got, pseudo)
		}
		orig := append([]byte(nil), frame...)
		p := mustParse(t, frame)
		if !ValidL4(frame, p) {
			t.Fatalf("%v: test setup: checksum not valid", proto)
		}
		if !CompleteIfPartial(frame, p) {
			t.Fatalf("%v: coincidence not detected as partial", proto)
		}
		diffBytes(t, proto.String(), frame, orig)
	}
}

func TestCompleteIfPartialLeavesAlone(t *testing.T) {
	udpNone := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, udpNoCheck: true, payload: []byte("no checksum")}
	echo := frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: client, dst: vip, sport: 7}
	for _, s := range []frameSpec{udpNone, echo} {
		frame := s.build(t)
		orig := append([]byte(nil), frame...)
		if CompleteIfPartial(frame, mustParse(t, frame)) {
			t.Errorf("%v: completed", s.proto)
		}
		diffBytes(t, s.proto.String(), frame, orig)
	}
	// An ICMP echo whose checksum field happens to hold a "pseudo-header
	// sum" is not touched either: ICMPv4 has no pseudo-header.
	frame := partial(frameSpec{proto: packet.ProtoTCP, src: client, dst: vip}, echo.build(t))
	orig := append([]byte(nil), frame...)
	if CompleteIfPartial(frame, mustParse(t, frame)) {
		t.Error("ICMP completed")
	}
	diffBytes(t, "icmp", frame, orig)
}

func TestValidChecksums(t *testing.T) {
	for name, s := range partialSpecs() {
		frame := s.build(t)
		p := mustParse(t, frame)
		if !ValidIPHeader(frame, p) || !ValidL4(frame, p) {
			t.Errorf("%s: valid frame reported invalid", name)
		}
		bad := append([]byte(nil), frame...)
		bad[p.End-1] ^= 0x40 // the last L4 byte
		if ValidL4(bad, mustParse(t, bad)) {
			t.Errorf("%s: corrupted L4 reported valid", name)
		}
		if s.src.Is4() {
			bad = append([]byte(nil), frame...)
			bad[p.L3+8] ^= 1 // TTL
			if ValidIPHeader(bad, mustParse(t, bad)) {
				t.Errorf("%s: corrupted IPv4 header reported valid", name)
			}
		}
	}
	udpNone := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 1, dport: 2, udpNoCheck: true}
	frame := udpNone.build(t)
	if !ValidL4(frame, mustParse(t, frame)) {
		t.Error("IPv4 UDP without checksum reported invalid")
	}
}
