package service

import (
	"encoding/binary"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/xdproxy/xdproxy/nat/packet"
)

func affinityModel(n int) *Model {
	m := schedModel(Random, n)
	m.Ports[0].AffinityTimeout = DefaultAffinityTimeout
	return m
}

func TestAffinityKeepsClientOnBackend(t *testing.T) {
	m := affinityModel(10)
	aff := NewAffinity(1024)
	tab := Compile(m, CompileOptions{})
	f := tab.Lookup(packet.ProtoTCP, a("198.19.0.1"), 80)
	client := externalC
	first := f.SelectWithAffinity(aff, client, 1, 1, false, 100)
	for i := uint64(2); i < 50; i++ {
		if b := f.SelectWithAffinity(aff, client, i, i*0x9e3779b97f4a7c15, false, 100+uint32(i)); b.Addr != first.Addr {
			t.Fatalf("flow %d went to %v, want %v", i, b.Addr, first.Addr)
		}
	}
	// A new table with the same model keeps the memory.
	f2 := Compile(m, CompileOptions{}).Lookup(packet.ProtoTCP, a("198.19.0.1"), 80)
	if b := f2.SelectWithAffinity(aff, client, 99, 12345, false, 200); b.Addr != first.Addr {
		t.Fatalf("after swap: %v, want %v", b.Addr, first.Addr)
	}
	// Without affinity on the port the memory is not consulted.
	noAff := Compile(schedModel(RoundRobin, 10), CompileOptions{}).Lookup(packet.ProtoTCP, a("198.19.0.1"), 80)
	picks := map[packet.Addr]bool{}
	for i := 0; i < 10; i++ {
		picks[noAff.SelectWithAffinity(aff, client, 1, 1, false, 200).Addr] = true
	}
	if len(picks) != 10 {
		t.Errorf("round robin without affinity reached %d of 10 backends", len(picks))
	}

	// The remembered backend is removed: a usable one is chosen and
	// remembered instead.
	i := slices.IndexFunc(m.Ports[0].Endpoints, func(e Endpoint) bool { return e.Addr == first.Addr })
	m.Ports[0].Endpoints[i].Ready = false
	f3 := Compile(m, CompileOptions{}).Lookup(packet.ProtoTCP, a("198.19.0.1"), 80)
	next := f3.SelectWithAffinity(aff, client, 5, 5, false, 300)
	if next.Addr == first.Addr {
		t.Fatal("affinity kept a backend that is no longer usable")
	}
	for j := uint64(0); j < 20; j++ {
		if b := f3.SelectWithAffinity(aff, client, j, j*31337, false, 301); b.Addr != next.Addr {
			t.Fatalf("new affinity not kept: %v, want %v", b.Addr, next.Addr)
		}
	}
}

func TestAffinityHashIsXXHash(t *testing.T) {
	for _, c := range [][3]uint64{{0, 0, 0}, {1, 2, 3}, {^uint64(0), 0x0123456789abcdef, 42}} {
		var b [24]byte
		for i, w := range c {
			binary.LittleEndian.PutUint64(b[8*i:], w)
		}
		if got, want := affinityHash(c[0], &[2]uint64{c[1], c[2]}), xxhash.Sum64(b[:]); got != want {
			t.Errorf("%x: affinityHash %#x, xxhash %#x", c, got, want)
		}
	}
}

func TestAffinityExpires(t *testing.T) {
	aff := NewAffinity(64)
	const port = 42
	b := a("198.18.129.1")
	aff.Remember(port, externalC, b, 80, 1000, 10)
	if got, p, ok := aff.Lookup(port, externalC, 1009); !ok || got != b || p != 80 {
		t.Fatalf("lookup before expiry: %v %d %v", got, p, ok)
	}
	if _, _, ok := aff.Lookup(port, externalC, 1010); ok {
		t.Fatal("entry alive at its expiry second")
	}
	if _, _, ok := aff.Lookup(port+1, externalC, 1001); ok {
		t.Fatal("entry found under another port")
	}
	if _, _, ok := aff.Lookup(port, remotePod, 1001); ok {
		t.Fatal("entry found for another client")
	}
	// Use refreshes the timeout, as kube-proxy does per connection.
	m := affinityModel(3)
	m.Ports[0].AffinityTimeout = 10 * time.Second
	f := Compile(m, CompileOptions{}).Lookup(packet.ProtoTCP, a("198.19.0.1"), 80)
	first := f.SelectWithAffinity(aff, remotePod, 1, 1, false, 0)
	for now := uint32(5); now < 100; now += 5 {
		if got := f.SelectWithAffinity(aff, remotePod, 1, uint64(now)*0x9e3779b97f4a7c15, false, now); got.Addr != first.Addr {
			t.Fatalf("at %d: affinity lost despite use every 5 s", now)
		}
	}
}

// Overfilling the table loses affinity for some clients but never returns
// another client's backend.
func TestAffinityOverCapacity(t *testing.T) {
	aff := NewAffinity(64)
	backendOf := func(i int) packet.Addr {
		return packet.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
	}
	clientOf := func(i int) packet.Addr {
		return packet.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
	}
	const n = 1000
	for i := 0; i < n; i++ {
		aff.Remember(7, clientOf(i), backendOf(i), uint16(i), uint32(i), 100000)
	}
	hits := 0
	for i := 0; i < n; i++ {
		if b, p, ok := aff.Lookup(7, clientOf(i), n); ok {
			hits++
			if b != backendOf(i) || p != uint16(i) {
				t.Fatalf("client %d got backend %v:%d", i, b, p)
			}
		}
	}
	// Eviction takes the soonest-expiring entry, so the newest ones stay.
	if hits == 0 || hits > aff.Capacity() {
		t.Fatalf("%d hits with capacity %d", hits, aff.Capacity())
	}
	if _, _, ok := aff.Lookup(7, clientOf(n-1), n); !ok {
		t.Error("newest entry was evicted")
	}
}

// Workers remember and look up concurrently; every hit must be the
// backend some writer stored for that very key. Run with -race.
func TestAffinityConcurrent(t *testing.T) {
	aff := NewAffinity(256)
	const workers, rounds, clients = 4, 20000, 512
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				c := (r*7 + w*131) % clients
				client := packet.AddrFrom4([4]byte{198, 19, byte(c >> 8), byte(c)})
				if b, p, ok := aff.Lookup(1, client, uint32(r)); ok {
					if binary.BigEndian.Uint16(b[14:]) != uint16(c) || p != uint16(c) {
						t.Errorf("client %d got %v:%d", c, b, p)
						return
					}
				} else {
					aff.Remember(1, client, packet.AddrFrom4([4]byte{198, 18, byte(c >> 8), byte(c)}), uint16(c), uint32(r), 1000)
				}
			}
		}()
	}
	wg.Wait()
}

func TestBackendSetFind(t *testing.T) {
	for _, n := range []int{0, 1, 16, 17, 100} {
		s := BackendSet{}
		for i := 0; i < n; i++ {
			s.Backends = append(s.Backends, Backend{Addr: packet.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), Port: 80})
		}
		for i := 0; i < n; i++ {
			if b := s.find(s.Backends[i].Addr, 80); b != &s.Backends[i] {
				t.Errorf("n=%d: backend %d not found", n, i)
			}
			if s.find(s.Backends[i].Addr, 81) != nil {
				t.Errorf("n=%d: found wrong port", n)
			}
		}
		if s.find(a("198.19.0.1"), 80) != nil {
			t.Errorf("n=%d: found absent address", n)
		}
	}
}
