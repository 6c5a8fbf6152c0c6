package kubesource

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/control/runner"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func testService(name string, tweaks ...func(*v1.Service)) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: name},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  "172.30.0.1",
			ClusterIPs: []string{"172.30.0.1"},
			Ports:      []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, t := range tweaks {
		t(svc)
	}
	return svc
}

func testSlice(name, svcName string, addrs ...string) *discovery.EndpointSlice {
	es := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: "ns1", Name: name,
			Labels: map[string]string{discovery.LabelServiceName: svcName},
		},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr[int32](8080), Protocol: ptr(v1.ProtocolTCP)}},
	}
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discovery.Endpoint{Addresses: []string{a}, NodeName: ptr("node-1")})
	}
	return es
}

func testNode() *v1.Node {
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{v1.LabelTopologyZone: "zone-a"}},
		Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
			{Type: v1.NodeHostName, Address: "node-1"},
			{Type: v1.NodeInternalIP, Address: "198.18.0.10"},
			{Type: v1.NodeExternalIP, Address: "198.19.0.10"},
		}},
	}
}

func ptr[T any](v T) *T { return &v }

type harness struct {
	t       *testing.T
	client  *fake.Clientset
	src     *Source
	clock   *runner.FakeClock
	metrics *metrics.Metrics
	models  chan *service.Model
	cancel  context.CancelFunc
}

// newHarness makes a Source on a fake clientset holding objs. The runner
// has no minimum interval, so every change is published as soon as it is
// seen; the clock moves only when a test steps it.
func newHarness(t *testing.T, cfg Config, objs ...runtime.Object) *harness {
	t.Helper()
	h := &harness{
		t:      t,
		client: fake.NewClientset(objs...),
		clock:  runner.NewFakeClock(t0),
		models: make(chan *service.Model, 100),
	}
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	h.metrics = m
	if cfg.NodeName == "" {
		cfg.NodeName = "node-1"
	}
	cfg.MinSyncPeriod = -1
	cfg.MaxSyncPeriod = time.Hour
	cfg.Clock = h.clock
	cfg.Metrics = m
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	h.src, err = NewForClient(h.client, cfg, func(m *service.Model) { h.models <- m })
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func (h *harness) start() {
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	done := make(chan struct{})
	go func() {
		if err := h.src.Run(ctx); err != nil {
			h.t.Error(err)
		}
		close(done)
	}()
	h.t.Cleanup(func() { cancel(); <-done })
}

// next waits for the next published model.
func (h *harness) next() *service.Model {
	h.t.Helper()
	select {
	case m := <-h.models:
		return m
	case <-time.After(10 * time.Second):
		h.t.Fatal("no model published")
		return nil
	}
}

func (h *harness) expectNone() {
	h.t.Helper()
	select {
	case m := <-h.models:
		h.t.Fatalf("unexpected publish: %s", describe(m))
	default:
	}
}

// waitFor polls cond: informer events arrive on goroutines of their own.
func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// describe renders a model as "name=ep,ep name=..." for comparisons.
func describe(m *service.Model) string {
	var parts []string
	for _, sp := range m.Ports {
		var eps []string
		for _, e := range sp.Endpoints {
			eps = append(eps, e.Addr.String())
		}
		parts = append(parts, sp.Name.String()+"="+strings.Join(eps, ","))
	}
	return strings.Join(parts, " ")
}

func TestPublishesAfterSync(t *testing.T) {
	h := newHarness(t, Config{},
		testService("a"), testSlice("a-1", "a", "10.0.0.2", "10.0.0.1"),
		testService("b"), testSlice("b-1", "b", "10.0.1.1"), testSlice("b-2", "b", "10.0.1.2"),
		testService("skip", func(s *v1.Service) { s.Labels = map[string]string{"service.kubernetes.io/service-proxy-name": "other"} }),
		testNode())
	h.start()
	m := h.next()
	if got, want := describe(m), "ns1/a:http=10.0.0.1,10.0.0.2 ns1/b:http=10.0.1.1,10.0.1.2"; got != want {
		t.Fatalf("model %q, want %q", got, want)
	}
	wantNode := service.Node{Name: "node-1", Zone: "zone-a",
		Addresses: []packet.Addr{packet.MustParseAddr("198.18.0.10"), packet.MustParseAddr("198.19.0.10")}}
	if m.Node.Name != wantNode.Name || m.Node.Zone != wantNode.Zone || !slices.Equal(m.Node.Addresses, wantNode.Addresses) {
		t.Fatalf("node %+v, want %+v", m.Node, wantNode)
	}
	if !h.src.Synced() {
		t.Error("Synced() false after publish")
	}
	h.expectNone()
}

func TestEmptyClusterPublishesEmptyModel(t *testing.T) {
	h := newHarness(t, Config{NodeZone: "fallback"})
	h.start()
	m := h.next()
	if len(m.Ports) != 0 || m.Node.Name != "node-1" || m.Node.Zone != "fallback" || len(m.Node.Addresses) != 0 {
		t.Fatalf("model %+v", m)
	}
}

func TestNodePortAddressesFilter(t *testing.T) {
	h := newHarness(t, Config{NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/16")}}, testNode())
	h.start()
	m := h.next()
	if !slices.Equal(m.Node.Addresses, []packet.Addr{packet.MustParseAddr("198.18.0.10")}) {
		t.Fatalf("node addresses %v", m.Node.Addresses)
	}
	// The node's zone changes: a new model carries it.
	n := testNode()
	n.Labels[v1.LabelTopologyZone] = "zone-b"
	if _, err := h.client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if m := h.next(); m.Node.Zone != "zone-b" {
		t.Fatalf("zone %q after node update", m.Node.Zone)
	}
}

// failingLists makes list calls for resource fail while on is set, and
// counts the failures.
type failingLists struct {
	on    atomic.Bool
	count atomic.Int32
}

func (f *failingLists) install(c *fake.Clientset, resource string) {
	c.PrependReactor("list", resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		if f.on.Load() {
			f.count.Add(1)
			return true, nil, errors.New("connection refused")
		}
		return false, nil, nil
	})
}

func TestNothingPublishedBeforeEndpointSlicesSync(t *testing.T) {
	h := newHarness(t, Config{}, testService("a"), testSlice("a-1", "a", "10.0.0.1"), testNode())
	var fail failingLists
	fail.on.Store(true)
	fail.install(h.client, "endpointslices")
	h.start()
	// The Service informer syncs at once; the slice list fails and is
	// retried with backoff. Two failures mean a retry happened.
	h.waitFor("two failed EndpointSlice lists", func() bool { return fail.count.Load() >= 2 })
	h.expectNone()
	if h.src.Synced() {
		t.Fatal("synced while EndpointSlices cannot be listed")
	}
	fail.on.Store(false)
	if got, want := describe(h.next()), "ns1/a:http=10.0.0.1"; got != want {
		t.Fatalf("model %q, want %q", got, want)
	}
}

func TestChangesArePublishedAndNoOpsAreNot(t *testing.T) {
	h := newHarness(t, Config{}, testService("a"), testSlice("a-1", "a", "10.0.0.1"), testNode())
	h.start()
	if got := describe(h.next()); got != "ns1/a:http=10.0.0.1" {
		t.Fatalf("initial model %q", got)
	}
	ctx := context.Background()
	slices := h.client.DiscoveryV1().EndpointSlices("ns1")
	services := h.client.CoreV1().Services("ns1")

	// An endpoint is added.
	if _, err := slices.Update(ctx, testSlice("a-1", "a", "10.0.0.1", "10.0.0.2"), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(h.next()), "ns1/a:http=10.0.0.1,10.0.0.2"; got != want {
		t.Fatalf("after slice update %q, want %q", got, want)
	}

	// A change to a field the model does not use is dropped by the
	// tracker: the pending count goes back to zero and nothing is
	// published, so the next model is the one for the real change below.
	before := testutil.ToFloat64(h.metrics.ServiceChangesTotal)
	if _, err := services.Update(ctx, testService("a", func(s *v1.Service) {
		s.Annotations = map[string]string{"owner": "team-x"}
	}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the service event", func() bool { return testutil.ToFloat64(h.metrics.ServiceChangesTotal) > before })
	if p := h.src.services.Pending(); p != 0 {
		t.Fatalf("%d services pending after a no-op update", p)
	}
	if _, err := services.Create(ctx, testService("b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(h.next()), "ns1/a:http=10.0.0.1,10.0.0.2 ns1/b:http="; got != want {
		t.Fatalf("after service create %q, want %q", got, want)
	}

	// Deletes.
	if err := services.Delete(ctx, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(h.next()), "ns1/b:http="; got != want {
		t.Fatalf("after service delete %q, want %q", got, want)
	}
	if err := slices.Delete(ctx, "a-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The slice's service is gone: the model looks the same, but the slice
	// leaves the builder, which the re-created service shows.
	if got, want := describe(h.next()), "ns1/b:http="; got != want {
		t.Fatalf("after slice delete %q, want %q", got, want)
	}
	if _, err := services.Create(ctx, testService("a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(h.next()), "ns1/a:http= ns1/b:http="; got != want {
		t.Fatalf("after re-create %q, want %q", got, want)
	}
	if n := testutil.ToFloat64(h.metrics.EndpointChangesTotal); n < 3 {
		t.Errorf("endpoint changes total %v, want >= 3", n)
	}
}

func TestNetworkProgrammingDuration(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := newHarness(t, Config{}, testService("a"), testSlice("a-1", "a", "10.0.0.1"))
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	h.src.cfg.Metrics = m
	h.start()
	h.next()
	// The controller changed the slice at t0+5s; we see it at t0+12s.
	h.clock.Step(12 * time.Second)
	es := testSlice("a-1", "a", "10.0.0.1", "10.0.0.2")
	es.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: t0.Add(5 * time.Second).Format(time.RFC3339Nano)}
	if _, err := h.client.DiscoveryV1().EndpointSlices("ns1").Update(context.Background(), es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kubeproxy_network_programming_duration_seconds" {
			hist := mf.GetMetric()[0].GetHistogram()
			if hist.GetSampleCount() != 1 || hist.GetSampleSum() != 7 {
				t.Fatalf("programming duration count %d sum %v, want 1 and 7", hist.GetSampleCount(), hist.GetSampleSum())
			}
			return
		}
	}
	t.Fatal("programming duration not recorded")
}

// outage makes the fake API server unreachable: lists and watches fail and
// the open watches are closed.
type outage struct {
	mu      sync.Mutex
	down    bool
	watches []watch.Interface
	lists   atomic.Int32 // lists refused while down
}

func (o *outage) install(c *fake.Clientset) {
	c.PrependReactor("list", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.down {
			o.lists.Add(1)
			return true, nil, errors.New("connection refused")
		}
		return false, nil, nil
	})
	c.PrependWatchReactor("*", func(a k8stesting.Action) (bool, watch.Interface, error) {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.down {
			return true, nil, errors.New("connection refused")
		}
		w, err := c.Tracker().Watch(a.GetResource(), a.GetNamespace())
		if err == nil {
			o.watches = append(o.watches, w)
		}
		return true, w, err
	})
}

func (o *outage) set(down bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.down = down
	if down {
		for _, w := range o.watches {
			w.Stop()
		}
		o.watches = nil
	}
}

func TestAPIServerOutageKeepsLastModel(t *testing.T) {
	h := newHarness(t, Config{}, testService("a"), testSlice("a-1", "a", "10.0.0.1"), testNode())
	var o outage
	o.install(h.client)
	h.start()
	if got := describe(h.next()); got != "ns1/a:http=10.0.0.1" {
		t.Fatalf("initial model %q", got)
	}

	o.set(true)
	// The informers notice the closed watches and try to list again; keep
	// it down until several lists have been refused.
	h.waitFor("refused relists", func() bool { return o.lists.Load() >= 3 })
	h.expectNone()

	o.set(false)
	// Back up: informers relist and re-watch. A change made now arrives,
	// and the model still holds everything from before the outage.
	h.waitFor("watches re-established", func() bool {
		o.mu.Lock()
		defer o.mu.Unlock()
		return len(o.watches) >= 3
	})
	if _, err := h.client.CoreV1().Services("ns1").Create(context.Background(), testService("b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := describe(h.next()), "ns1/a:http=10.0.0.1 ns1/b:http="; got != want {
		t.Fatalf("after outage %q, want %q", got, want)
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := NewForClient(fake.NewClientset(), Config{}, func(*service.Model) {}); !errors.Is(err, ErrNoNodeName) {
		t.Errorf("no node name: %v", err)
	}
	if _, err := New(Config{NodeName: "n", Kubeconfig: t.TempDir() + "/missing"}, func(*service.Model) {}); err == nil {
		t.Error("missing kubeconfig accepted")
	}
}
