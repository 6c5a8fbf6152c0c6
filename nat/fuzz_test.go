package nat

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// guard is written after the frame to catch writes past its end.
const guard = 32

// guarded copies data into a buffer followed by guard bytes and returns
// the frame (capacity capped at its length) and the whole buffer.
func guarded(data []byte) (frame, all []byte) {
	all = make([]byte, len(data)+guard)
	copy(all, data)
	for i := len(data); i < len(all); i++ {
		all[i] = 0x5a
	}
	return all[:len(data):len(data)], all
}

func seedFrames(f *testing.F) [][]byte {
	payload := []byte("fuzz seed payload")
	var seeds [][]byte
	for _, s := range []frameSpec{
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn},
		{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPAck, payload: payload, vlan: true, ipOpts: true},
		{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 9053, payload: payload},
		{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 9053, payload: payload, udpNoCheck: true},
		{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: client, dst: vip, sport: 7, payload: payload},
		{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 80, tcpFlags: packet.TCPFin, payload: payload},
		{proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 40000, dport: 9053, payload: payload, vlan: true},
		{proto: packet.ProtoICMPv6, icmpType: packet.ICMPv6EchoReply, src: client6, dst: vip6, sport: 7},
	} {
		frame := s.build(f)
		seeds = append(seeds, frame, partial(s, frame))
	}
	for _, e := range []icmpErrorSpec{
		{outerSrc: backend, outerDst: node, typ: 3, code: 3,
			inner: frameSpec{proto: packet.ProtoUDP, src: node, dst: backend, sport: 1, dport: 2, payload: payload}},
		{outerSrc: backend, outerDst: node, typ: 3, code: 4, rest: 1400, cut: 28,
			inner: frameSpec{proto: packet.ProtoTCP, src: node, dst: backend, sport: 1, dport: 2}},
		{outerSrc: backend, outerDst: node, typ: 11, code: 0,
			inner: frameSpec{proto: packet.ProtoICMP, icmpType: packet.ICMPv4Echo, src: node, dst: backend, sport: 9}},
		{outerSrc: backend6, outerDst: node6, typ: 1, code: 4,
			inner: frameSpec{proto: packet.ProtoTCP, src: node6, dst: backend6, sport: 1, dport: 2, payload: payload}},
	} {
		seeds = append(seeds, e.build(f))
	}
	return seeds
}

// fuzzAddr makes an address of the packet's family from fuzz bytes.
func fuzzAddr(p *packet.Packet, b []byte) packet.Addr {
	var raw [16]byte
	copy(raw[:], b)
	if p.Family == 4 {
		return packet.AddrFrom4([4]byte(raw[:4]))
	}
	raw[0] |= 0x20 // keep it from being IPv4-mapped
	return packet.Addr(raw)
}

// checkUntouched fails when the rewrite changed bytes outside the IP
// datagram (Ethernet header, padding) or past the frame.
func checkUntouched(t *testing.T, all, before []byte, p *packet.Packet) {
	t.Helper()
	if !bytes.Equal(all[:p.L3], before[:p.L3]) {
		t.Fatalf("link header changed")
	}
	if !bytes.Equal(all[p.End:], before[p.End:]) {
		t.Fatalf("bytes past the IP datagram changed")
	}
}

func FuzzRewrite(f *testing.F) {
	for _, s := range seedFrames(f) {
		f.Add(s, []byte("0123456789abcdef0123456789abcdef"), uint16(61000), uint16(8080), uint8(0xff))
	}
	f.Fuzz(func(t *testing.T, data, addrs []byte, srcPort, dstPort uint16, ops uint8) {
		frame, all := guarded(data)
		var p packet.Packet
		if packet.Parse(frame, &p) != packet.OK {
			return
		}
		before := append([]byte(nil), all...)
		ipValid := ValidIPHeader(frame, &p)
		l4Valid := ValidL4(frame, &p)
		end := p.End

		if ops&1 != 0 && CompleteIfPartial(frame, &p) {
			if !ValidL4(frame, &p) {
				t.Fatal("completed checksum is not valid")
			}
			l4Valid = true
		}
		if ops&2 != 0 {
			DecrementTTL(frame, &p)
		}
		if len(addrs) < 32 {
			addrs = append(addrs, make([]byte, 32-len(addrs))...)
		}
		src, dst := fuzzAddr(&p, addrs[:16]), fuzzAddr(&p, addrs[16:])
		var ok bool
		switch ops >> 2 & 3 {
		case 0:
			ok = Rewrite(frame, &p, packet.Tuple{Src: src, Dst: dst, SrcPort: srcPort, DstPort: dstPort})
		case 1:
			ok = RewriteSrc(frame, &p, src, srcPort)
		case 2:
			ok = RewriteDst(frame, &p, dst, dstPort)
		case 3:
			ok = RewriteSrc(frame, &p, src, srcPort) && RewriteDst(frame, &p, dst, dstPort)
		}
		if !ok {
			t.Fatal("rewrite refused an address of the packet's family")
		}
		if p.End != end {
			t.Fatal("packet end moved")
		}
		checkUntouched(t, all, before, &p)
		if ipValid && !ValidIPHeader(frame, &p) {
			t.Fatal("IPv4 header checksum broken")
		}
		if l4Valid && !ValidL4(frame, &p) {
			t.Fatal("L4 checksum broken")
		}
		var again packet.Packet
		if r := packet.Parse(frame, &again); r != packet.OK || again != p {
			t.Fatalf("packet does not describe the frame (%v):\n got %+v\nwant %+v", r, p, again)
		}
	})
}

func FuzzTranslateICMPError(f *testing.F) {
	for _, s := range seedFrames(f) {
		f.Add(s, []byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"), uint16(40000), uint16(80))
	}
	f.Fuzz(func(t *testing.T, data, addrs []byte, srcPort, dstPort uint16) {
		frame, all := guarded(data)
		var p packet.Packet
		if packet.Parse(frame, &p) != packet.OK || !p.IsICMPError {
			return
		}
		before := append([]byte(nil), all...)
		ipValid := ValidIPHeader(frame, &p)
		icmpValid := ValidL4(frame, &p)
		innerIPValid := p.Family == 4 && innerIPHeaderValid(frame, &p)
		quoteL4Valid := innerL4Valid(frame, &p)

		if len(addrs) < 64 {
			addrs = append(addrs, make([]byte, 64-len(addrs))...)
		}
		ok := TranslateICMPError(frame, &p, fuzzAddr(&p, addrs[0:16]), fuzzAddr(&p, addrs[16:32]),
			fuzzAddr(&p, addrs[32:48]), fuzzAddr(&p, addrs[48:64]), srcPort, dstPort)
		if !ok {
			t.Fatal("refused")
		}
		checkUntouched(t, all, before, &p)
		if ipValid && !ValidIPHeader(frame, &p) {
			t.Fatal("outer IPv4 header checksum broken")
		}
		if icmpValid && !ValidL4(frame, &p) {
			t.Fatal("ICMP checksum broken")
		}
		if innerIPValid && !innerIPHeaderValid(frame, &p) {
			t.Fatal("quoted IPv4 header checksum broken")
		}
		if quoteL4Valid && !innerL4Valid(frame, &p) {
			t.Fatal("quoted L4 checksum broken")
		}
		var again packet.Packet
		if r := packet.Parse(frame, &again); r != packet.OK || again != p {
			t.Fatalf("packet does not describe the frame (%v):\n got %+v\nwant %+v", r, p, again)
		}
	})
}

func innerIPHeaderValid(frame []byte, p *packet.Packet) bool {
	return Fold(Sum(frame[p.Inner.L3:p.Inner.L4], 0)) == 0xffff
}

// innerL4Valid reports whether the quote holds a whole datagram whose L4
// checksum is valid, by parsing the quote as a frame of its own.
func innerL4Valid(frame []byte, p *packet.Packet) bool {
	q := make([]byte, packet.EthernetLen+p.End-p.Inner.L3)
	et := uint16(packet.EtherTypeIPv4)
	if p.Family == 6 {
		et = packet.EtherTypeIPv6
	}
	binary.BigEndian.PutUint16(q[12:], et)
	copy(q[packet.EthernetLen:], frame[p.Inner.L3:p.End])
	var ip packet.Packet
	if packet.Parse(q, &ip) != packet.OK || ip.End != len(q) || ip.IsICMPError {
		return false
	}
	return ValidL4(q, &ip)
}

func FuzzBuildReplies(f *testing.F) {
	for _, s := range seedFrames(f) {
		f.Add(s, uint16(2048), uint8(3))
	}
	f.Fuzz(func(t *testing.T, data []byte, room uint16, code uint8) {
		var p packet.Packet
		if packet.Parse(data, &p) != packet.OK {
			return
		}
		// TCP reset, in the frame's own buffer.
		frame, all := guarded(data)
		packet.Parse(frame, &p)
		if n, ok := BuildTCPReset(frame, &p); ok {
			if n > len(frame) {
				t.Fatalf("reset of %d bytes grew past the frame of %d", n, len(frame))
			}
			checkReply(t, frame[:n], false)
		} else if !bytes.Equal(all[:len(data)], data) {
			t.Fatal("refused reset changed the frame")
		}
		for i := len(data); i < len(all); i++ {
			if all[i] != 0x5a {
				t.Fatal("reset wrote past the frame")
			}
		}

		// ICMP unreachable, in a buffer with room to grow.
		size := max(int(room)%4096, len(data))
		grown := make([]byte, size)
		copy(grown, data)
		buf, all := guarded(grown)
		packet.Parse(buf[:len(data)], &p)
		if n, ok := BuildICMPUnreachable(buf, len(data), &p, code); ok {
			if n > len(buf) {
				t.Fatalf("reply of %d bytes past the buffer of %d", n, len(buf))
			}
			checkReply(t, buf[:n], true)
		} else if !bytes.Equal(all[:len(data)], data) {
			t.Fatal("refused ICMP error changed the frame")
		}
		for i := size; i < len(all); i++ {
			if all[i] != 0x5a {
				t.Fatal("ICMP error wrote past the buffer")
			}
		}
	})
}

func checkReply(t *testing.T, reply []byte, icmpError bool) {
	t.Helper()
	var rp packet.Packet
	r := packet.Parse(reply, &rp)
	if r != packet.OK && !(icmpError && r == packet.PassICMPOther) {
		// A quote the parser will not match (a later fragment or other
		// protocol inside) is still a well-formed error.
		t.Fatalf("reply does not parse: %v", r)
	}
	if rp.End != len(reply) {
		t.Fatalf("reply datagram ends at %d of %d", rp.End, len(reply))
	}
	if !ValidIPHeader(reply, &rp) {
		t.Fatal("reply IPv4 header checksum wrong")
	}
	if r == packet.OK && !ValidL4(reply, &rp) {
		t.Fatal("reply L4 checksum wrong")
	}
	if icmpError && r == packet.OK && !rp.IsICMPError {
		t.Fatal("reply is not an ICMP error")
	}
	if !icmpError && rp.TCPFlags&packet.TCPRst == 0 {
		t.Fatal("reset without RST")
	}
}
