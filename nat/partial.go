package nat

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// CompleteIfPartial finds a TCP or UDP checksum left partial by checksum
// offload and replaces it with the full checksum. It reports whether it
// wrote one.
//
// A local stack that offloads the checksum (CHECKSUM_PARTIAL) leaves the
// folded, not complemented, pseudo-header sum in the field and expects the
// NIC to finish it. Over veth no NIC ever does, and XDP hands user space no
// metadata saying so. A field equal to that sum, computed from the packet's
// current addresses, protocol and L4 length, is therefore taken as partial.
//
// A complete checksum can equal that value by chance, about once in 65536
// packets. Recomputing it then writes the same correct value back, so valid
// packets are never harmed. The only cost is that a packet corrupted on the
// way whose field happens to match is given a valid checksum; the Ethernet
// CRC already guards each link, and the receiver's end-to-end check loses
// that one in 65536 corrupted packets.
//
// Call it before any rewrite: the partial sum is over the addresses the
// sender used. Fragments are left alone, since their checksum covers bytes
// this frame does not hold; local stacks do not offload those anyway.
func CompleteIfPartial(frame []byte, p *packet.Packet) bool {
	seg, off, ok := l4Checksummed(frame, p)
	if !ok || p.Proto == packet.ProtoICMP || p.Proto == packet.ProtoICMPv6 {
		return false
	}
	ps := PseudoHeaderSum(p.Src, p.Dst, p.Proto, len(seg))
	if binary.BigEndian.Uint16(seg[off:]) != Fold(ps) {
		return false
	}
	seg[off], seg[off+1] = 0, 0
	c := Checksum(seg, ps)
	if c == 0 && p.Proto == packet.ProtoUDP {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(seg[off:], c)
	return true
}

// ValidIPHeader reports whether the IPv4 header checksum is correct. IPv6
// has none and always reports true.
func ValidIPHeader(frame []byte, p *packet.Packet) bool {
	if p.Family != 4 {
		return p.Family == 6
	}
	ihl := int(frame[p.L3]&0x0f) * 4
	return Fold(Sum(frame[p.L3:p.L3+ihl], 0)) == 0xffff
}

// ValidL4 reports whether the TCP, UDP or ICMP checksum of an unfragmented
// packet is correct. An IPv4 UDP checksum of zero (none sent) counts as
// correct. Fragments cannot be checked and report false.
func ValidL4(frame []byte, p *packet.Packet) bool {
	seg, off, ok := l4Checksummed(frame, p)
	if !ok {
		return false
	}
	var s uint64
	switch p.Proto {
	case packet.ProtoUDP:
		if p.Family == 4 && binary.BigEndian.Uint16(seg[off:]) == 0 {
			return true
		}
		s = PseudoHeaderSum(p.Src, p.Dst, p.Proto, len(seg))
	case packet.ProtoTCP, packet.ProtoICMPv6:
		s = PseudoHeaderSum(p.Src, p.Dst, p.Proto, len(seg))
	}
	return Fold(Sum(seg, s)) == 0xffff
}

// l4Checksummed returns the bytes an unfragmented packet's L4 checksum
// covers (without pseudo-header) and the checksum's offset in them.
func l4Checksummed(frame []byte, p *packet.Packet) (seg []byte, off int, ok bool) {
	if p.L4 == 0 || p.Fragmented {
		return nil, 0, false
	}
	seg = frame[p.L4:p.End]
	switch p.Proto {
	case packet.ProtoTCP:
		return seg, 16, true
	case packet.ProtoUDP:
		// The UDP length, not the IP length, bounds what the checksum covers.
		return seg[:binary.BigEndian.Uint16(seg[4:6])], 6, true
	case packet.ProtoICMP, packet.ProtoICMPv6:
		return seg, 2, true
	}
	return nil, 0, false
}
