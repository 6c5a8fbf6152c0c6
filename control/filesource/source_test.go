package filesource

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/control/runner"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
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

type fileHarness struct {
	t      *testing.T
	path   string
	src    *Source
	models []*service.Model
	logs   *syncBuffer

	failNext int              // publishes to refuse
	refused  []*service.Model // what was refused
	rec      *healthRecorder  // when Config.Health is one, also hears of publishes
}

func newFileHarness(t *testing.T, content string) *fileHarness {
	return newFileHarnessWith(t, content, nil)
}

// newFileHarnessWith is newFileHarness with tweak applied to the Config.
func newFileHarnessWith(t *testing.T, content string, tweak func(*Config)) *fileHarness {
	h := &fileHarness{t: t, path: filepath.Join(t.TempDir(), "services.yaml"), logs: &syncBuffer{}}
	if content != "" {
		h.write(content)
	}
	cfg := Config{
		Path:   h.path,
		Node:   service.Node{Name: "node-1", Addresses: []packet.Addr{packet.MustParseAddr("198.18.0.1")}},
		Logger: slog.New(slog.NewTextHandler(h.logs, nil)),
	}
	if tweak != nil {
		tweak(&cfg)
	}
	h.rec, _ = cfg.Health.(*healthRecorder)
	var err error
	h.src, err = New(cfg, h.publish)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

var errRefused = errors.New("dataplane refused the table")

func (h *fileHarness) publish(m *service.Model) error {
	if h.failNext > 0 {
		h.failNext--
		h.refused = append(h.refused, m)
		if h.rec != nil {
			h.rec.record("publish failed")
		}
		return errRefused
	}
	h.models = append(h.models, m)
	if h.rec != nil {
		h.rec.record("publish")
	}
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

func (r *healthRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// take returns the calls so far and forgets them.
func (r *healthRecorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

func (h *fileHarness) write(content string) {
	h.t.Helper()
	if err := os.WriteFile(h.path, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

// renameOver writes content to a new file and renames it over the old one,
// as vim and most deploy tools do.
func (h *fileHarness) renameOver(content string) {
	h.t.Helper()
	tmp := h.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
	if err := os.Rename(tmp, h.path); err != nil {
		h.t.Fatal(err)
	}
}

// pollTwice checks the file over two intervals, the time a change needs to
// settle.
func (h *fileHarness) pollTwice() {
	h.src.poll()
	h.src.poll()
}

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

func (h *fileHarness) expectModels(n int, last string) {
	h.t.Helper()
	if len(h.models) != n {
		h.t.Fatalf("%d models published, want %d; logs:\n%s", len(h.models), n, h.logs)
	}
	if n > 0 {
		if got := describe(h.models[n-1]); got != last {
			h.t.Fatalf("model %q, want %q", got, last)
		}
	}
}

const serviceB = `apiVersion: v1
kind: Service
metadata: {name: b, namespace: web}
spec:
  clusterIP: 172.30.0.11
  ports: [{name: dns, port: 53, protocol: UDP}]
`

func TestLoadAndReload(t *testing.T) {
	h := newFileHarness(t, serviceA+"---\n"+sliceA)
	h.src.poll() // the first load does not wait
	h.expectModels(1, "web/a:http=10.0.0.1,10.0.0.2")
	if m := h.models[0]; m.Node.Name != "node-1" || len(m.Node.Addresses) != 1 {
		t.Fatalf("node %+v", m.Node)
	}

	h.pollTwice()
	h.expectModels(1, "web/a:http=10.0.0.1,10.0.0.2") // unchanged file, nothing new

	// Changed in place: seen on the first poll, loaded once settled.
	h.write(serviceA + "---\n" + sliceA + "---\n" + serviceB)
	h.src.poll()
	h.expectModels(1, "web/a:http=10.0.0.1,10.0.0.2")
	h.src.poll()
	h.expectModels(2, "web/a:http=10.0.0.1,10.0.0.2 web/b:dns=")

	// Renamed over.
	h.renameOver(serviceB)
	h.pollTwice()
	h.expectModels(3, "web/b:dns=")

	// Touched: new times, same content, no new model.
	future := time.Now().Add(time.Hour)
	if err := os.Chtimes(h.path, future, future); err != nil {
		t.Fatal(err)
	}
	h.pollTwice()
	h.expectModels(3, "web/b:dns=")
}

func TestInvalidDocumentIsSkippedAndReported(t *testing.T) {
	h := newFileHarness(t, serviceA+"---\napiVersion: v1\nkind: Service\nmetadata: {name: noip}\nspec: {ports: [{port: 1}]}\n---\n"+
		sliceA+"---\n"+strings.Replace(serviceB, "172.30.0.11", "172.30.0.300", 1))
	h.src.poll()
	h.expectModels(1, "web/a:http=10.0.0.1,10.0.0.2")
	logs := h.logs.String()
	for _, want := range []string{
		"document=2", "line=13", "spec.clusterIP is required", // the file's own check
		"Service skipped", "object=web/b", `malformed IP \"172.30.0.300\"`, // the converter's
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %q:\n%s", want, logs)
		}
	}
}

func TestReadErrorsKeepTheModel(t *testing.T) {
	h := newFileHarness(t, serviceA)
	h.src.poll()
	h.expectModels(1, "web/a:http=")

	// The file disappears (a deploy tool deleting before writing).
	if err := os.Remove(h.path); err != nil {
		t.Fatal(err)
	}
	h.pollTwice()
	h.pollTwice()
	h.expectModels(1, "web/a:http=")
	if n := strings.Count(h.logs.String(), "cannot read the services file"); n != 1 {
		t.Errorf("read error logged %d times, want once", n)
	}

	// A file in which nothing is usable does not wipe the services.
	h.write("apiVersion: v1\nkind: Service\nmetadata: [broken\n")
	h.pollTwice()
	h.expectModels(1, "web/a:http=")
	if !strings.Contains(h.logs.String(), "no usable document") {
		t.Errorf("logs:\n%s", h.logs)
	}

	// Fixed.
	h.write(serviceB)
	h.pollTwice()
	h.expectModels(2, "web/b:dns=")

	// An empty file is a deliberate empty model (once it has settled).
	h.write("")
	h.src.poll()
	h.expectModels(2, "web/b:dns=")
	h.src.poll()
	h.expectModels(3, "")
}

func TestMissingAtStartIsWaitedFor(t *testing.T) {
	h := newFileHarness(t, "")
	h.src.poll()
	h.expectModels(0, "")
	// Broken at start: reported once, not on every poll.
	h.write("kind: [\n")
	h.pollTwice()
	h.pollTwice()
	h.expectModels(0, "")
	if n := strings.Count(h.logs.String(), "no usable document"); n != 1 {
		t.Fatalf("broken file reported %d times, want once:\n%s", n, h.logs)
	}
	h.write(serviceA)
	h.src.poll() // nothing published yet, so no need to wait
	h.expectModels(1, "web/a:http=")
}

func TestRunPolls(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "services.yaml")
	if err := os.WriteFile(path, []byte(serviceA), 0o644); err != nil {
		t.Fatal(err)
	}
	models := make(chan *service.Model, 10)
	src, err := New(Config{Path: path, PollInterval: 5 * time.Millisecond}, func(m *service.Model) error { models <- m; return nil })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- src.Run(ctx) }()
	next := func() string {
		select {
		case m := <-models:
			return describe(m)
		case <-time.After(10 * time.Second):
			t.Fatal("no model")
			return ""
		}
	}
	if got := next(); got != "web/a:http=" {
		t.Fatalf("first model %q", got)
	}
	if err := os.WriteFile(path+".new", []byte(serviceB), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
	if got := next(); got != "web/b:dns=" {
		t.Fatalf("after rename %q", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{}, nil); err != ErrNoPath {
		t.Fatalf("empty path: %v", err)
	}
}

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestFailedPublishIsRetriedWithBackoff: the first load is refused twice.
// A file changed while backing off replaces the pending Model without a
// try of its own; the retries come 1 s and then 2 s after the failures, and
// what is published is the latest file. The sync metrics move only on the
// success, failures are counted, the pending gauge is 1 in between; the
// Health calls follow kube-proxy (no QueuedUpdate for the first load,
// Updated only after a success); the log has one failure line and one
// recovery line.
func TestFailedPublishIsRetriedWithBackoff(t *testing.T) {
	clock := runner.NewFakeClock(t0)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	rec := &healthRecorder{}
	h := newFileHarnessWith(t, serviceA, func(c *Config) { c.Clock, c.Metrics, c.Health = clock, m, rec })
	h.failNext = 2
	check := func(what string, failures, pending, last float64, syncs uint64) {
		t.Helper()
		if got := testutil.ToFloat64(m.PublishFailures); got != failures {
			t.Errorf("%s: publish failures %v, want %v", what, got, failures)
		}
		if got := testutil.ToFloat64(m.PublishPending); got != pending {
			t.Errorf("%s: publish pending %v, want %v", what, got, pending)
		}
		if got := testutil.ToFloat64(m.LastSyncTimestamp); got != last {
			t.Errorf("%s: last sync timestamp %v, want %v", what, got, last)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "kubeproxy_sync_proxy_rules_duration_seconds" {
				if n := mf.GetMetric()[0].GetHistogram().GetSampleCount(); n != syncs {
					t.Errorf("%s: %d syncs observed, want %d", what, n, syncs)
				}
			}
		}
	}

	h.src.poll()
	if len(h.refused) != 1 || describe(h.refused[0]) != "web/a:http=" {
		t.Fatalf("first try: refused %d models", len(h.refused))
	}
	h.expectModels(0, "")
	check("after the first failure", 1, 1, 0, 0)

	// Changed while backing off: no try before the retry is due.
	h.write(serviceA + "---\n" + serviceB)
	h.pollTwice()
	h.src.retryPublish()
	if len(h.refused) != 1 {
		t.Fatal("a changed file was tried before the retry was due")
	}
	clock.Step(999 * time.Millisecond)
	h.src.retryPublish()
	if len(h.refused) != 1 {
		t.Fatal("retried before 1s")
	}
	clock.Step(time.Millisecond)
	h.src.retryPublish()
	if len(h.refused) != 2 || describe(h.refused[1]) != "web/a:http= web/b:dns=" {
		t.Fatalf("retry at 1s: %d refused, want 2, the second with the change", len(h.refused))
	}
	check("after the second failure", 2, 1, 0, 0)

	// The next retry waits 2s.
	clock.Step(time.Second)
	h.src.retryPublish()
	h.pollTwice() // polls do not publish it early either
	h.expectModels(0, "")
	clock.Step(time.Second)
	h.src.retryPublish()
	h.expectModels(1, "web/a:http= web/b:dns=")
	check("after the success", 2, 0, float64(t0.Add(3*time.Second).Unix()), 1)
	if got, want := rec.take(), []string{"publish failed", "QueuedUpdate", "publish failed", "publish", "Updated"}; !slices.Equal(got, want) {
		t.Errorf("calls\n got %q\nwant %q", got, want)
	}

	// Back to normal: a change is published as soon as it has settled.
	h.write(serviceB)
	h.pollTwice()
	h.expectModels(2, "web/b:dns=")
	if got, want := rec.take(), []string{"QueuedUpdate", "publish", "Updated"}; !slices.Equal(got, want) {
		t.Errorf("calls\n got %q\nwant %q", got, want)
	}
	logs := h.logs.String()
	if n := strings.Count(logs, "publishing the service model failed"); n != 1 {
		t.Errorf("failure logged %d times, want once:\n%s", n, logs)
	}
	if !strings.Contains(logs, "publishing recovered after 2 failures") {
		t.Errorf("no recovery line:\n%s", logs)
	}
}

// TestRunRetriesOnItsTimer: in Run, the retry of a refused Model comes on
// its own timer, 1 s after the failure, not on the next poll.
func TestRunRetriesOnItsTimer(t *testing.T) {
	clock := runner.NewFakeClock(t0)
	dir := t.TempDir()
	path := filepath.Join(dir, "services.yaml")
	if err := os.WriteFile(path, []byte(serviceA), 0o644); err != nil {
		t.Fatal(err)
	}
	rec := &healthRecorder{}
	tries := make(chan time.Time, 10)
	var fails atomic.Int32
	fails.Store(1)
	src, err := New(Config{Path: path, PollInterval: time.Minute, Clock: clock, Health: rec},
		func(*service.Model) error {
			tries <- clock.Now()
			if fails.Add(-1) >= 0 {
				return errRefused
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- src.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	next := func() time.Time {
		t.Helper()
		select {
		case at := <-tries:
			return at
		case <-time.After(10 * time.Second):
			t.Fatal("no try")
			return time.Time{}
		}
	}
	if at := next(); !at.Equal(t0) {
		t.Fatalf("first try at %v", at.Sub(t0))
	}
	poll := func(cond func() bool) error {
		return wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true,
			func(context.Context) (bool, error) { return cond(), nil })
	}
	if poll(func() bool { return slices.ContainsFunc(clock.Deadlines(), t0.Add(time.Second).Equal) }) != nil {
		t.Fatalf("retry timer not armed; armed: %v", clock.Deadlines())
	}
	clock.Step(time.Second)
	if at := next(); !at.Equal(t0.Add(time.Second)) {
		t.Fatalf("retry at %v, want 1s", at.Sub(t0))
	}
	if poll(func() bool { return rec.count() >= 2 }) != nil {
		t.Fatalf("calls %q", rec.take())
	}
	if got, want := rec.take(), []string{"Updated", "Updated"}; !slices.Equal(got, want) {
		t.Errorf("Health calls %q, want %q (Run starts; the retry succeeds)", got, want)
	}
}
