package service

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// genModel is model generation g: every endpoint's port is 1000+g, so a
// reader can tell which generation a backend came from.
func genModel(g int) *Model {
	m := &Model{Node: Node{Name: "node-a", Addresses: []packet.Addr{nodeV4}}}
	for s := 0; s < 20; s++ {
		sp := ServicePort{
			Name:       name("ns", fmt.Sprint("svc", s), ""),
			Proto:      packet.ProtoTCP,
			ClusterIPs: []packet.Addr{packet.AddrFrom4([4]byte{198, 19, 0, byte(s)})},
			Port:       80,
			NodePort:   uint16(30000 + s),
			Scheduler:  Scheduler(s % 3),
		}
		if s%4 == 0 {
			sp.AffinityTimeout = DefaultAffinityTimeout
		}
		for e := 0; e < 1+(g+s)%5; e++ {
			sp.Endpoints = append(sp.Endpoints, ep(fmt.Sprintf("198.18.%d.%d", 129+s, e+1), uint16(1000+g), "node-b", "ready"))
		}
		m.Ports = append(m.Ports, sp)
	}
	return m
}

// Readers look up and select while a writer compiles and swaps tables.
// Every answer must be self-consistent: the backend belongs to the same
// generation as the table the reader loaded. Run with -race.
func TestConcurrentSwap(t *testing.T) {
	var cur Current
	cur.Store(Compile(genModel(0), CompileOptions{Generation: 1}))
	aff := NewAffinity(1024)
	var stop atomic.Bool
	var wg sync.WaitGroup
	var reads atomic.Int64
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := uint64(w + 1)
			for i := 0; !stop.Load() || i < 1000; i++ {
				tab := cur.Load()
				gen := int(tab.Generation()) - 1
				s := i % 20
				rnd = rnd*6364136223846793005 + 1442695040888963407
				f := tab.Lookup(packet.ProtoTCP, packet.AddrFrom4([4]byte{198, 19, 0, byte(s)}), 80)
				if i%2 == 1 {
					f = tab.Lookup(packet.ProtoTCP, nodeV4, uint16(30000+s))
				}
				if f == nil {
					t.Errorf("generation %d: service %d missing", gen, s)
					return
				}
				client := packet.AddrFrom4([4]byte{198, 19, 200, byte(rnd >> 56)})
				b := f.SelectWithAffinity(aff, client, rnd>>7, rnd, false, uint32(i/100))
				if b == nil || b.Port != uint16(1000+gen) {
					t.Errorf("generation %d: backend %+v", gen, b)
					return
				}
				reads.Add(1)
			}
		}()
	}
	for g := 1; g < 200; g++ {
		cur.Store(Compile(genModel(g), CompileOptions{Generation: uint64(g + 1)}))
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d selections during 199 swaps", reads.Load())
}

func TestHotPathDoesNotAllocate(t *testing.T) {
	m := testModel()
	for i := range m.Ports {
		m.Ports[i].AffinityTimeout = DefaultAffinityTimeout
	}
	tab := Compile(m, testOptions)
	aff := NewAffinity(1024)
	lb := a("198.19.100.13")
	cip := a("198.19.0.1")
	for _, s := range []Scheduler{Random, RoundRobin, Maglev} {
		sm := schedModel(s, 10)
		sm.Ports[0].AffinityTimeout = DefaultAffinityTimeout
		st := Compile(sm, CompileOptions{})
		f := st.Lookup(packet.ProtoTCP, cip, 80)
		h := uint64(1)
		if n := testing.AllocsPerRun(1000, func() {
			h = h*6364136223846793005 + 1
			_ = f.Select(h, h>>3, false)
		}); n != 0 {
			t.Errorf("%v Select allocates %.1f", s, n)
		}
		if n := testing.AllocsPerRun(1000, func() {
			h = h*6364136223846793005 + 1
			_ = f.SelectWithAffinity(aff, packet.AddrFrom4([4]byte{198, 19, 9, byte(h >> 60)}), h, h>>3, false, uint32(h>>40))
		}); n != 0 {
			t.Errorf("%v SelectWithAffinity allocates %.1f", s, n)
		}
	}
	var f *Frontend
	if n := testing.AllocsPerRun(1000, func() {
		f = tab.Lookup(packet.ProtoTCP, cip, 80)
		_ = tab.Lookup(packet.ProtoTCP, lb, 443)
		_ = tab.Lookup(packet.ProtoUDP, lb, 443)
	}); n != 0 {
		t.Errorf("Lookup allocates %.1f", n)
	}
	lbf := tab.Lookup(packet.ProtoTCP, lb, 443)
	b := &f.Backends(false)[0]
	if n := testing.AllocsPerRun(1000, func() {
		_ = NeedsMasquerade(f, externalC, b)
		_ = NeedsMasquerade(lbf, externalC, b)
		_ = lbf.AllowsSource(externalC)
		_ = lbf.AllowsSource(lb)
		_ = tab.IsLocalOrigin(localPod)
		_ = tab.IsBackend(packet.ProtoTCP, b.Addr, b.Port)
		_ = f.Verdict(true)
	}); n != 0 {
		t.Errorf("per-packet helpers allocate %.1f", n)
	}
}
