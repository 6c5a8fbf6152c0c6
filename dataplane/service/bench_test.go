package service

import (
	"fmt"
	"runtime"
	"slices"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// bigModel has the given number of ClusterIP services with the given
// number of endpoints each; the first 20000 also have a NodePort.
func bigModel(services, endpoints int, scheduler Scheduler) *Model {
	m := &Model{Node: Node{Name: "node-a", Zone: "zone-a", Addresses: []packet.Addr{nodeV4}}}
	m.Ports = make([]ServicePort, services)
	for s := range m.Ports {
		sp := &m.Ports[s]
		*sp = ServicePort{
			Name:       name("ns", fmt.Sprint("svc-", s), "http"),
			Proto:      packet.ProtoTCP,
			ClusterIPs: []packet.Addr{clusterIPOf(s)},
			Port:       80,
			Scheduler:  scheduler,
			Endpoints:  make([]Endpoint, endpoints),
		}
		if s < 20000 {
			sp.NodePort = uint16(30000 + s)
		}
		for e := range sp.Endpoints {
			sp.Endpoints[e] = Endpoint{
				Addr:  packet.AddrFrom4([4]byte{10, byte(s >> 16), byte(s >> 8), byte(s)}),
				Port:  uint16(8000 + e),
				Ready: true, Serving: true,
				NodeName: fmt.Sprint("node-", e%3),
			}
		}
	}
	return m
}

func clusterIPOf(s int) packet.Addr {
	return packet.AddrFrom4([4]byte{198, 18 + byte(s>>16), byte(s >> 8), byte(s)})
}

func BenchmarkLookup(b *testing.B) {
	for _, n := range []int{1, 10_000, 100_000} {
		tab := Compile(bigModel(n, 2, Random), CompileOptions{})
		keys := make([]Key, 4096)
		for i := range keys {
			s := (i * 7919) % n
			keys[i] = Key{Addr: clusterIPOf(s), Port: 80, Proto: packet.ProtoTCP}
		}
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				k := &keys[i&4095]
				if tab.Lookup(k.Proto, k.Addr, k.Port) == nil {
					b.Fatal("miss")
				}
				i++
			}
		})
	}
}

func BenchmarkSelect(b *testing.B) {
	for _, s := range []Scheduler{Random, RoundRobin, Maglev} {
		f := Compile(schedModel(s, 10), CompileOptions{}).Lookup(packet.ProtoTCP, packet.MustParseAddr("198.19.0.1"), 80)
		b.Run(s.String(), func(b *testing.B) {
			b.ReportAllocs()
			h := uint64(1)
			for b.Loop() {
				h = h*6364136223846793005 + 1442695040888963407
				_ = f.Select(h, h>>1, false)
			}
		})
	}
}

func BenchmarkCompile(b *testing.B) {
	m := bigModel(10_000, 10, Random)
	b.Run("services=10000/endpoints=10", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = Compile(m, CompileOptions{})
		}
	})
	mm := bigModel(1000, 10, Maglev)
	b.Run("services=1000/endpoints=10/maglev", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = Compile(mm, CompileOptions{})
		}
	})
}

// heapInUse returns the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkCompileScale is the scale: 10,000 services of 10
// endpoints each (100,000 endpoints), compiled from scratch ("full") and
// from the previous table after one service's endpoints changed
// ("one-changed"), as a source with revisions publishes it. table-MB is
// the live heap the compiled table holds (the model excluded).
func BenchmarkCompileScale(b *testing.B) {
	m := bigModel(10_000, 10, Random)
	for i := range m.Ports {
		m.Ports[i].Revision = NewRevision()
	}
	b.Run("full", func(b *testing.B) {
		before := heapInUse()
		tab := Compile(m, CompileOptions{})
		size := heapInUse() - before
		runtime.KeepAlive(tab)
		b.ReportAllocs()
		for b.Loop() {
			_ = Compile(m, CompileOptions{})
		}
		b.ReportMetric(float64(size)/(1<<20), "table-MB")
	})
	b.Run("one-changed", func(b *testing.B) {
		// Two versions of the model that differ in one service, whose
		// last endpoint flips readiness.
		var versions [2]*Model
		for v := range versions {
			versions[v] = &Model{Node: m.Node, Ports: slices.Clone(m.Ports)}
			sp := &versions[v].Ports[5000]
			sp.Endpoints = slices.Clone(sp.Endpoints)
			sp.Endpoints[9].Ready = v == 0
			sp.Revision = NewRevision()
		}
		prev := Compile(versions[0], CompileOptions{})
		before := heapInUse()
		next := CompileFrom(prev, versions[1], CompileOptions{})
		size := heapInUse() - before
		runtime.KeepAlive(next)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			prev = CompileFrom(prev, versions[i%2], CompileOptions{})
		}
		b.ReportMetric(float64(size)/(1<<20), "extra-table-MB")
		if prev.Lookup(packet.ProtoTCP, clusterIPOf(5000), 80).Backends(false)[0].Port != 8000 {
			b.Fatal("wrong table")
		}
	})
}

func BenchmarkSelectWithAffinity(b *testing.B) {
	m := schedModel(Random, 10)
	m.Ports[0].AffinityTimeout = DefaultAffinityTimeout
	f := Compile(m, CompileOptions{}).Lookup(packet.ProtoTCP, packet.MustParseAddr("198.19.0.1"), 80)
	for _, clients := range []int{16, 4096} {
		b.Run(fmt.Sprint("clients=", clients), func(b *testing.B) {
			aff := NewAffinity(1 << 16)
			b.ReportAllocs()
			h := uint64(1)
			for b.Loop() {
				h = h*6364136223846793005 + 1442695040888963407
				c := int(h>>40) % clients
				client := packet.AddrFrom4([4]byte{198, 19, byte(c >> 8), byte(c)})
				_ = f.SelectWithAffinity(aff, client, h, h>>1, false, 1000)
			}
		})
	}
}
