package kubesource

import (
	"fmt"
	"io"
	"log/slog"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/xdproxy/xdproxy/dataplane/service"
)

// BenchmarkSliceEvent is the whole incremental path for one EndpointSlice
// update in a cluster of 10,000 services with 10 endpoints each: the
// informer handler (convert old and new, track the change) and the sync
// (checkout, rebuild one service, assemble and publish the Model).
func BenchmarkSliceEvent(b *testing.B) {
	published := 0
	s, err := NewForClient(fake.NewClientset(), Config{
		NodeName: "node-1",
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, func(m *service.Model) error {
		if len(m.Ports) != 10000 {
			b.Fatalf("%d ports", len(m.Ports))
		}
		published++
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	s.synced.Store(true)
	for i := range 10000 {
		name := fmt.Sprintf("svc-%05d", i)
		s.onService(nil, testService(name, func(svc *v1.Service) {
			ip := fmt.Sprintf("172.30.%d.%d", i/250, i%250+1)
			svc.Spec.ClusterIP, svc.Spec.ClusterIPs = ip, []string{ip}
		}))
		var addrs []string
		for j := range 10 {
			addrs = append(addrs, fmt.Sprintf("10.%d.%d.%d", i/250, i%250, j+1))
		}
		s.onSlice(nil, testSlice(name+"-1", name, addrs...))
	}
	s.sync()
	before := testSlice("svc-05000-1", "svc-05000",
		"10.20.0.1", "10.20.0.2", "10.20.0.3", "10.20.0.4", "10.20.0.5", "10.20.0.6", "10.20.0.7", "10.20.0.8", "10.20.0.9", "10.20.0.10")
	after := before.DeepCopy()
	after.Endpoints[9].Conditions.Ready = ptr(false)
	s.onSlice(nil, before)
	s.sync()
	versions := [2]*discovery.EndpointSlice{before, after}
	published = 0
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		s.onSlice(versions[i%2], versions[(i+1)%2])
		s.sync()
		i++
	}
	if published != i {
		b.Fatalf("%d publishes for %d updates", published, i)
	}
}
