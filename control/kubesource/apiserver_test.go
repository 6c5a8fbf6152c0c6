package kubesource_test

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/internal/kubetest"
)

func ptr[T any](v T) *T { return &v }

// webPort returns the ServicePort ns1/web:http of m and whether it is there.
func webPort(m *service.Model) (service.ServicePort, bool) {
	for _, sp := range m.Ports {
		if sp.Name.String() == "ns1/web:http" {
			return sp, true
		}
	}
	return service.ServicePort{}, false
}

func endpointsOf(sp service.ServicePort) string {
	var out []string
	for _, e := range sp.Endpoints {
		out = append(out, e.Addr.String())
	}
	return strings.Join(out, ",")
}

// TestRealAPIServer runs the source against a real kube-apiserver and etcd,
// configured only by a kubeconfig path as the daemon is, and restarts the
// API server under it.
func TestRealAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver")
	}
	cluster := kubetest.Start(t, kubetest.Options{})
	client := cluster.Client()
	ctx := context.Background()

	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: "node-1", Labels: map[string]string{v1.LabelTopologyZone: "zone-a"},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The API server allocates the cluster IP and fills in the defaults.
	svc, err := client.CoreV1().Services("ns1").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "http", Port: 80}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slice := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-1", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr[int32](8080)}},
		Endpoints: []discovery.Endpoint{
			{Addresses: []string{"10.0.0.1"}, NodeName: ptr("node-1")},
			{Addresses: []string{"10.0.0.2"}},
		},
	}
	if slice, err = client.DiscoveryV1().EndpointSlices("ns1").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	models := make(chan *service.Model, 100)
	src, err := kubesource.New(kubesource.Config{
		Kubeconfig:    cluster.Kubeconfig(),
		NodeName:      "node-1",
		MinSyncPeriod: 10 * time.Millisecond,
		MaxSyncPeriod: time.Second,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, func(m *service.Model) { models <- m })
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		if err := src.Run(runCtx); err != nil {
			t.Error(err)
		}
		close(done)
	}()
	t.Cleanup(func() { cancel(); <-done })

	// waitModel returns the first model for which ok holds, failing if any
	// model before it lacks the web service (nothing may flush it).
	waitModel := func(what string, ok func(service.ServicePort) bool) service.ServicePort {
		t.Helper()
		deadline := time.After(60 * time.Second)
		for {
			select {
			case m := <-models:
				sp, found := webPort(m)
				if !found {
					t.Fatalf("%s: a model without ns1/web was published (%d ports)", what, len(m.Ports))
				}
				if ok(sp) {
					return sp
				}
			case <-deadline:
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}

	sp := waitModel("the first model", func(sp service.ServicePort) bool { return endpointsOf(sp) == "10.0.0.1,10.0.0.2" })
	if len(sp.ClusterIPs) != 1 || sp.ClusterIPs[0].String() != svc.Spec.ClusterIP {
		t.Fatalf("cluster IPs %v, want the allocated %s", sp.ClusterIPs, svc.Spec.ClusterIP)
	}
	if !cluster.ServiceCIDR().Contains(sp.ClusterIPs[0].Netip()) {
		t.Fatalf("cluster IP %v outside %v", sp.ClusterIPs[0], cluster.ServiceCIDR())
	}
	if sp.Port != 80 || sp.Endpoints[0].Port != 8080 || sp.Endpoints[0].NodeName != "node-1" {
		t.Fatalf("port %+v", sp)
	}

	// The API server goes away and comes back. Models published meanwhile
	// (there should be none) must still hold the service, which waitModel
	// checks; a change made afterwards arrives.
	cluster.StopAPIServer()
	time.Sleep(2 * time.Second) // let the informers notice and fail to relist
	cluster.StartAPIServer()

	slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{Addresses: []string{"10.0.0.3"}})
	deadline := time.Now().Add(30 * time.Second)
	for {
		// The first requests after a restart may still be refused.
		if _, err = client.DiscoveryV1().EndpointSlices("ns1").Update(ctx, slice, metav1.UpdateOptions{}); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	waitModel("the change after the restart", func(sp service.ServicePort) bool {
		return endpointsOf(sp) == "10.0.0.1,10.0.0.2,10.0.0.3"
	})
}
