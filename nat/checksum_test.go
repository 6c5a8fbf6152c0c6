package nat

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func TestSumMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 5000; i++ {
		b := make([]byte, rng.IntN(2100))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		if i%7 == 0 { // runs of 0xff stress the carries
			for j := range b {
				b[j] = 0xff
			}
		}
		initial := uint64(rng.Uint32() & 0xffff)
		got := Fold(Sum(b, initial))
		want := refSum(b, uint32(initial))
		if got != want {
			t.Fatalf("len %d initial %#x: Fold(Sum) = %#04x, want %#04x", len(b), initial, got, want)
		}
		// Pieces of even length chain.
		cut := rng.IntN(len(b)+1) &^ 1
		if chained := Fold(Sum(b[cut:], Sum(b[:cut], initial))); chained != want {
			t.Fatalf("len %d cut %d: chained sum %#04x, want %#04x", len(b), cut, chained, want)
		}
	}
}

func TestFold(t *testing.T) {
	for _, c := range []struct {
		in   uint64
		want uint16
	}{
		{0, 0},
		{0xffff, 0xffff},
		{0x10000, 1},
		{0x1fffe, 0xffff},
		{^uint64(0), 0xffff},
		{0x0001_0002_0003_0004, 10},
	} {
		if got := Fold(c.in); got != c.want {
			t.Errorf("Fold(%#x) = %#04x, want %#04x", c.in, got, c.want)
		}
	}
}

func TestChecksumKnownIPv4Header(t *testing.T) {
	// The example header of the Wikipedia article on the IPv4 header
	// checksum: 4500 0073 0000 4000 4011 [b861] c0a8 0001 c0a8 00c7.
	h := []byte{0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0, 0, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7}
	if got := Checksum(h, 0); got != 0xb861 {
		t.Fatalf("Checksum = %#04x, want 0xb861", got)
	}
}

func TestUpdateWordRFC1624Example(t *testing.T) {
	// RFC 1624 section 4: HC = 0xdd2f, m = 0x5555 -> m' = 0x3285. Eqn. 3
	// gives 0x0000, which is what a full recomputation gives; eqn. 2 would
	// give 0xffff.
	if got := UpdateWord(0xdd2f, 0x5555, 0x3285); got != 0x0000 {
		t.Fatalf("UpdateWord = %#04x, want 0x0000", got)
	}
}

// TestUpdatesMatchRecompute changes words, IPv4 and IPv6 addresses at
// random even offsets of random data and compares the incremental result
// with a full recomputation.
func TestUpdatesMatchRecompute(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	edge := []uint16{0, 1, 0xfffe, 0xffff, 0x8000}
	for i := 0; i < 20000; i++ {
		b := make([]byte, 40+2*rng.IntN(40))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		b[0], b[1] = 0, 0 // the checksum field
		check := Checksum(b, 0)
		binary.BigEndian.PutUint16(b, check)
		off := 2 + 2*rng.IntN((len(b)-18)/2)
		var got uint16
		switch i % 3 {
		case 0:
			old := binary.BigEndian.Uint16(b[off:])
			n := uint16(rng.Uint32())
			if i%5 == 0 {
				n = edge[rng.IntN(len(edge))]
				binary.BigEndian.PutUint16(b[off:], edge[rng.IntN(len(edge))])
				b[0], b[1] = 0, 0
				check = Checksum(b, 0)
				binary.BigEndian.PutUint16(b, check)
				old = binary.BigEndian.Uint16(b[off:])
			}
			binary.BigEndian.PutUint16(b[off:], n)
			got = UpdateWord(check, old, n)
		case 1:
			old := [4]byte(b[off : off+4])
			n := [4]byte{byte(rng.Uint32()), byte(rng.Uint32()), byte(rng.Uint32()), byte(rng.Uint32())}
			copy(b[off:], n[:])
			got = UpdateAddr4(check, old, n)
		case 2:
			old := [16]byte(b[off : off+16])
			var n [16]byte
			for j := range n {
				n[j] = byte(rng.Uint32())
			}
			copy(b[off:], n[:])
			got = UpdateAddr16(check, old, n)
		}
		b[0], b[1] = 0, 0
		if want := Checksum(b, 0); got != want {
			t.Fatalf("case %d: incremental %#04x, full %#04x", i, got, want)
		}
	}
}

func TestPseudoHeaderSum(t *testing.T) {
	cases := []struct{ src, dst string }{
		{"198.18.0.1", "198.18.1.2"},
		{"255.255.255.255", "255.255.255.255"},
		{"2001:db8::1", "2001:db8:ffff::2"},
		{"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "::1"},
	}
	for _, c := range cases {
		src, dst := netip.MustParseAddr(c.src), netip.MustParseAddr(c.dst)
		for _, l := range []int{0, 8, 1480, 65535} {
			got := Fold(PseudoHeaderSum(packet.AddrFromNetip(src), packet.AddrFromNetip(dst), packet.ProtoTCP, l))
			if want := uint16(refPseudo(src, dst, packet.ProtoTCP, l)); got != want {
				t.Errorf("%s %s len %d: %#04x, want %#04x", c.src, c.dst, l, got, want)
			}
		}
	}
}
