package kubesource_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/control/metrics"
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
	}, func(m *service.Model) error { models <- m; return nil })
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
	// The first requests after a restart may still be refused.
	if wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err = client.DiscoveryV1().EndpointSlices("ns1").Update(ctx, slice, metav1.UpdateOptions{})
		return err == nil, nil
	}) != nil {
		t.Fatalf("updating the slice after the restart: %v", err)
	}
	waitModel("the change after the restart", func(sp service.ServicePort) bool {
		return endpointsOf(sp) == "10.0.0.1,10.0.0.2,10.0.0.3"
	})
}

// healthCalls is a kubesource.Health that counts the calls.
type healthCalls struct {
	mu      sync.Mutex
	queued  int
	updated int
}

func (h *healthCalls) QueuedUpdate() { h.mu.Lock(); h.queued++; h.mu.Unlock() }
func (h *healthCalls) Updated()      { h.mu.Lock(); h.updated++; h.mu.Unlock() }

func (h *healthCalls) counts() (queued, updated int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.queued, h.updated
}

// TestRealAPIServerPublishRetryAndNodeState runs the source against a real
// kube-apiserver with a publish callback that refuses its first three
// Models. A Service and EndpointSlice applied meanwhile reach the dataplane
// in the first publish that succeeds, after retries 1 s, 2 s and 4 s
// apart, and nothing is lost. Then this node's Node is created, tainted
// ToBeDeletedByClusterAutoscaler, untainted, deleted while a finalizer
// holds it (a deletion timestamp) and finally removed, and NodeState
// follows each step.
func TestRealAPIServerPublishRetryAndNodeState(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver")
	}
	cluster := kubetest.Start(t, kubetest.Options{})
	client := cluster.Client()
	ctx := context.Background()
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	const failFirst = 3
	var mu sync.Mutex
	var tries []time.Time
	models := make(chan *service.Model, 100)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	hc := &healthCalls{}
	src, err := kubesource.New(kubesource.Config{
		Kubeconfig:    cluster.Kubeconfig(),
		NodeName:      "node-1",
		MinSyncPeriod: 10 * time.Millisecond,
		MaxSyncPeriod: time.Second,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics:       m,
		Health:        hc,
	}, func(model *service.Model) error {
		mu.Lock()
		tries = append(tries, time.Now())
		n := len(tries)
		mu.Unlock()
		if n <= failFirst {
			return fmt.Errorf("refusing try %d", n)
		}
		models <- model
		return nil
	})
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

	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 60*time.Second, true,
			func(context.Context) (bool, error) { return cond(), nil }); err != nil {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
	// The informers have synced and the first (empty) Model was refused.
	waitFor("the first try", func() bool { return testutil.ToFloat64(m.PublishFailures) == 1 })
	if got := testutil.ToFloat64(m.PublishPending); got != 1 {
		t.Fatalf("publish pending %v after a failure", got)
	}

	if _, err := client.CoreV1().Services("ns1").Create(ctx, &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Name: "http", Port: 80}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("ns1").Create(ctx, &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-1", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr[int32](8080)}},
		Endpoints:   []discovery.Endpoint{{Addresses: []string{"10.0.0.1"}}, {Addresses: []string{"10.0.0.2"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	var first *service.Model
	select {
	case first = <-models:
	case <-time.After(60 * time.Second):
		t.Fatalf("nothing published; %v failures", testutil.ToFloat64(m.PublishFailures))
	}
	sp, ok := webPort(first)
	if !ok || endpointsOf(sp) != "10.0.0.1,10.0.0.2" {
		t.Fatalf("first published model lacks ns1/web with both endpoints: %+v", first.Ports)
	}
	mu.Lock()
	got := slices.Clone(tries)
	mu.Unlock()
	if len(got) != failFirst+1 {
		t.Fatalf("%d tries, want %d", len(got), failFirst+1)
	}
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
		// Not before the backoff, and before the step after it.
		if d := got[i+1].Sub(got[i]); d < want || d >= 2*want {
			t.Errorf("try %d came %v after try %d, want %v", i+2, d, i+1, want)
		}
	}
	waitFor("the pending gauge to clear", func() bool { return testutil.ToFloat64(m.PublishPending) == 0 })
	if n := testutil.ToFloat64(m.PublishFailures); n != failFirst {
		t.Errorf("publish failures %v, want %d", n, failFirst)
	}
	if last := testutil.ToFloat64(m.LastSyncTimestamp); last < float64(got[failFirst].Unix()) {
		t.Errorf("last sync timestamp %v, before the successful publish at %v", last, got[failFirst].Unix())
	}
	// Updated when Run started and after the success, not after a failure.
	waitFor("Updated after the success", func() bool { _, u := hc.counts(); return u == 2 })
	if q, _ := hc.counts(); q < 1 {
		t.Errorf("QueuedUpdate not called for the Service and EndpointSlice")
	}

	// NodeState through the API.
	nodes := client.CoreV1().Nodes()
	expectState := func(what string, want health.NodeState) {
		t.Helper()
		waitFor(fmt.Sprintf("%s: NodeState %+v", what, want), func() bool { return src.NodeState() == want })
	}
	update := func(what string, tweak func(*v1.Node)) {
		t.Helper()
		for {
			n, err := nodes.Get(ctx, "node-1", metav1.GetOptions{})
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			tweak(n)
			if _, err = nodes.Update(ctx, n, metav1.UpdateOptions{}); err == nil {
				return
			} else if !apierrors.IsConflict(err) {
				t.Fatalf("%s: %v", what, err)
			}
		}
	}
	expectState("no Node yet", health.NodeState{})
	if _, err := nodes.Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: "node-1", Finalizers: []string{"xdproxy.io/test-hold"},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expectState("created", health.NodeState{Known: true})
	update("taint", func(n *v1.Node) {
		n.Spec.Taints = append(n.Spec.Taints, v1.Taint{Key: kubesource.ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule})
	})
	expectState("tainted", health.NodeState{Known: true, Deleting: true})
	update("untaint", func(n *v1.Node) { n.Spec.Taints = nil })
	expectState("untainted", health.NodeState{Known: true})
	if err := nodes.Delete(ctx, "node-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	expectState("deletion timestamp (held by the finalizer)", health.NodeState{Known: true, Deleting: true})
	update("drop the finalizer", func(n *v1.Node) { n.Finalizers = nil })
	expectState("deleted", health.NodeState{})
}
