package conntrack

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// keyWords is a Tuple packed into machine words, the form entries store it
// in so that readers can load it with atomic word loads.
const keyWords = 5

type key [keyWords]uint64

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
	binary.LittleEndian.PutUint64(t.Dst[0:8], k[0])
	binary.LittleEndian.PutUint64(t.Dst[8:16], k[1])
	binary.LittleEndian.PutUint64(t.Src[0:8], k[2])
	binary.LittleEndian.PutUint64(t.Src[8:16], k[3])
	t.DstPort = uint16(k[4] >> 48)
	t.SrcPort = uint16(k[4] >> 32)
	t.Proto = packet.Proto(k[4] >> 8)
	return t
}

// hashKey hashes k with the table's seed mixed in, so that which tuples
// collide differs from one process to the next.
func hashKey(k *key, seed *key) uint64 {
	var b [keyWords * 8]byte
	for i := range keyWords {
		binary.LittleEndian.PutUint64(b[i*8:], k[i]^seed[i])
	}
	return xxhash.Sum64(b[:])
}
