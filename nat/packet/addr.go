package packet

import (
	"fmt"
	"net/netip"
)

// Addr is an IPv4 or IPv6 address. IPv4 is stored IPv4-mapped
// (::ffff:a.b.c.d), the same form netip uses, so one comparison covers both
// families.
type Addr [16]byte

var v4Prefix = [12]byte{10: 0xff, 11: 0xff}

// AddrFrom4 returns the IPv4-mapped Addr of b.
func AddrFrom4(b [4]byte) Addr {
	return Addr{10: 0xff, 11: 0xff, 12: b[0], 13: b[1], 14: b[2], 15: b[3]}
}

// AddrFromSlice4 returns the IPv4-mapped Addr of the four bytes at b.
func AddrFromSlice4(b []byte) Addr {
	_ = b[3]
	return Addr{10: 0xff, 11: 0xff, 12: b[0], 13: b[1], 14: b[2], 15: b[3]}
}

// AddrFromNetip converts a netip.Addr; the zero netip.Addr becomes the zero Addr.
func AddrFromNetip(a netip.Addr) Addr {
	if !a.IsValid() {
		return Addr{}
	}
	return Addr(a.As16())
}

// MustParseAddr parses s or panics; for tests and constants.
func MustParseAddr(s string) Addr { return AddrFromNetip(netip.MustParseAddr(s)) }

// Is4 reports whether a is an IPv4-mapped address.
func (a Addr) Is4() bool { return [12]byte(a[:12]) == v4Prefix }

// As4 returns the IPv4 bytes of an IPv4-mapped address.
func (a Addr) As4() [4]byte { return [4]byte(a[12:]) }

// IsZero reports whether a is the zero Addr (no address).
func (a Addr) IsZero() bool { return a == Addr{} }

// Netip returns a as a netip.Addr, unmapped for IPv4.
func (a Addr) Netip() netip.Addr {
	if a.IsZero() {
		return netip.Addr{}
	}
	return netip.AddrFrom16(a).Unmap()
}

func (a Addr) String() string {
	if a.IsZero() {
		return "invalid"
	}
	return a.Netip().String()
}

// Proto is an IP protocol number.
type Proto uint8

// The protocols xdproxy translates.
const (
	ProtoICMP   Proto = 1
	ProtoTCP    Proto = 6
	ProtoUDP    Proto = 17
	ProtoICMPv6 Proto = 58
	ProtoSCTP   Proto = 132
)

func (p Proto) String() string {
	switch p {
	case ProtoICMP:
		return "ICMP"
	case ProtoTCP:
		return "TCP"
	case ProtoUDP:
		return "UDP"
	case ProtoICMPv6:
		return "ICMPv6"
	case ProtoSCTP:
		return "SCTP"
	}
	return fmt.Sprintf("proto-%d", uint8(p))
}

// Tuple identifies one direction of a flow. For ICMP echo, SrcPort and
// DstPort both hold the echo identifier, which is what NAT rewrites.
// Tuple is comparable and pointer-free, so it can be a hash key.
type Tuple struct {
	Src, Dst         Addr
	SrcPort, DstPort uint16
	Proto            Proto
}

// Reverse returns the tuple of the other direction.
func (t Tuple) Reverse() Tuple {
	return Tuple{Src: t.Dst, Dst: t.Src, SrcPort: t.DstPort, DstPort: t.SrcPort, Proto: t.Proto}
}

func (t Tuple) String() string {
	return fmt.Sprintf("%v %v:%d->%v:%d", t.Proto, t.Src, t.SrcPort, t.Dst, t.DstPort)
}
