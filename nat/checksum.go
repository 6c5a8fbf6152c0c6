package nat

import (
	"encoding/binary"
	"math/bits"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Sum adds b to the one's complement sum initial and returns the result
// unfolded. b is read as big-endian 16-bit words starting at its first byte,
// an odd last byte padded with zero, so sums of consecutive pieces chain as
// long as every piece but the last has even length.
//
// It adds eight bytes at a time with carry: since 2^16 = 1 modulo 0xffff,
// a 64-bit one's complement sum folds to the same 16-bit sum.
func Sum(b []byte, initial uint64) uint64 {
	s, c := initial, uint64(0)
	for len(b) >= 32 {
		s, c = bits.Add64(s, binary.BigEndian.Uint64(b[0:8]), c)
		s, c = bits.Add64(s, binary.BigEndian.Uint64(b[8:16]), c)
		s, c = bits.Add64(s, binary.BigEndian.Uint64(b[16:24]), c)
		s, c = bits.Add64(s, binary.BigEndian.Uint64(b[24:32]), c)
		b = b[32:]
	}
	for len(b) >= 8 {
		s, c = bits.Add64(s, binary.BigEndian.Uint64(b), c)
		b = b[8:]
	}
	if len(b) > 0 {
		// The tail as the top bytes of one zero-padded word keeps every
		// byte in its place within its 16-bit word.
		var w uint64
		shift := 56
		for _, x := range b {
			w |= uint64(x) << shift
			shift -= 8
		}
		s, c = bits.Add64(s, w, c)
	}
	s, c = bits.Add64(s, 0, c)
	return s + c // s is 0 whenever c is 1 here, so this cannot overflow
}

// Fold reduces a one's complement sum to 16 bits with end-around carry.
// It returns 0 only for a zero sum.
func Fold(s uint64) uint16 {
	s = s>>32 + s&0xffffffff
	s = s>>32 + s&0xffffffff
	s = s>>16 + s&0xffff
	s = s>>16 + s&0xffff
	return uint16(s)
}

// Checksum returns the Internet checksum (RFC 1071) of b on top of the
// partial sum initial, for example a pseudo-header sum. The checksum field
// inside b must be zero, or the result is the value that makes the field's
// current content check.
func Checksum(b []byte, initial uint64) uint16 {
	return ^Fold(Sum(b, initial))
}

// PseudoHeaderSum returns the unfolded sum of the TCP/UDP/ICMPv6
// pseudo-header: the IPv4 one (RFC 793) when both addresses are IPv4,
// the IPv6 one (RFC 8200) otherwise. l4Len is the length of the L4 header
// plus payload.
func PseudoHeaderSum(src, dst packet.Addr, proto packet.Proto, l4Len int) uint64 {
	s := uint64(proto) + uint64(uint32(l4Len))
	if src.Is4() && dst.Is4() {
		return s + uint64(binary.BigEndian.Uint32(src[12:])) + uint64(binary.BigEndian.Uint32(dst[12:]))
	}
	for i := 0; i < 16; i += 4 {
		s += uint64(binary.BigEndian.Uint32(src[i:])) + uint64(binary.BigEndian.Uint32(dst[i:]))
	}
	return s
}

// UpdateWord returns checksum check after one 16-bit word it covers changed
// from old to new (RFC 1624, eqn. 3: HC' = ~(~HC + ~m + m')).
func UpdateWord(check, old, new uint16) uint16 {
	var d delta
	d.word(old, new)
	return d.apply(check)
}

// UpdateAddr4 returns checksum check after an IPv4 address it covers
// (directly or through a pseudo-header) changed from old to new.
func UpdateAddr4(check uint16, old, new [4]byte) uint16 {
	var d delta
	d.bytes4(old[:], new[:])
	return d.apply(check)
}

// UpdateAddr16 returns checksum check after an IPv6 address it covers
// changed from old to new.
func UpdateAddr16(check uint16, old, new [16]byte) uint16 {
	var d delta
	d.addr(packet.Addr(old), packet.Addr(new), false)
	return d.apply(check)
}

// delta is the unfolded one's complement sum of ~old + new over the words
// that changed. One delta serves every checksum that covers the same
// change, so an address change is summed once for the IP header and the
// L4 pseudo-header alike. Zero means nothing changed; a change adds at
// least one nonzero term.
type delta uint64

func (d *delta) word(old, new uint16) {
	*d += delta(^old) + delta(new)
}

// bytes4 adds the change of four bytes, at an even offset, as one 32-bit
// term: ~x of 32 bits is the two 16-bit complements side by side.
func (d *delta) bytes4(old, new []byte) {
	*d += delta(^binary.BigEndian.Uint32(old)) + delta(binary.BigEndian.Uint32(new))
}

// addr adds an address change: four bytes for IPv4, sixteen for IPv6.
func (d *delta) addr(old, new packet.Addr, v4 bool) {
	if v4 {
		d.bytes4(old[12:], new[12:])
		return
	}
	for i := 0; i < 16; i += 4 {
		d.bytes4(old[i:i+4], new[i:i+4])
	}
}

// apply returns check updated by d.
func (d delta) apply(check uint16) uint16 {
	return ^Fold(uint64(^check) + uint64(d))
}

// updateAt applies d to the checksum stored at b[0:2].
func (d delta) updateAt(b []byte) {
	binary.BigEndian.PutUint16(b, d.apply(binary.BigEndian.Uint16(b)))
}

// updateUDPAt applies d to a UDP checksum at b[0:2]: zero means the sender
// sent no checksum and stays zero, and a checksum that comes out as zero is
// sent as 0xffff (RFC 768), which is the same value in one's complement.
func (d delta) updateUDPAt(b []byte) {
	old := binary.BigEndian.Uint16(b)
	if old == 0 {
		return
	}
	c := d.apply(old)
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(b, c)
}
