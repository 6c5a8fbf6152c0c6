package nat

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TranslateICMPError rewrites an ICMP error (destination unreachable,
// including fragmentation needed / packet too big, time exceeded,
// parameter problem) that quotes a translated packet, so that it matches
// the addresses the other side of the translation knows.
//
// The outer header gets outerSrc and outerDst. The quoted header gets
// innerSrc, innerDst and the ports innerSrcPort, innerDstPort (for a quoted
// ICMP echo: the identifier, chosen as in Rewrite), and its IPv4 header
// checksum is updated. The quoted L4 checksum is updated only when the
// quote holds it: a TCP quote cut after eight bytes has none, and a quoted
// UDP checksum of zero stays zero. The outer ICMP checksum, which covers
// the whole message and so every change in the quote, is updated last.
// Everything else, the MTU of fragmentation needed included, is kept.
//
// It returns false, changing nothing, when p is not an ICMP error or an
// address is not of the packet's family. On success p, p.Inner included,
// describes the new frame.
func TranslateICMPError(frame []byte, p *packet.Packet, outerSrc, outerDst, innerSrc, innerDst packet.Addr, innerSrcPort, innerDstPort uint16) bool {
	v4 := p.Family == 4
	if !p.IsICMPError || outerSrc.Is4() != v4 || outerDst.Is4() != v4 || innerSrc.Is4() != v4 || innerDst.Is4() != v4 {
		return false
	}
	in := &p.Inner
	var msg delta // every change inside the ICMP message

	// Quoted IP header.
	var innerAddrs delta
	if innerSrc != in.Src {
		innerAddrs.addr(in.Src, innerSrc, v4)
		writeAddrAt(frame, in.L3, ipSrcOffset(v4), innerSrc, v4)
		in.Src = innerSrc
	}
	if innerDst != in.Dst {
		innerAddrs.addr(in.Dst, innerDst, v4)
		writeAddrAt(frame, in.L3, ipDstOffset(v4), innerDst, v4)
		in.Dst = innerDst
	}
	msg += innerAddrs
	if v4 && innerAddrs != 0 {
		msg.updateChecksumAt(frame[in.L3+10:in.L3+12], innerAddrs, false)
	}

	// Quoted L4 header: Parse guarantees its first eight bytes.
	q := frame[in.L4:p.End]
	var innerPorts delta
	switch in.Proto {
	case packet.ProtoTCP, packet.ProtoUDP:
		if innerSrcPort != in.SrcPort {
			innerPorts.word(in.SrcPort, innerSrcPort)
			binary.BigEndian.PutUint16(q[0:2], innerSrcPort)
			in.SrcPort = innerSrcPort
		}
		if innerDstPort != in.DstPort {
			innerPorts.word(in.DstPort, innerDstPort)
			binary.BigEndian.PutUint16(q[2:4], innerDstPort)
			in.DstPort = innerDstPort
		}
	default: // ICMP echo
		id := innerSrcPort
		if isEchoReply(in.Proto, q[0]) {
			id = innerDstPort
		}
		if id != in.SrcPort {
			innerPorts.word(in.SrcPort, id)
			binary.BigEndian.PutUint16(q[4:6], id)
			in.SrcPort, in.DstPort = id, id
		}
	}
	msg += innerPorts
	inner := innerPorts
	if in.Proto != packet.ProtoICMP {
		inner += innerAddrs
	}
	if inner != 0 {
		switch in.Proto {
		case packet.ProtoTCP:
			if len(q) >= 18 {
				msg.updateChecksumAt(q[16:18], inner, false)
			}
		case packet.ProtoUDP:
			msg.updateChecksumAt(q[6:8], inner, true)
		default:
			msg.updateChecksumAt(q[2:4], inner, false)
		}
	}

	// Outer IP header; ICMPv6 also covers it through its pseudo-header.
	var outer delta
	if outerSrc != p.Src {
		outer.addr(p.Src, outerSrc, v4)
		writeAddr(frame, p, ipSrcOffset(v4), outerSrc)
		p.Src = outerSrc
	}
	if outerDst != p.Dst {
		outer.addr(p.Dst, outerDst, v4)
		writeAddr(frame, p, ipDstOffset(v4), outerDst)
		p.Dst = outerDst
	}
	if v4 && outer != 0 {
		outer.updateAt(frame[p.L3+10 : p.L3+12])
	}
	if !v4 {
		msg += outer
	}
	if msg != 0 {
		msg.updateAt(frame[p.L4+2 : p.L4+4])
	}
	return true
}

// updateChecksumAt applies change to the checksum at b[0:2] and adds the
// checksum's own change to d, for the checksum of an enclosing message. A
// UDP checksum of zero stays zero.
func (d *delta) updateChecksumAt(b []byte, change delta, udp bool) {
	old := binary.BigEndian.Uint16(b)
	if udp {
		change.updateUDPAt(b)
	} else {
		change.updateAt(b)
	}
	if n := binary.BigEndian.Uint16(b); n != old {
		d.word(old, n)
	}
}
