package service

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestLookupInStages: PrefetchLookup then LookupHashed finds what Lookup
// finds, for frontends (ClusterIPs and NodePorts) and for keys that are
// none, and a nil table has no frontends either way.
func TestLookupInStages(t *testing.T) {
	tab := Compile(bigModel(3000, 2, Random), CompileOptions{})
	nodePort := func(s int) uint16 { return uint16(30000 + s) }
	type query struct {
		proto packet.Proto
		dst   packet.Addr
		port  uint16
	}
	var qs []query
	for s := 0; s < 3000; s += 7 {
		qs = append(qs,
			query{packet.ProtoTCP, clusterIPOf(s), 80},
			query{packet.ProtoTCP, nodeV4, nodePort(s)},
			query{packet.ProtoUDP, clusterIPOf(s), 80}, // no UDP port
			query{packet.ProtoTCP, clusterIPOf(s), 81}, // no such port
		)
	}
	found := 0
	for _, q := range qs {
		want := tab.Lookup(q.proto, q.dst, q.port)
		h := tab.PrefetchLookup(q.proto, &q.dst, q.port)
		got := tab.LookupHashed(h, q.proto, &q.dst, q.port)
		if got != want {
			t.Fatalf("%v %v:%d: in stages %p, Lookup %p", q.proto, q.dst, q.port, got, want)
		}
		if got != nil {
			got.PrefetchSelect()
			found++
		}
	}
	if found != len(qs)/2 {
		t.Fatalf("%d of %d queries found a frontend, want %d", found, len(qs), len(qs)/2)
	}
	var none *Table
	dst := clusterIPOf(0)
	if f := none.LookupHashed(none.PrefetchLookup(packet.ProtoTCP, &dst, 80), packet.ProtoTCP, &dst, 80); f != nil {
		t.Fatalf("a nil table found %p", f)
	}
}
