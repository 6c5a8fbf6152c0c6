package conntrack

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func TestFragments(t *testing.T) {
	tb := newTable(t, Config{Capacity: 16, FragmentCapacity: 16})
	k := FragmentKey{Src: client, Dst: frontend, ID: 0x1234, Proto: packet.ProtoUDP}
	if _, _, ok := tb.LookupFragment(k, 0); ok {
		t.Fatal("unknown datagram found")
	}
	tb.RememberFragment(k, snatAddr, backend, 0)
	src, dst, ok := tb.LookupFragment(k, 29*sec)
	if !ok || src != snatAddr || dst != backend {
		t.Fatalf("got %v %v %v", src, dst, ok)
	}
	for _, other := range []FragmentKey{
		{Src: client, Dst: frontend, ID: 0x1235, Proto: packet.ProtoUDP},
		{Src: client2, Dst: frontend, ID: 0x1234, Proto: packet.ProtoUDP},
		{Src: client, Dst: frontend, ID: 0x1234, Proto: packet.ProtoTCP},
	} {
		if _, _, ok := tb.LookupFragment(other, 0); ok {
			t.Errorf("%+v found", other)
		}
	}
	if _, _, ok := tb.LookupFragment(k, 30*sec); ok {
		t.Error("fragment translation alive after 30 s")
	}
	// Remembering again refreshes and may change the translation.
	tb.RememberFragment(k, client, backend2, 40*sec)
	if src, dst, ok := tb.LookupFragment(k, 41*sec); !ok || src != client || dst != backend2 {
		t.Errorf("after re-remember: %v %v %v", src, dst, ok)
	}

	var p packet.Packet
	p.Src, p.Dst, p.FragID, p.Proto = client, frontend, 0x1234, packet.ProtoUDP
	if FragmentKeyOf(&p) != k {
		t.Error("FragmentKeyOf")
	}
}

func TestFragmentTableOverflowEvictsOldest(t *testing.T) {
	tb := newTable(t, Config{Capacity: 16, FragmentCapacity: 4}) // one set of four
	for i := range 4 {
		tb.RememberFragment(FragmentKey{Src: client, Dst: frontend, ID: uint32(i), Proto: packet.ProtoUDP}, client, backend, int64(i)*sec)
	}
	tb.RememberFragment(FragmentKey{Src: client, Dst: frontend, ID: 99, Proto: packet.ProtoUDP}, client, backend, 5*sec)
	if _, _, ok := tb.LookupFragment(FragmentKey{Src: client, Dst: frontend, ID: 0, Proto: packet.ProtoUDP}, 5*sec); ok {
		t.Error("the oldest datagram survived")
	}
	for _, id := range []uint32{1, 2, 3, 99} {
		if _, _, ok := tb.LookupFragment(FragmentKey{Src: client, Dst: frontend, ID: id, Proto: packet.ProtoUDP}, 5*sec); !ok {
			t.Errorf("datagram %d lost", id)
		}
	}
	if st := tb.Stats(); st.FragsEvicted != 1 || st.FragsRemembered != 5 {
		t.Errorf("stats %+v", st)
	}
}
