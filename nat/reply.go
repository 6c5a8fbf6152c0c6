package nat

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Header fields of the replies xdproxy builds itself.
const (
	replyTTL = 64
	// ICMP errors travel with precedence "internetwork control", as the
	// kernel sends them.
	icmpErrorTOS = 0xc0
	ipv4DontFrag = 0x4000

	// Most an ICMP error may quote: the whole error fits the minimum MTU,
	// 576 bytes for IPv4 (RFC 1812 4.3.2.3), 1280 for IPv6 (RFC 4443 2.4).
	maxICMPv4Error = 576
	maxICMPv6Error = 1280
)

// BuildTCPReset turns the TCP segment in frame into the RST that answers
// it (RFC 793, "Reset Generation"), in the same buffer: MAC addresses,
// IP addresses and ports swapped, any VLAN tag kept. A segment with ACK
// gets <SEQ=SEG.ACK><CTL=RST>; one without gets
// <SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>, SYN and FIN counting one
// each. The reply has no IP or TCP options and is never longer than the
// segment. It returns the reply's length.
//
// It refuses (ok false, frame untouched) anything but an unfragmented TCP
// segment, and a segment that is itself a RST, which must never be
// answered. This is kube-proxy's REJECT --reject-with tcp-reset for a
// service without endpoints. p no longer describes the frame afterwards.
func BuildTCPReset(frame []byte, p *packet.Packet) (n int, ok bool) {
	if p.Proto != packet.ProtoTCP || p.L4 == 0 || p.Fragmented || p.TCPFlags&packet.TCPRst != 0 {
		return 0, false
	}
	in := frame[p.L4:p.End]
	seq := binary.BigEndian.Uint32(in[4:8])
	ack := binary.BigEndian.Uint32(in[8:12])
	segLen := uint32(len(in) - int(in[12]>>4)*4)
	if p.TCPFlags&packet.TCPSyn != 0 {
		segLen++
	}
	if p.TCPFlags&packet.TCPFin != 0 {
		segLen++
	}
	flags := uint8(packet.TCPRst)
	if p.TCPFlags&packet.TCPAck != 0 {
		seq, ack = ack, 0
	} else {
		seq, ack = 0, seq+segLen
		flags |= packet.TCPAck
	}

	swapMACs(frame)
	src, dst := p.Dst, p.Src
	l4 := writeIPHeader(frame, p, src, dst, packet.ProtoTCP, packet.TCPMinLen, 0)
	t := frame[l4 : l4+packet.TCPMinLen]
	binary.BigEndian.PutUint16(t[0:2], p.DstPort)
	binary.BigEndian.PutUint16(t[2:4], p.SrcPort)
	binary.BigEndian.PutUint32(t[4:8], seq)
	binary.BigEndian.PutUint32(t[8:12], ack)
	t[12] = 5 << 4
	t[13] = flags
	clear(t[14:20]) // window, checksum, urgent pointer
	binary.BigEndian.PutUint16(t[16:18], Checksum(t, PseudoHeaderSum(src, dst, packet.ProtoTCP, len(t))))
	return l4 + len(t), true
}

// BuildICMPUnreachable turns the frame into an ICMP destination
// unreachable error with the given code, sent from the address the client
// sent to (the service VIP) back to the client: kube-proxy's REJECT
// --reject-with icmp-port-unreachable for a UDP service without endpoints
// (code packet.ICMPv4CodePortUnr for IPv4; 4 is port unreachable in
// ICMPv6). See BuildICMPError.
func BuildICMPUnreachable(buf []byte, frameLen int, p *packet.Packet, code uint8) (n int, ok bool) {
	typ := uint8(packet.ICMPv4DestUnreach)
	if p.Family == 6 {
		typ = packet.ICMPv6DestUnreach
	}
	return BuildICMPError(buf, frameLen, p, p.Dst, typ, code, 0)
}

// BuildICMPError turns the frame held in buf[:frameLen] into an ICMP or
// ICMPv6 error of type typ and code from the address from, quoting the
// original IP datagram: as much of it as fits in 576 bytes of IPv4 error
// (RFC 1812) or 1280 of IPv6 (RFC 4443), and no more than len(buf) allows,
// but at least its IP header and eight bytes of L4 header. rest is the
// 32-bit field after the checksum: zero, or the next-hop MTU of
// fragmentation needed (IPv4, in its low 16 bits) or packet too big (IPv6).
// The reply may be longer than the frame, so buf should be the whole
// buffer the frame sits in. MAC addresses are swapped, any VLAN tag kept.
//
// It refuses (ok false, buf untouched) what must not be answered with an
// error (RFC 1122 3.2.2, RFC 4443 2.4): ICMP errors, later fragments, and
// packets from an address that is not unicast or to a multicast or
// broadcast address; it also refuses a from of the wrong family and a
// buffer too short for the minimum quote. p no longer describes the frame
// afterwards.
func BuildICMPError(buf []byte, frameLen int, p *packet.Packet, from packet.Addr, typ, code uint8, rest uint32) (n int, ok bool) {
	if p.IsICMPError || p.IsLaterFragment() || p.L4 == 0 || p.End > frameLen || frameLen > len(buf) {
		return 0, false
	}
	v4 := p.Family == 4
	if from.Is4() != v4 || !unicastSource(p.Src) || !unicastDestination(p.Dst) {
		return 0, false
	}
	ipLen, maxLen, proto := packet.IPv6Len, maxICMPv6Error, packet.ProtoICMPv6
	if v4 {
		ipLen, maxLen, proto = packet.IPv4MinLen, maxICMPv4Error, packet.ProtoICMP
	}
	quoteAt := p.L3 + ipLen + packet.ICMPLen
	quote := min(p.End-p.L3, maxLen-ipLen-packet.ICMPLen, len(buf)-quoteAt)
	if quote < p.L4-p.L3+8 {
		return 0, false
	}
	copy(buf[quoteAt:quoteAt+quote], buf[p.L3:p.L3+quote]) // overlapping: copy moves

	swapMACs(buf)
	dst := p.Src
	l4 := writeIPHeader(buf, p, from, dst, proto, packet.ICMPLen+quote, icmpErrorTOS)
	msg := buf[l4 : quoteAt+quote]
	msg[0], msg[1], msg[2], msg[3] = typ, code, 0, 0
	binary.BigEndian.PutUint32(msg[4:8], rest)
	var ps uint64
	if !v4 {
		ps = PseudoHeaderSum(from, dst, proto, len(msg))
	}
	binary.BigEndian.PutUint16(msg[2:4], Checksum(msg, ps))
	return quoteAt + quote, true
}

// writeIPHeader writes a fresh IP header without options at p.L3 and
// returns where its payload starts. The IPv4 one is an atomic datagram
// (DF set, ID zero, RFC 6864) with its checksum filled in.
func writeIPHeader(frame []byte, p *packet.Packet, src, dst packet.Addr, proto packet.Proto, payloadLen int, tos uint8) int {
	if p.Family == 6 {
		h := frame[p.L3 : p.L3+packet.IPv6Len]
		h[0], h[1], h[2], h[3] = 6<<4|tos>>4, tos<<4, 0, 0
		binary.BigEndian.PutUint16(h[4:6], uint16(payloadLen))
		h[6], h[7] = uint8(proto), replyTTL
		copy(h[8:24], src[:])
		copy(h[24:40], dst[:])
		return p.L3 + packet.IPv6Len
	}
	h := frame[p.L3 : p.L3+packet.IPv4MinLen]
	h[0], h[1] = 4<<4|5, tos
	binary.BigEndian.PutUint16(h[2:4], uint16(packet.IPv4MinLen+payloadLen))
	binary.BigEndian.PutUint32(h[4:8], ipv4DontFrag)
	h[8], h[9], h[10], h[11] = replyTTL, uint8(proto), 0, 0
	copy(h[12:16], src[12:])
	copy(h[16:20], dst[12:])
	binary.BigEndian.PutUint16(h[10:12], Checksum(h, 0))
	return p.L3 + packet.IPv4MinLen
}

func swapMACs(frame []byte) {
	var tmp [6]byte
	copy(tmp[:], frame[0:6])
	copy(frame[0:6], frame[6:12])
	copy(frame[6:12], tmp[:])
}

// unicastSource reports whether a may be the source of a packet that is
// answered with an ICMP error: not unspecified, loopback, multicast,
// broadcast or IPv4 "this network".
func unicastSource(a packet.Addr) bool {
	if a.Is4() {
		b := a[12]
		return b != 0 && b != 127 && b < 224
	}
	return !a.IsZero() && a[0] != 0xff && a != packet.Addr{15: 1}
}

// unicastDestination reports whether a packet sent to a may be answered
// with an ICMP error: not multicast or limited broadcast. (Subnet
// broadcasts are not known here; a VIP is never one.)
func unicastDestination(a packet.Addr) bool {
	if a.Is4() {
		return a[12] < 224
	}
	return a[0] != 0xff
}
