package nat

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Rewrite sets the packet's source and destination to those of to and
// updates the IPv4 header checksum and the L4 checksum incrementally. It is
// the one call per translated packet: DNAT, SNAT or both at once.
//
// Ports are TCP/UDP ports. For ICMP echo, to.SrcPort and to.DstPort both
// stand for the echo identifier, as in packet.Tuple; should they differ, the
// identifier is the querier's: SrcPort of a request, DstPort of a reply.
// Later fragments carry no L4 header and get only their addresses changed;
// their L4 checksum sits in the first fragment and covers the addresses of
// the whole datagram, which the first fragment's rewrite accounts for.
// For an ICMP error only the outer addresses change; see TranslateICMPError.
// to.Proto is ignored.
//
// Rewrite returns false, leaving frame and p untouched, when an address is
// not of the packet's family. On success p holds the new tuple.
func Rewrite(frame []byte, p *packet.Packet, to packet.Tuple) bool {
	id := to.SrcPort
	if isEchoReply(p.Proto, p.ICMPType) {
		id = to.DstPort
	}
	return rewrite(frame, p, to.Src, to.Dst, to.SrcPort, to.DstPort, id)
}

// RewriteSrc sets the packet's source address and port (for ICMP echo: the
// identifier); see Rewrite.
func RewriteSrc(frame []byte, p *packet.Packet, addr packet.Addr, port uint16) bool {
	return rewrite(frame, p, addr, p.Dst, port, p.DstPort, port)
}

// RewriteDst sets the packet's destination address and port (for ICMP
// echo: the identifier); see Rewrite.
func RewriteDst(frame []byte, p *packet.Packet, addr packet.Addr, port uint16) bool {
	return rewrite(frame, p, p.Src, addr, p.SrcPort, port, port)
}

func rewrite(frame []byte, p *packet.Packet, src, dst packet.Addr, srcPort, dstPort, echoID uint16) bool {
	v4 := p.Family == 4
	if p.Family == 0 || src.Is4() != v4 || dst.Is4() != v4 {
		return false
	}
	var addrs delta
	if src != p.Src {
		addrs.addr(p.Src, src, v4)
		writeAddr(frame, p, ipSrcOffset(v4), src)
		p.Src = src
	}
	if dst != p.Dst {
		addrs.addr(p.Dst, dst, v4)
		writeAddr(frame, p, ipDstOffset(v4), dst)
		p.Dst = dst
	}
	if v4 && addrs != 0 {
		addrs.updateAt(frame[p.L3+10 : p.L3+12])
	}
	if p.L4 == 0 {
		return true // a later fragment: no L4 header here
	}

	l4 := frame[p.L4:p.End]
	var ports delta
	switch {
	case p.IsICMPError:
		// Ports belong to the quoted packet, not this one.
	case p.Proto == packet.ProtoTCP || p.Proto == packet.ProtoUDP:
		if srcPort != p.SrcPort {
			ports.word(p.SrcPort, srcPort)
			binary.BigEndian.PutUint16(l4[0:2], srcPort)
			p.SrcPort = srcPort
		}
		if dstPort != p.DstPort {
			ports.word(p.DstPort, dstPort)
			binary.BigEndian.PutUint16(l4[2:4], dstPort)
			p.DstPort = dstPort
		}
	default: // ICMP echo
		if echoID != p.SrcPort {
			ports.word(p.SrcPort, echoID)
			binary.BigEndian.PutUint16(l4[4:6], echoID)
			p.SrcPort, p.DstPort = echoID, echoID
		}
	}

	d := ports
	if p.Proto != packet.ProtoICMP { // ICMPv4 alone has no pseudo-header
		d += addrs
	}
	if d == 0 {
		return true
	}
	switch p.Proto {
	case packet.ProtoTCP:
		d.updateAt(l4[16:18])
	case packet.ProtoUDP:
		d.updateUDPAt(l4[6:8])
	case packet.ProtoICMP, packet.ProtoICMPv6:
		d.updateAt(l4[2:4])
	}
	return true
}

// DecrementTTL decrements the IPv4 TTL or IPv6 hop limit, as a router does
// before forwarding, and updates the IPv4 header checksum. It returns false
// without changing the frame when the TTL would reach zero: the packet must
// not be forwarded (and a time-exceeded error is due).
func DecrementTTL(frame []byte, p *packet.Packet) bool {
	if p.Family == 6 {
		h := frame[p.L3 : p.L3+packet.IPv6Len]
		if h[7] <= 1 {
			return false
		}
		h[7]--
		return true
	}
	h := frame[p.L3 : p.L3+packet.IPv4MinLen]
	ttl := h[8]
	if ttl <= 1 {
		return false
	}
	h[8] = ttl - 1
	// TTL shares its 16-bit word with the protocol byte.
	var d delta
	d.word(uint16(ttl)<<8|uint16(h[9]), uint16(ttl-1)<<8|uint16(h[9]))
	d.updateAt(h[10:12])
	return true
}

func ipSrcOffset(v4 bool) int {
	if v4 {
		return 12
	}
	return 8
}

func ipDstOffset(v4 bool) int {
	if v4 {
		return 16
	}
	return 24
}

// writeAddrAt stores a at offset off of the IP header at l3 of frame.
func writeAddrAt(frame []byte, l3, off int, a packet.Addr, v4 bool) {
	if v4 {
		copy(frame[l3+off:l3+off+4], a[12:])
		return
	}
	copy(frame[l3+off:l3+off+16], a[:])
}

// writeAddr stores a at offset off of p's IP header.
func writeAddr(frame []byte, p *packet.Packet, off int, a packet.Addr) {
	writeAddrAt(frame, p.L3, off, a, p.Family == 4)
}

func isEchoReply(proto packet.Proto, icmpType uint8) bool {
	return proto == packet.ProtoICMP && icmpType == packet.ICMPv4EchoReply ||
		proto == packet.ProtoICMPv6 && icmpType == packet.ICMPv6EchoReply
}
