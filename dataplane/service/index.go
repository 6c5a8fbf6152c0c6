package service

import (
	"encoding/binary"
	"math/bits"
	"net/netip"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// keyIndex is an open-addressing hash table from Key to a position in a
// slice, with linear probing and a load factor of at most one half. Slots
// hold the key itself, so a lookup touches no pointer and the garbage
// collector never scans the table. It is built once and then only read.
type keyIndex struct {
	slots []indexSlot
	mask  uint64
}

type indexSlot struct {
	key Key
	pos int32 // position + 1; 0 marks an empty slot
}

func newKeyIndex(n int) keyIndex {
	size := uint64(8)
	if n > 4 {
		size = uint64(1) << bits.Len64(uint64(2*n-1))
	}
	return keyIndex{slots: make([]indexSlot, size), mask: size - 1}
}

// hashKey is xxhash64 (seed 0) of the key as 20 bytes: the address, the
// port big-endian, the protocol and a zero byte. It is the short-input
// path of xxhash.Sum64 written out for that fixed layout, which avoids
// copying the key into a buffer and calling out; the last four bytes form
// one 4-byte step instead of four 1-byte steps, which shortens the chain
// of dependent multiplies. A test checks it against the library.
func hashKey(k *Key) uint64 { return hashParts(&k.Addr, k.Port, k.Proto) }

func hashParts(addr *packet.Addr, port uint16, proto packet.Proto) uint64 {
	h := uint64(xxPrime5 + 20)
	h = xxWord(h, binary.LittleEndian.Uint64(addr[:8]))
	h = xxWord(h, binary.LittleEndian.Uint64(addr[8:]))
	tail := uint32(port>>8) | uint32(port&0xff)<<8 | uint32(proto)<<16
	h ^= uint64(tail) * xxPrime1
	h = bits.RotateLeft64(h, 23)*xxPrime2 + xxPrime3
	return xxAvalanche(h)
}

// The pieces of xxhash64's short-input path (inputs under 32 bytes).
const (
	xxPrime1 = 11400714785074694791
	xxPrime2 = 14029467366897019727
	xxPrime3 = 1609587929392839161
	xxPrime4 = 9650029242287828579
	xxPrime5 = 2870177450012600261
)

// xxWord mixes one little-endian 8-byte chunk into h.
func xxWord(h, v uint64) uint64 {
	h ^= bits.RotateLeft64(v*xxPrime2, 31) * xxPrime1
	return bits.RotateLeft64(h, 27)*xxPrime1 + xxPrime4
}

func xxAvalanche(h uint64) uint64 {
	h ^= h >> 33
	h *= xxPrime2
	h ^= h >> 29
	h *= xxPrime3
	h ^= h >> 32
	return h
}

// insert adds k at pos unless k is present; it reports whether it added.
func (x *keyIndex) insert(k Key, pos int) bool {
	for i := hashKey(&k) & x.mask; ; i = (i + 1) & x.mask {
		s := &x.slots[i]
		if s.pos == 0 {
			s.key, s.pos = k, int32(pos+1)
			return true
		}
		if s.key == k {
			return false
		}
	}
}

// find returns the position of the key (addr, port, proto), or -1.
func (x *keyIndex) find(addr *packet.Addr, port uint16, proto packet.Proto) int {
	return x.findHashed(hashParts(addr, port, proto), addr, port, proto)
}

// findHashed is find of a key whose hash the caller computed.
func (x *keyIndex) findHashed(h uint64, addr *packet.Addr, port uint16, proto packet.Proto) int {
	if len(x.slots) == 0 {
		return -1
	}
	for i := h & x.mask; ; i = (i + 1) & x.mask {
		s := &x.slots[i]
		if s.pos == 0 {
			return -1
		}
		if s.key.Port == port && s.key.Proto == proto && s.key.Addr == *addr {
			return int(s.pos - 1)
		}
	}
}

// prefix is a netip.Prefix in the IPv4-mapped 128-bit form of
// packet.Addr, as two masked words, so that containment is two ANDs and
// two compares without allocation.
type prefix struct {
	hi, lo         uint64
	maskHi, maskLo uint64
}

func prefixFrom(p netip.Prefix) (prefix, bool) {
	if !p.IsValid() {
		return prefix{}, false
	}
	p = p.Masked()
	n := p.Bits()
	if p.Addr().Is4() {
		n += 96
	}
	a := p.Addr().As16()
	maskHi, maskLo := ^uint64(0), ^uint64(0)
	switch {
	case n <= 64:
		maskHi, maskLo = ^uint64(0)<<(64-n), 0
		if n == 0 {
			maskHi = 0
		}
	default:
		maskLo = ^uint64(0) << (128 - n)
		if n == 128 {
			maskLo = ^uint64(0)
		}
	}
	return prefix{
		hi:     binary.BigEndian.Uint64(a[:8]) & maskHi,
		lo:     binary.BigEndian.Uint64(a[8:]) & maskLo,
		maskHi: maskHi,
		maskLo: maskLo,
	}, true
}

func (p *prefix) contains(a *packet.Addr) bool {
	return binary.BigEndian.Uint64(a[:8])&p.maskHi == p.hi &&
		binary.BigEndian.Uint64(a[8:])&p.maskLo == p.lo
}

func anyContains(ps []prefix, a *packet.Addr) bool {
	for i := range ps {
		if ps[i].contains(a) {
			return true
		}
	}
	return false
}
