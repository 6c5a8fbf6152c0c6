package k8sconv

import (
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/dataplane/service"
)

// cluster returns n services with one slice of m endpoints each.
func cluster(n, m int) ([]*v1.Service, []*discovery.EndpointSlice) {
	svcs := make([]*v1.Service, n)
	eps := make([]*discovery.EndpointSlice, n)
	for i := range n {
		name := fmt.Sprintf("svc-%05d", i)
		svcs[i] = makeService("bench", name, func(s *v1.Service) {
			ip := fmt.Sprintf("172.30.%d.%d", i/250, i%250+1)
			s.Spec.ClusterIP, s.Spec.ClusterIPs = ip, []string{ip}
		})
		eps[i] = makeSlice("bench", name+"-1", name, func(es *discovery.EndpointSlice) {
			for j := range m {
				es.Endpoints = append(es.Endpoints, ep(fmt.Sprintf("10.%d.%d.%d", i/250, i%250, j+1),
					func(e *discovery.Endpoint) { e.NodeName, e.Zone = ptr("node-1"), ptr("zone-a") }))
			}
		})
	}
	return svcs, eps
}

func quietConverter() *Converter {
	return NewConverter(Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
}

// BenchmarkFullBuild converts 10,000 Services and their EndpointSlices
// (100,000 endpoints) and builds the Model from scratch: a cold start.
func BenchmarkFullBuild(b *testing.B) {
	svcs, slices := cluster(10000, 10)
	b.ReportAllocs()
	for b.Loop() {
		c := quietConverter()
		bld := NewBuilder()
		for _, s := range svcs {
			bld.SetService(typesName(s.Namespace, s.Name), c.Service(s))
		}
		for _, es := range slices {
			bld.SetSlice(SliceKey{es.Namespace, es.Name}, c.EndpointSlice(es))
		}
		if m := bld.Model(service.Node{}); len(m.Ports) != 10000 {
			b.Fatal(len(m.Ports))
		}
	}
}

// BenchmarkIncrementalSlice is one EndpointSlice changing in that cluster:
// convert it, rebuild its service, and assemble the next Model.
func BenchmarkIncrementalSlice(b *testing.B) {
	svcs, slices := cluster(10000, 10)
	c := quietConverter()
	bld := NewBuilder()
	for _, s := range svcs {
		bld.SetService(typesName(s.Namespace, s.Name), c.Service(s))
	}
	for _, es := range slices {
		bld.SetSlice(SliceKey{es.Namespace, es.Name}, c.EndpointSlice(es))
	}
	bld.Model(service.Node{})
	// Two versions of one slice: the 10th endpoint flips readiness.
	v1s := slices[5000]
	v2s := v1s.DeepCopy()
	v2s.Endpoints[9].Conditions.Ready = ptr(false)
	versions := []*discovery.EndpointSlice{v1s, v2s}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		es := versions[i%2]
		i++
		bld.SetSlice(SliceKey{es.Namespace, es.Name}, c.EndpointSlice(es))
		if m := bld.Model(service.Node{}); len(m.Ports) != 10000 {
			b.Fatal(len(m.Ports))
		}
	}
}

// BenchmarkBuilderSetService adds 100,000 Services in each order and builds
// the Model; delete removes them all in random order (a namespace going
// away). Kubernetes hands over its first sync in random order.
func BenchmarkBuilderSetService(b *testing.B) {
	const n = 100000
	c := quietConverter()
	keys := make([]types.NamespacedName, n)
	svcs := make([]*Service, n)
	for i := range n {
		s := makeService("bench", fmt.Sprintf("svc-%06d", i), func(s *v1.Service) {
			ip := fmt.Sprintf("172.%d.%d.%d", 16+i>>16, i>>8&255, i&255)
			s.Spec.ClusterIP, s.Spec.ClusterIPs = ip, []string{ip}
		})
		keys[i], svcs[i] = typesName(s.Namespace, s.Name), c.Service(s)
	}
	sorted := make([]int, n)
	for i := range sorted {
		sorted[i] = i
	}
	random := slices.Clone(sorted)
	rand.New(rand.NewPCG(1, 2)).Shuffle(n, func(i, j int) { random[i], random[j] = random[j], random[i] })
	reverse := slices.Clone(sorted)
	slices.Reverse(reverse)
	add := func(bld *Builder, order []int) {
		for _, i := range order {
			bld.SetService(keys[i], svcs[i])
		}
	}
	for _, tc := range []struct {
		name  string
		order []int
	}{{"sorted", sorted}, {"random", random}, {"reverse", reverse}} {
		b.Run("add/"+tc.name, func(b *testing.B) {
			for b.Loop() {
				bld := NewBuilder()
				add(bld, tc.order)
				if m := bld.Model(service.Node{}); len(m.Ports) != n {
					b.Fatal(len(m.Ports))
				}
			}
		})
	}
	b.Run("delete/random", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			bld := NewBuilder()
			add(bld, sorted)
			bld.Model(service.Node{})
			b.StartTimer()
			for _, i := range random {
				bld.SetService(keys[i], nil)
			}
			if m := bld.Model(service.Node{}); len(m.Ports) != 0 {
				b.Fatal(len(m.Ports))
			}
		}
	})
}
