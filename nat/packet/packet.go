package packet

import "encoding/binary"

// EtherTypes and header sizes.
const (
	EtherTypeIPv4 = 0x0800
	EtherTypeIPv6 = 0x86dd
	EtherTypeVLAN = 0x8100
	EtherTypeQinQ = 0x88a8

	EthernetLen = 14
	VLANLen     = 4
	IPv4MinLen  = 20
	IPv6Len     = 40
	IPv6FragLen = 8
	TCPMinLen   = 20
	UDPLen      = 8
	ICMPLen     = 8 // type, code, checksum and four bytes of rest-of-header
)

// TCP flags as they appear in byte 13 of the TCP header.
const (
	TCPFin = 0x01
	TCPSyn = 0x02
	TCPRst = 0x04
	TCPPsh = 0x08
	TCPAck = 0x10
)

// ICMP types (v4 and v6) that xdproxy handles.
const (
	ICMPv4EchoReply      = 0
	ICMPv4DestUnreach    = 3
	ICMPv4Echo           = 8
	ICMPv4TimeExceeded   = 11
	ICMPv4ParamProblem   = 12
	ICMPv4CodePortUnr    = 3
	ICMPv4CodeFragNeeded = 4

	ICMPv6DestUnreach  = 1
	ICMPv6PacketTooBig = 2
	ICMPv6TimeExceeded = 3
	ICMPv6ParamProblem = 4
	ICMPv6Echo         = 128
	ICMPv6EchoReply    = 129
)

// Family is 4 or 6.
type Family uint8

// Packet is the parsed view of one frame. Offsets index the frame that was
// parsed; End is where the IP datagram ends (Ethernet padding excluded).
type Packet struct {
	L3, L4, End int
	EtherType   uint16 // of the IP header, after any VLAN tag
	VLANTCI     uint16
	HasVLAN     bool
	Family      Family
	Proto       Proto
	Src, Dst    Addr
	// SrcPort and DstPort are the TCP/UDP ports; for ICMP echo both hold
	// the identifier. Zero for non-first fragments.
	SrcPort, DstPort uint16
	TCPFlags         uint8
	ICMPType         uint8
	ICMPCode         uint8

	// Fragmentation. FragOffset is in bytes. A non-first fragment has
	// L4 == 0. FragID is the IPv4 identification or IPv6 fragment id.
	Fragmented bool
	MoreFrags  bool
	FragOffset uint16
	FragID     uint32

	// IsICMPError marks an ICMP error; Inner then describes the quoted
	// packet, which is the reverse direction of the flow it belongs to.
	IsICMPError bool
	Inner       Inner
}

// Inner is the IP packet quoted by an ICMP error. Only the first eight bytes
// of its L4 header are guaranteed, which is enough for ports and the echo id.
type Inner struct {
	L3, L4           int
	Proto            Proto
	Src, Dst         Addr
	SrcPort, DstPort uint16
}

// Tuple returns the packet's flow tuple.
func (p *Packet) Tuple() Tuple {
	return Tuple{Src: p.Src, Dst: p.Dst, SrcPort: p.SrcPort, DstPort: p.DstPort, Proto: p.Proto}
}

// InnerTuple returns the tuple of the quoted packet of an ICMP error.
func (p *Packet) InnerTuple() Tuple {
	return Tuple{Src: p.Inner.Src, Dst: p.Inner.Dst, SrcPort: p.Inner.SrcPort, DstPort: p.Inner.DstPort, Proto: p.Inner.Proto}
}

// IsFirstFragment reports whether the packet carries the L4 header of a
// fragmented datagram.
func (p *Packet) IsFirstFragment() bool { return p.Fragmented && p.FragOffset == 0 }

// IsLaterFragment reports whether the packet is a fragment without L4 header.
func (p *Packet) IsLaterFragment() bool { return p.Fragmented && p.FragOffset != 0 }

// Parse parses frame into p. It returns OK for a packet xdproxy may
// translate and otherwise the reason it may not; p is only complete for OK.
func Parse(frame []byte, p *Packet) Reason {
	*p = Packet{}
	if len(frame) < EthernetLen {
		return DropShortEthernet
	}
	off := EthernetLen
	et := binary.BigEndian.Uint16(frame[12:14])
	if et == EtherTypeVLAN || et == EtherTypeQinQ {
		if len(frame) < off+VLANLen {
			return DropShortVLAN
		}
		p.HasVLAN = true
		p.VLANTCI = binary.BigEndian.Uint16(frame[14:16])
		et = binary.BigEndian.Uint16(frame[16:18])
		off += VLANLen
		if et == EtherTypeVLAN || et == EtherTypeQinQ {
			return DropDoubleVLAN
		}
	}
	p.EtherType = et
	p.L3 = off
	var r Reason
	switch et {
	case EtherTypeIPv4:
		r = parseIPv4(frame, p)
	case EtherTypeIPv6:
		r = parseIPv6(frame, p)
	default:
		return PassNotIP
	}
	if r != OK {
		return r
	}
	if p.IsLaterFragment() {
		return OK
	}
	return parseL4(frame, p)
}

func parseIPv4(frame []byte, p *Packet) Reason {
	off := p.L3
	if len(frame) < off+IPv4MinLen {
		return DropShortIP
	}
	h := frame[off:]
	if h[0]>>4 != 4 {
		return DropBadIPVersion
	}
	ihl := int(h[0]&0x0f) * 4
	if ihl < IPv4MinLen {
		return DropBadIPHeaderLen
	}
	total := int(binary.BigEndian.Uint16(h[2:4]))
	if total < ihl || off+total > len(frame) {
		return DropBadIPTotalLen
	}
	p.Family = 4
	p.End = off + total
	p.Proto = Proto(h[9])
	p.Src = AddrFromSlice4(h[12:16])
	p.Dst = AddrFromSlice4(h[16:20])
	frag := binary.BigEndian.Uint16(h[6:8])
	p.MoreFrags = frag&0x2000 != 0
	p.FragOffset = (frag & 0x1fff) * 8
	if p.MoreFrags || p.FragOffset != 0 {
		p.Fragmented = true
		p.FragID = uint32(binary.BigEndian.Uint16(h[4:6]))
	}
	if !p.IsLaterFragment() {
		p.L4 = off + ihl
	}
	return OK
}

func parseIPv6(frame []byte, p *Packet) Reason {
	off := p.L3
	if len(frame) < off+IPv6Len {
		return DropShortIP
	}
	h := frame[off:]
	if h[0]>>4 != 6 {
		return DropBadIPVersion
	}
	payload := int(binary.BigEndian.Uint16(h[4:6]))
	if off+IPv6Len+payload > len(frame) {
		return DropBadIPTotalLen
	}
	p.Family = 6
	p.End = off + IPv6Len + payload
	p.Src = Addr(h[8:24])
	p.Dst = Addr(h[24:40])
	next := h[6]
	l4 := off + IPv6Len
	if next == 44 { // fragment header
		if p.End < l4+IPv6FragLen {
			return DropBadIPTotalLen
		}
		f := frame[l4:]
		next = f[0]
		fo := binary.BigEndian.Uint16(f[2:4])
		p.Fragmented = true
		p.FragOffset = fo &^ 7
		p.MoreFrags = fo&1 != 0
		p.FragID = binary.BigEndian.Uint32(f[4:8])
		l4 += IPv6FragLen
	}
	switch next {
	case 0, 43, 50, 51, 60, 135, 139, 140, 253, 254:
		return PassIPv6ExtHeader
	}
	p.Proto = Proto(next)
	if !p.IsLaterFragment() {
		p.L4 = l4
	}
	return OK
}

func parseL4(frame []byte, p *Packet) Reason {
	off := p.L4
	seg := frame[off:p.End]
	switch p.Proto {
	case ProtoTCP:
		if len(seg) < TCPMinLen {
			return DropShortL4
		}
		doff := int(seg[12]>>4) * 4
		if doff < TCPMinLen || doff > len(seg) {
			return DropBadTCPOffset
		}
		p.SrcPort = binary.BigEndian.Uint16(seg[0:2])
		p.DstPort = binary.BigEndian.Uint16(seg[2:4])
		p.TCPFlags = seg[13]
	case ProtoUDP:
		if len(seg) < UDPLen {
			return DropShortL4
		}
		ulen := int(binary.BigEndian.Uint16(seg[4:6]))
		// A fragmented datagram's UDP length covers all fragments.
		if ulen < UDPLen || (!p.Fragmented && ulen > len(seg)) {
			return DropBadUDPLength
		}
		p.SrcPort = binary.BigEndian.Uint16(seg[0:2])
		p.DstPort = binary.BigEndian.Uint16(seg[2:4])
	case ProtoICMP, ProtoICMPv6:
		if (p.Proto == ProtoICMP) != (p.Family == 4) {
			return PassOtherProto
		}
		if len(seg) < ICMPLen {
			return DropShortL4
		}
		p.ICMPType, p.ICMPCode = seg[0], seg[1]
		return parseICMP(frame, p)
	default:
		return PassOtherProto
	}
	return OK
}

func parseICMP(frame []byte, p *Packet) Reason {
	seg := frame[p.L4:p.End]
	switch {
	case p.Family == 4 && (p.ICMPType == ICMPv4Echo || p.ICMPType == ICMPv4EchoReply),
		p.Family == 6 && (p.ICMPType == ICMPv6Echo || p.ICMPType == ICMPv6EchoReply):
		id := binary.BigEndian.Uint16(seg[4:6])
		p.SrcPort, p.DstPort = id, id
		return OK
	case p.Family == 4 && (p.ICMPType == ICMPv4DestUnreach || p.ICMPType == ICMPv4TimeExceeded || p.ICMPType == ICMPv4ParamProblem),
		p.Family == 6 && (p.ICMPType >= ICMPv6DestUnreach && p.ICMPType <= ICMPv6ParamProblem):
	default:
		return PassICMPOther
	}
	if p.Fragmented {
		return PassICMPOther
	}
	p.IsICMPError = true
	return parseInner(frame, p)
}

// parseInner parses the quoted packet of an ICMP error. The quote may be cut
// short anywhere after eight bytes of L4 header, so its own length fields
// are not checked against the frame.
func parseInner(frame []byte, p *Packet) Reason {
	in := &p.Inner
	in.L3 = p.L4 + ICMPLen
	q := frame[in.L3:p.End]
	if p.Family == 4 {
		if len(q) < IPv4MinLen || q[0]>>4 != 4 {
			return DropShortICMPQuote
		}
		ihl := int(q[0]&0x0f) * 4
		if ihl < IPv4MinLen || len(q) < ihl+8 {
			return DropShortICMPQuote
		}
		if binary.BigEndian.Uint16(q[6:8])&0x1fff != 0 {
			return PassICMPOther // quote of a later fragment: no ports to match
		}
		in.Proto = Proto(q[9])
		in.Src = AddrFromSlice4(q[12:16])
		in.Dst = AddrFromSlice4(q[16:20])
		in.L4 = in.L3 + ihl
	} else {
		if len(q) < IPv6Len+8 || q[0]>>4 != 6 {
			return DropShortICMPQuote
		}
		in.Proto = Proto(q[6])
		in.Src = Addr(q[8:24])
		in.Dst = Addr(q[24:40])
		in.L4 = in.L3 + IPv6Len
	}
	l4 := frame[in.L4:p.End]
	switch in.Proto {
	case ProtoTCP, ProtoUDP:
		in.SrcPort = binary.BigEndian.Uint16(l4[0:2])
		in.DstPort = binary.BigEndian.Uint16(l4[2:4])
	case ProtoICMP, ProtoICMPv6:
		// Only the echo of the error's own ICMP version: an ICMPv6 type
		// in an ICMPv4 quote (or the other way round) is no echo.
		t := l4[0]
		echo := in.Proto == ProtoICMP && p.Family == 4 && (t == ICMPv4Echo || t == ICMPv4EchoReply) ||
			in.Proto == ProtoICMPv6 && p.Family == 6 && (t == ICMPv6Echo || t == ICMPv6EchoReply)
		if !echo {
			return PassICMPOther
		}
		id := binary.BigEndian.Uint16(l4[4:6])
		in.SrcPort, in.DstPort = id, id
	default:
		return PassICMPOther
	}
	return OK
}
