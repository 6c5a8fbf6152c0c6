package conntrack

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// hashKeySets are key sets shaped like real traffic, where the keys differ
// in few bits: one client's source ports, a /16 of IPv4 clients on one
// port, IPv6 clients, and reply keys of many backends.
func hashKeySets(n int) map[string][]Key {
	vip := packet.AddrFrom4([4]byte{198, 19, 0, 10})
	sets := map[string][]Key{}
	for i := range n {
		c := packet.AddrFrom4([4]byte{10, 1, byte(i >> 16), byte(i)})
		sets["ports"] = append(sets["ports"], MakeKey(&packet.Tuple{Src: c, Dst: vip, SrcPort: uint16(i), DstPort: 80, Proto: packet.ProtoTCP}))
		sets["ipv4"] = append(sets["ipv4"], MakeKey(&packet.Tuple{Src: packet.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}),
			Dst: vip, SrcPort: 40000, DstPort: 80, Proto: packet.ProtoUDP}))
		var c6 packet.Addr
		c6[0], c6[1] = 0xfd, 0x00
		binary.BigEndian.PutUint32(c6[12:], uint32(i)*7)
		sets["ipv6"] = append(sets["ipv6"], MakeKey(&packet.Tuple{Src: c6, Dst: c6, SrcPort: uint16(i >> 4), DstPort: 443, Proto: packet.ProtoTCP}))
		be := packet.AddrFrom4([4]byte{172, 16, byte(i >> 8), byte(i)})
		sets["replies"] = append(sets["replies"], MakeKey(&packet.Tuple{Src: be, Dst: c, SrcPort: 8080, DstPort: uint16(i >> 8), Proto: packet.ProtoTCP}))
	}
	return sets
}

// chiSquare is Pearson's statistic of how keys fall into buckets, and how
// many standard deviations it lies from its mean under a uniform spread.
func chiSquare(keys []Key, seed *Key, bucket func(h uint64) int, buckets int) float64 {
	counts := make([]int, buckets)
	for i := range keys {
		counts[bucket(hashKey(&keys[i], seed))]++
	}
	exp := float64(len(keys)) / float64(buckets)
	var x2 float64
	for _, c := range counts {
		d := float64(c) - exp
		x2 += d * d / exp
	}
	df := float64(buckets - 1)
	return (x2 - df) / math.Sqrt(2*df)
}

// TestHashSpread: every part of the hash the table uses (the home slot from
// the low bits, the shard from bits 26 up, the tag from the top 31 bits)
// spreads structured key sets as evenly as a random function would: the
// chi-square statistic stays within 6 standard deviations of its mean.
func TestHashSpread(t *testing.T) {
	sets := hashKeySets(1 << 18)
	tb := newTable(t, Config{Capacity: 1024})
	parts := map[string]func(h uint64) int{
		"slot":  func(h uint64) int { return int(h & (1<<12 - 1)) },
		"shard": func(h uint64) int { return int(h >> shardShift & 63) },
		"tag":   func(h uint64) int { return int(h >> tagShift & (1<<12 - 1)) },
		"mod":   func(h uint64) int { return int(h % 1000) }, // SNAT port starts
	}
	buckets := map[string]int{"slot": 1 << 12, "shard": 64, "tag": 1 << 12, "mod": 1000}
	for name, keys := range sets {
		for part, f := range parts {
			z := chiSquare(keys, &tb.seed, f, buckets[part])
			t.Logf("%s keys, %s bits: %.2f sd", name, part, z)
			if math.Abs(z) > 6 {
				t.Errorf("%s keys, %s bits: chi-square %.1f sd from uniform", name, part, z)
			}
		}
	}
}

// TestHashCollisions: a million structured keys have no two 64-bit hashes
// alike, and pairs that share a home slot under one seed are spread under
// another (collisions cannot be chosen without the seed).
func TestHashCollisions(t *testing.T) {
	sets := hashKeySets(1 << 18)
	a := newTable(t, Config{Capacity: 1024, Seed: 1})
	b := newTable(t, Config{Capacity: 1024, Seed: 2})
	seen := make(map[uint64]bool, 1<<20)
	for name, keys := range sets {
		for i := range keys {
			h := hashKey(&keys[i], &a.seed)
			if seen[h] {
				t.Errorf("%s: 64-bit collision", name)
			}
			seen[h] = true
		}
	}
	// Keys that an attacker who knew seed 1 would pick to land on one
	// slot of a 2^16-slot index: under seed 2 they spread like any keys.
	const slots = 1 << 16
	var chosen []Key
	for _, keys := range sets {
		for i := range keys {
			if hashKey(&keys[i], &a.seed)&(slots-1) == 12345 {
				chosen = append(chosen, keys[i])
			}
		}
	}
	if len(chosen) < 8 {
		t.Fatalf("only %d keys on the chosen slot", len(chosen))
	}
	same := 0
	for i := range chosen {
		if hashKey(&chosen[i], &b.seed)&(slots-1) == hashKey(&chosen[0], &b.seed)&(slots-1) {
			same++
		}
	}
	if same > 2 {
		t.Errorf("%d of %d keys that collide under one seed collide under another", same, len(chosen))
	}
}

// TestKeyV4 checks the IPv4 shortcut against MakeKey.
func TestKeyV4(t *testing.T) {
	tu := packet.Tuple{Src: packet.AddrFrom4([4]byte{10, 1, 2, 3}), Dst: packet.AddrFrom4([4]byte{198, 19, 0, 10}),
		SrcPort: 40001, DstPort: 80, Proto: packet.ProtoUDP}
	if got, want := KeyV4([4]byte{10, 1, 2, 3}, [4]byte{198, 19, 0, 10}, 40001, 80, packet.ProtoUDP), MakeKey(&tu); got != want {
		t.Fatalf("KeyV4 %x, MakeKey %x", got, want)
	}
}

var hashSink uint64

// BenchmarkHashKey compares the table's hash with the xxhash of the 40
// bytes it used before.
func BenchmarkHashKey(b *testing.B) {
	keys := hashKeySets(1024)["ports"]
	tb := newTable(b, Config{Capacity: 1024})
	b.Run("nh", func(b *testing.B) {
		i := 0
		for b.Loop() {
			hashSink += hashKey(&keys[i&1023], &tb.seed)
			i++
		}
	})
	b.Run("xxhash", func(b *testing.B) {
		i := 0
		for b.Loop() {
			var buf [keyWords * 8]byte
			k := &keys[i&1023]
			for j := range keyWords {
				binary.LittleEndian.PutUint64(buf[j*8:], k[j]^tb.seed[j])
			}
			hashSink += xxhash.Sum64(buf[:])
			i++
		}
	})
}
