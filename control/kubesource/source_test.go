package kubesource

import (
	"context"
	"errors"
	"fmt"
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
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/xdproxy/xdproxy/control/health"
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
	reg     *prometheus.Registry
	models  chan *service.Model
	cancel  context.CancelFunc

	// failNext publishes are refused; each refused Model goes to refused.
	failNext atomic.Int32
	refused  chan *service.Model
	// rec, when cfg.Health is one, also hears of each publish.
	rec *healthRecorder
}

var errRefused = errors.New("dataplane refused the table")

// publish is the harness's publish callback.
func (h *harness) publish(m *service.Model) error {
	if h.failNext.Add(-1) >= 0 {
		if h.rec != nil {
			h.rec.record("publish failed")
		}
		h.refused <- m
		return errRefused
	}
	h.failNext.Store(0)
	if h.rec != nil {
		h.rec.record("publish")
	}
	h.models <- m
	return nil
}

// healthRecorder is a Health that records the calls, in order.
type healthRecorder struct {
	mu    sync.Mutex
	calls []string
}

func (r *healthRecorder) record(call string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, call)
}

func (r *healthRecorder) QueuedUpdate() { r.record("QueuedUpdate") }
func (r *healthRecorder) Updated()      { r.record("Updated") }

func (r *healthRecorder) get() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// newHarness makes a Source on a fake clientset holding objs. The runner
// has no minimum interval, so every change is published as soon as it is
// seen; the clock moves only when a test steps it.
func newHarness(t *testing.T, cfg Config, objs ...runtime.Object) *harness {
	t.Helper()
	h := &harness{
		t:       t,
		client:  fake.NewClientset(objs...),
		clock:   runner.NewFakeClock(t0),
		models:  make(chan *service.Model, 100),
		refused: make(chan *service.Model, 100),
	}
	h.rec, _ = cfg.Health.(*healthRecorder)
	h.reg = prometheus.NewRegistry()
	m, err := metrics.New(h.reg)
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
	h.src, err = NewForClient(h.client, cfg, h.publish)
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
	case m := <-h.refused:
		h.t.Fatalf("unexpected (refused) publish: %s", describe(m))
	default:
	}
}

// nextRefused waits for the next refused publish.
func (h *harness) nextRefused() *service.Model {
	h.t.Helper()
	select {
	case m := <-h.refused:
		return m
	case m := <-h.models:
		h.t.Fatalf("published %q, want a refused publish", describe(m))
	case <-time.After(10 * time.Second):
		h.t.Fatal("no publish tried")
	}
	return nil
}

// waitArmed waits until the runner has armed its timer for deadline: from
// then on it sleeps until an event or a Step.
func (h *harness) waitArmed(deadline time.Time) {
	h.t.Helper()
	h.waitFor(fmt.Sprintf("the runner's timer armed for t0+%v (armed: %v)", deadline.Sub(t0), h.clock.Deadlines()),
		func() bool { return slices.ContainsFunc(h.clock.Deadlines(), deadline.Equal) })
}

// waitFor polls cond: informer events arrive on goroutines of their own.
func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil }); err != nil {
		h.t.Fatalf("timed out waiting for %s", what)
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
	// The duration is observed once publish has returned, which may be
	// after h.next has the model.
	var count uint64
	var sum float64
	h.waitFor("the programming duration to be observed", func() bool {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "kubeproxy_network_programming_duration_seconds" {
				hist := mf.GetMetric()[0].GetHistogram()
				count, sum = hist.GetSampleCount(), hist.GetSampleSum()
			}
		}
		return count > 0
	})
	if count != 1 || sum != 7 {
		t.Fatalf("programming duration count %d sum %v, want 1 and 7", count, sum)
	}
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
	publish := func(*service.Model) error { return nil }
	if _, err := NewForClient(fake.NewClientset(), Config{}, publish); !errors.Is(err, ErrNoNodeName) {
		t.Errorf("no node name: %v", err)
	}
	if _, err := New(Config{NodeName: "n", Kubeconfig: t.TempDir() + "/missing"}, publish); err == nil {
		t.Error("missing kubeconfig accepted")
	}
}

// TestFailedPublishIsRetriedWithBackoff: a publish that fails twice is
// retried after 1 s and then 2 s; a change made meanwhile is not published
// on its own but joins the retry, so what is finally published is the
// latest Model; the sync metrics move only on the success, the failures
// are counted, the pending gauge is 1 in between, and the log says it
// failed once and recovered once.
func TestFailedPublishIsRetriedWithBackoff(t *testing.T) {
	logs := &syncBuffer{}
	h := newHarness(t, Config{Logger: slog.New(slog.NewTextHandler(logs, nil))},
		testService("a"), testSlice("a-1", "a", "10.0.0.1"), testNode())
	h.failNext.Store(2)
	h.start()

	if got := describe(h.nextRefused()); got != "ns1/a:http=10.0.0.1" {
		t.Fatalf("first try %q", got)
	}
	checkMetrics := func(what string, failures, pending, last float64, syncs int) {
		t.Helper()
		m := h.metrics
		if got := testutil.ToFloat64(m.PublishFailures); got != failures {
			t.Errorf("%s: publish failures %v, want %v", what, got, failures)
		}
		if got := testutil.ToFloat64(m.PublishPending); got != pending {
			t.Errorf("%s: publish pending %v, want %v", what, got, pending)
		}
		if got := testutil.ToFloat64(m.LastSyncTimestamp); got != last {
			t.Errorf("%s: last sync timestamp %v, want %v", what, got, last)
		}
		if got, _ := h.histogram("kubeproxy_sync_proxy_rules_duration_seconds"); got != syncs {
			t.Errorf("%s: %d syncs observed, want %d", what, got, syncs)
		}
	}
	// Once the retry is armed, the failed sync has returned.
	h.waitArmed(t0.Add(time.Second))
	checkMetrics("after the first failure", 1, 1, 0, 0)

	// While backing off, a service is added and a slice changes (its
	// controller stamps the change at t0+400ms): nothing is tried before
	// the retry is due.
	h.clock.Step(500 * time.Millisecond)
	ctx := context.Background()
	if _, err := h.client.CoreV1().Services("ns1").Create(ctx, testService("b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	es := testSlice("a-1", "a", "10.0.0.1", "10.0.0.2")
	es.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: t0.Add(400 * time.Millisecond).Format(time.RFC3339Nano)}
	if _, err := h.client.DiscoveryV1().EndpointSlices("ns1").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("both changes pending", func() bool { return h.src.services.Pending() == 1 && h.src.slices.Pending() == 1 })
	h.waitArmed(t0.Add(time.Second))
	h.expectNone()

	// The retry at t0+1s carries both changes, and fails.
	h.clock.Step(500 * time.Millisecond)
	if got, want := describe(h.nextRefused()), "ns1/a:http=10.0.0.1,10.0.0.2 ns1/b:http="; got != want {
		t.Fatalf("retry at 1s %q, want %q", got, want)
	}
	// The next one waits 2s: nothing at t0+2s, success at t0+3s.
	h.waitArmed(t0.Add(3 * time.Second))
	checkMetrics("after the second failure", 2, 1, 0, 0)
	h.clock.Step(time.Second)
	h.waitArmed(t0.Add(3 * time.Second))
	h.expectNone()
	h.clock.Step(time.Second)
	if got, want := describe(h.next()), "ns1/a:http=10.0.0.1,10.0.0.2 ns1/b:http="; got != want {
		t.Fatalf("published %q, want %q", got, want)
	}
	h.waitFor("the sync to be recorded", func() bool { return testutil.ToFloat64(h.metrics.PublishPending) == 0 })
	checkMetrics("after the success", 2, 0, float64(t0.Add(3*time.Second).Unix()), 1)
	// The change stamped at t0+400ms reached the dataplane at t0+3s.
	if _, got := h.histogram("kubeproxy_network_programming_duration_seconds"); got != 2.6 {
		t.Errorf("network programming duration %v, want 2.6", got)
	}

	// Back to normal: the next change is published at once.
	if err := h.client.CoreV1().Services("ns1").Delete(ctx, "b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := describe(h.next()); got != "ns1/a:http=10.0.0.1,10.0.0.2" {
		t.Fatalf("after delete %q", got)
	}
	out := logs.String()
	if n := strings.Count(out, "publishing the service model failed"); n != 1 {
		t.Errorf("failure logged %d times, want once (first failure; the next within 30s is quiet):\n%s", n, out)
	}
	if !strings.Contains(out, "publishing recovered after 2 failures") {
		t.Errorf("no recovery line:\n%s", out)
	}
}

// TestHealthCalls: the Health hooks are called in kube-proxy's order:
// Updated when the loop starts, Updated after each successful publish
// (never after a failed one), QueuedUpdate for every event that leaves a
// change pending once the initial lists are in, and not for an event that
// changes nothing or a Node change that the model does not see.
func TestHealthCalls(t *testing.T) {
	rec := &healthRecorder{}
	h := newHarness(t, Config{Health: rec}, testService("a"), testSlice("a-1", "a", "10.0.0.1"), testNode())
	h.start()
	h.next()
	h.waitFor("Updated after the first publish", func() bool { return len(rec.get()) == 3 })
	if got, want := rec.get(), []string{"Updated", "publish", "Updated"}; !slices.Equal(got, want) {
		t.Fatalf("start: %q, want %q", got, want)
	}

	ctx := context.Background()
	if _, err := h.client.CoreV1().Services("ns1").Create(ctx, testService("b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.next()
	h.waitFor("Updated after the second publish", func() bool { return len(rec.get()) == 6 })
	// A failed publish is retried; only the success says Updated.
	h.failNext.Store(1)
	if _, err := h.client.DiscoveryV1().EndpointSlices("ns1").Update(ctx, testSlice("a-1", "a", "10.0.0.2"), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.nextRefused()
	h.waitArmed(t0.Add(time.Second))
	h.clock.Step(time.Second)
	h.next()
	h.waitFor("Updated after the retry", func() bool { return len(rec.get()) == 10 })

	// Neither an update that changes nothing the model uses nor a taint
	// on the Node queues anything.
	before := testutil.ToFloat64(h.metrics.ServiceChangesTotal)
	if _, err := h.client.CoreV1().Services("ns1").Update(ctx, testService("b", func(s *v1.Service) {
		s.Annotations = map[string]string{"owner": "team-x"}
	}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the no-op service event", func() bool { return testutil.ToFloat64(h.metrics.ServiceChangesTotal) > before })
	n := testNode()
	n.Spec.Taints = []v1.Taint{{Key: ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule}}
	if _, err := h.client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	h.waitFor("the taint", func() bool { return h.src.NodeState().Deleting })
	h.expectNone()

	want := []string{
		"Updated", "publish", "Updated", // Run starts; the initial lists are published
		"QueuedUpdate", "publish", "Updated", // Service b created
		"QueuedUpdate", "publish failed", "publish", "Updated", // slice updated; the first try fails
	}
	if got := rec.get(); !slices.Equal(got, want) {
		t.Fatalf("calls\n got %q\nwant %q", got, want)
	}
}

// TestNodeState follows this node's Node object through the fake API:
// unknown, created, tainted by the cluster autoscaler, untainted, given a
// deletion timestamp, deleted. Other nodes do not count, and none of it
// publishes a model (the Node's zone and addresses do not change).
func TestNodeState(t *testing.T) {
	h := newHarness(t, Config{})
	h.start()
	h.next()
	if got := h.src.NodeState(); got != (health.NodeState{}) {
		t.Fatalf("before the Node exists: %+v", got)
	}
	ctx := context.Background()
	nodes := h.client.CoreV1().Nodes()
	step := func(what string, change func() error, want health.NodeState) {
		t.Helper()
		if err := change(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		h.waitFor(fmt.Sprintf("%s: NodeState %+v (now %+v)", what, want, h.src.NodeState()),
			func() bool { return h.src.NodeState() == want })
	}
	update := func(tweak func(*v1.Node)) func() error {
		return func() error {
			n, err := nodes.Get(ctx, "node-1", metav1.GetOptions{})
			if err != nil {
				return err
			}
			tweak(n)
			_, err = nodes.Update(ctx, n, metav1.UpdateOptions{})
			return err
		}
	}
	other := testNode()
	other.Name = "node-2"
	other.Spec.Taints = []v1.Taint{{Key: ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule}}
	step("another node, tainted", func() error { _, err := nodes.Create(ctx, other, metav1.CreateOptions{}); return err },
		health.NodeState{})
	step("created", func() error { _, err := nodes.Create(ctx, testNode(), metav1.CreateOptions{}); return err },
		health.NodeState{Known: true})
	// The Node's addresses and zone reach the model; nothing else below does.
	if m := h.next(); m.Node.Zone != "zone-a" {
		t.Fatalf("zone %q", m.Node.Zone)
	}
	step("tainted ToBeDeletedByClusterAutoscaler", update(func(n *v1.Node) {
		n.Spec.Taints = []v1.Taint{{Key: "other", Effect: v1.TaintEffectNoSchedule}, {Key: ToBeDeletedTaint, Value: "1700000000", Effect: v1.TaintEffectNoSchedule}}
	}), health.NodeState{Known: true, Deleting: true})
	step("untainted", update(func(n *v1.Node) { n.Spec.Taints = n.Spec.Taints[:1] }), health.NodeState{Known: true})
	step("deletion timestamp", update(func(n *v1.Node) {
		now := metav1.NewTime(t0)
		n.DeletionTimestamp = &now
	}), health.NodeState{Known: true, Deleting: true})
	step("deleted", func() error { return nodes.Delete(ctx, "node-1", metav1.DeleteOptions{}) }, health.NodeState{})
	// Deleting the Node forgets its zone: that is a model change.
	if m := h.next(); m.Node.Zone != "" {
		t.Fatalf("zone %q after delete", m.Node.Zone)
	}
	h.expectNone()
}

// histogram returns the sample count and sum of the histogram name.
func (h *harness) histogram(name string) (int, float64) {
	h.t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			hist := mf.GetMetric()[0].GetHistogram()
			return int(hist.GetSampleCount()), hist.GetSampleSum()
		}
	}
	h.t.Fatalf("%s not gathered", name)
	return 0, 0
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestQueuedUpdateRules calls the handlers directly to pin kube-proxy's
// rules for QueuedUpdate: nothing before the initial lists are in; a
// Service event queues while any Service change is pending, even if the
// event itself changed nothing (ServiceChangeTracker.Update returns
// len(items) > 0); an EndpointSlice event queues only if it changed its
// slice (EndpointSliceUpdate's answer); a sync that publishes says Updated.
func TestQueuedUpdateRules(t *testing.T) {
	rec := &healthRecorder{}
	s, err := NewForClient(fake.NewClientset(), Config{NodeName: "node-1", Health: rec,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		func(*service.Model) error { rec.record("publish"); return nil })
	if err != nil {
		t.Fatal(err)
	}
	annotated := func(svc *v1.Service) { svc.Annotations = map[string]string{"owner": "team-x"} }
	a, a2 := testService("a"), testService("a", annotated)
	b := testService("b")
	sl := testSlice("a-1", "a", "10.0.0.1")
	sl2 := sl.DeepCopy()
	sl2.Annotations = map[string]string{"owner": "team-x"}

	s.onService(nil, b) // the initial list: not queued
	s.synced.Store(true)
	s.sync() // the initial sync
	steps := []struct {
		what  string
		event func()
		want  []string
	}{
		{"service added", func() { s.onService(nil, a) }, []string{"QueuedUpdate"}},
		{"no-op service update while a is pending", func() { s.onService(a, a2) }, []string{"QueuedUpdate"}},
		{"slice added", func() { s.onSlice(nil, sl) }, []string{"QueuedUpdate"}},
		{"no-op slice update while changes are pending", func() { s.onSlice(sl, sl2) }, nil},
		{"sync", s.sync, []string{"publish", "Updated"}},
		{"no-op service update, nothing pending", func() { s.onService(a2, testService("a")) }, nil},
		{"no-op slice update, nothing pending", func() { s.onSlice(sl2, sl) }, nil},
		{"sync with nothing to do", s.sync, nil},
		{"service deleted", func() { s.onService(b, nil) }, []string{"QueuedUpdate"}},
	}
	if got, want := rec.get(), []string{"publish", "Updated"}; !slices.Equal(got, want) {
		t.Fatalf("initial: %q, want %q", got, want)
	}
	for _, st := range steps {
		before := len(rec.get())
		st.event()
		if got := rec.get()[before:]; !slices.Equal(got, st.want) {
			t.Errorf("%s: %q, want %q", st.what, got, st.want)
		}
	}
}
