package conntrack

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// keyWords is a Tuple packed into machine words, the form entries store it
// in so that readers can load it with atomic word loads.
const keyWords = 5

// Key is a tuple packed into the words an entry stores it in (MakeKey):
// what a cache in front of the table keeps and compares. No valid Key is
// all zeros.
type Key [keyWords]uint64

type key = Key

// MakeKey packs t.
func MakeKey(t *packet.Tuple) Key { return packKey(t) }

// KeyV4 packs the tuple of an IPv4 packet from its header fields as they
// are on the wire (addresses in network byte order), without building a
// packet.Tuple first: MakeKey of the same tuple gives the same Key.
func KeyV4(src, dst [4]byte, srcPort, dstPort uint16, proto packet.Proto) Key {
	var k Key
	k.SetV4(src, dst, srcPort, dstPort, proto)
	return k
}

// SetV4 is KeyV4 written into k in place. Returning a Key through a
// temporary costs a failed store-to-load forward on amd64: the words are
// stored one by one and the copy reads them 16 bytes at a time.
func (k *Key) SetV4(src, dst [4]byte, srcPort, dstPort uint16, proto packet.Proto) {
	const v4Mapped = 0xffff << 16 // bytes 10 and 11 of a v4-mapped address
	k[0] = 0
	k[1] = v4Mapped | uint64(binary.LittleEndian.Uint32(src[:]))<<32
	k[2] = 0
	k[3] = v4Mapped | uint64(binary.LittleEndian.Uint32(dst[:]))<<32
	k[4] = uint64(srcPort)<<48 | uint64(dstPort)<<32 | uint64(proto)<<8 | 1
}

// packKey packs t. The last word holds the ports, the protocol and a marker
// bit so that no packed tuple is all zeros.
func packKey(t *packet.Tuple) key {
	return key{
		binary.LittleEndian.Uint64(t.Src[0:8]),
		binary.LittleEndian.Uint64(t.Src[8:16]),
		binary.LittleEndian.Uint64(t.Dst[0:8]),
		binary.LittleEndian.Uint64(t.Dst[8:16]),
		uint64(t.SrcPort)<<48 | uint64(t.DstPort)<<32 | uint64(t.Proto)<<8 | 1,
	}
}

// Tuple unpacks k.
func (k *Key) Tuple() packet.Tuple { return k.tuple() }

func (k *key) tuple() packet.Tuple {
	var t packet.Tuple
	binary.LittleEndian.PutUint64(t.Src[0:8], k[0])
	binary.LittleEndian.PutUint64(t.Src[8:16], k[1])
	binary.LittleEndian.PutUint64(t.Dst[0:8], k[2])
	binary.LittleEndian.PutUint64(t.Dst[8:16], k[3])
	t.SrcPort = uint16(k[4] >> 48)
	t.DstPort = uint16(k[4] >> 32)
	t.Proto = packet.Proto(k[4] >> 8)
	return t
}

// reversedTuple is k.tuple().Reverse() without the intermediate copy; it is
// on the per-packet path.
func (k *key) reversedTuple() packet.Tuple {
	var t packet.Tuple
	k.reverseInto(&t)
	return t
}

// reverseInto is reversedTuple written into t in place (see Key.SetV4).
func (k *key) reverseInto(t *packet.Tuple) {
	binary.LittleEndian.PutUint64(t.Dst[0:8], k[0])
	binary.LittleEndian.PutUint64(t.Dst[8:16], k[1])
	binary.LittleEndian.PutUint64(t.Src[0:8], k[2])
	binary.LittleEndian.PutUint64(t.Src[8:16], k[3])
	t.DstPort = uint16(k[4] >> 48)
	t.SrcPort = uint16(k[4] >> 32)
	t.Proto = packet.Proto(k[4] >> 8)
}

// hashKey hashes k with the table's secret seed, so that which tuples
// collide differs from one table to the next and cannot be chosen by
// someone who does not know the seed.
//
// It is NH, the inner hash of UMAC (RFC 4418): the ten 32-bit halves of
// the key, each added to a 32-bit word of the seed, multiplied in pairs
// and summed mod 2^64. For any two different keys, the chance over the
// seed that their sums are equal is at most 2^-32, whatever keys an
// attacker picks; the usual multiply-xorshift hashes with a seed xored in
// give no such bound (a difference in the key passes through the
// multiplication unchanged by the seed). A fixed avalanche (murmur3's
// fmix64) then spreads the sum over all 64 bits, since the table takes the
// home slot from the low bits, the shard from bits 26 up and the tag from
// the top 31. Five independent 32x32->64 multiplies and two more for the
// mix: about 2 ns, against about 25 ns for xxhash of the 40 bytes.
func hashKey(k *key, seed *key) uint64 {
	var h uint64
	for i := range keyWords {
		a := uint32(k[i]) + uint32(seed[i])
		b := uint32(k[i]>>32) + uint32(seed[i]>>32)
		h += uint64(a) * uint64(b)
	}
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}
