package kubesource

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// timedWatch passes a watch's events on and records when the informer's
// reflector took the last modification: the moment the informer has the
// event in hand.
type timedWatch struct {
	watch.Interface
	out      chan watch.Event
	received *atomic.Int64
}

func (w *timedWatch) ResultChan() <-chan watch.Event { return w.out }

func (w *timedWatch) relay() {
	defer close(w.out)
	for ev := range w.Interface.ResultChan() {
		w.out <- ev // unbuffered: returns once the reflector has it
		if ev.Type == watch.Modified {
			w.received.Store(time.Now().UnixNano())
		}
	}
}

func scaleClusterIP(i int) string { return fmt.Sprintf("172.30.%d.%d", i/250, i%250+1) }

// scaleSlice is service i's EndpointSlice of ten endpoints on three nodes;
// notReady endpoints (from the last) report Ready false.
func scaleSlice(i, notReady int) *discovery.EndpointSlice {
	var addrs []string
	for j := range 10 {
		addrs = append(addrs, fmt.Sprintf("10.%d.%d.%d", i/250, i%250, j+1))
	}
	es := testSlice(fmt.Sprintf("svc-%05d-1", i), fmt.Sprintf("svc-%05d", i), addrs...)
	for j := range es.Endpoints {
		es.Endpoints[j].NodeName = ptr(fmt.Sprint("node-", j%3+1))
		es.Endpoints[j].Conditions.Ready = ptr(j < 10-notReady)
	}
	return es
}

func heapMB() float64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

// BenchmarkSliceToWorkers is the end-to-end target: 10,000
// Services of 10 endpoints each (100,000 endpoints) on a fake clientset,
// synced through the real informers; then, per iteration, ONE
// EndpointSlice is updated (a different service each time, one endpoint
// flipping readiness) and the time is taken until the workers' table
// holds the change. The publish callback is what the agent's is up to
// the workers: service.CompileFrom from the previous table, then
// Current.Store, the store the workers load.
//
// Metrics: p50-ms and p99-ms from the fake clientset's Update returning
// to the Store; informer-p50-ms and informer-p99-ms from the slice
// informer's reflector taking the event off the watch to the Store;
// compile-p50-ms and compile-p99-ms are CompileFrom and Store alone;
// first-publish-ms is the first sync's full Compile and Store; heap-MB is
// the live heap once synced (the fake clientset's objects, informer
// caches, converted objects, model and table together). ns/op includes
// the fake clientset's Update itself.
func BenchmarkSliceToWorkers(b *testing.B) {
	const services = 10_000
	objs := make([]k8sruntime.Object, 0, 2*services)
	for i := range services {
		objs = append(objs, testService(fmt.Sprintf("svc-%05d", i), func(svc *v1.Service) {
			svc.Spec.ClusterIP, svc.Spec.ClusterIPs = scaleClusterIP(i), []string{scaleClusterIP(i)}
		}), scaleSlice(i, 0))
	}
	client := fake.NewClientset(objs...)
	var received atomic.Int64
	client.PrependWatchReactor("endpointslices", func(action k8stesting.Action) (bool, watch.Interface, error) {
		w, err := client.Tracker().Watch(action.GetResource(), action.GetNamespace(), action.(k8stesting.WatchActionImpl).ListOptions)
		if err != nil {
			return false, nil, err
		}
		tw := &timedWatch{Interface: w, out: make(chan watch.Event), received: &received}
		go tw.relay()
		return true, tw, nil
	})

	opts := service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	var cur service.Current
	var prev *service.Table
	var mu sync.Mutex // guards firstPublish and compileTook
	var firstPublish time.Duration
	var compileTook []time.Duration
	stored := make(chan time.Time, 64)
	src, err := NewForClient(client, Config{
		NodeName:      "node-1",
		MinSyncPeriod: -1, // publish every change at once
		MaxSyncPeriod: time.Hour,
		ResyncPeriod:  -1,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, func(m *service.Model) error {
		start := time.Now()
		t := service.CompileFrom(prev, m, opts)
		cur.Store(t)
		now := time.Now()
		mu.Lock()
		if prev == nil {
			firstPublish = now.Sub(start)
		}
		compileTook = append(compileTook, now.Sub(start))
		mu.Unlock()
		prev = t
		stored <- now
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}()

	readyOf := func(i int) int {
		ip := packet.MustParseAddr(scaleClusterIP(i))
		f := cur.Load().Lookup(packet.ProtoTCP, ip, 80)
		if f == nil {
			return -1
		}
		return len(f.Backends(false))
	}
	// waitFor returns when the stored table gives service i n ready
	// backends, and the time it was stored.
	waitFor := func(i, n int) time.Time {
		for {
			select {
			case at := <-stored:
				if readyOf(i) == n {
					return at
				}
			case <-time.After(30 * time.Second):
				b.Fatalf("service %d: %d ready backends, want %d", i, readyOf(i), n)
			}
		}
	}
	waitFor(services-1, 10)
	if got := len(cur.Load().Ports()); got != services {
		b.Fatalf("%d ports", got)
	}
	heap := heapMB()

	slicesAPI := client.DiscoveryV1().EndpointSlices("ns1")
	var fromUpdate, fromInformer []time.Duration
	n := 0
	for b.Loop() {
		n++
		i := (n * 7919) % services
		notReady := n%2 + 1 // alternates 1 and 2, so every update changes something
		if _, err := slicesAPI.Update(ctx, scaleSlice(i, notReady), metav1.UpdateOptions{}); err != nil {
			b.Fatal(err)
		}
		updated := time.Now()
		at := waitFor(i, 10-notReady)
		fromUpdate = append(fromUpdate, at.Sub(updated))
		fromInformer = append(fromInformer, at.Sub(time.Unix(0, received.Load())))
	}
	b.ReportMetric(percentile(fromUpdate, 50), "p50-ms")
	b.ReportMetric(percentile(fromUpdate, 99), "p99-ms")
	b.ReportMetric(percentile(fromInformer, 50), "informer-p50-ms")
	b.ReportMetric(percentile(fromInformer, 99), "informer-p99-ms")
	mu.Lock()
	defer mu.Unlock()
	b.ReportMetric(percentile(compileTook[1:], 50), "compile-p50-ms")
	b.ReportMetric(percentile(compileTook[1:], 99), "compile-p99-ms")
	b.ReportMetric(float64(firstPublish)/1e6, "first-publish-ms")
	b.ReportMetric(heap, "heap-MB")
}

func percentile(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[(len(s)-1)*p/100]) / 1e6
}
