package filesource

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

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
}

func newFileHarness(t *testing.T, content string) *fileHarness {
	h := &fileHarness{t: t, path: filepath.Join(t.TempDir(), "services.yaml"), logs: &syncBuffer{}}
	if content != "" {
		h.write(content)
	}
	var err error
	h.src, err = New(Config{
		Path:   h.path,
		Node:   service.Node{Name: "node-1", Addresses: []packet.Addr{packet.MustParseAddr("198.18.0.1")}},
		Logger: slog.New(slog.NewTextHandler(h.logs, nil)),
	}, func(m *service.Model) { h.models = append(h.models, m) })
	if err != nil {
		t.Fatal(err)
	}
	return h
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
	src, err := New(Config{Path: path, PollInterval: 5 * time.Millisecond}, func(m *service.Model) { models <- m })
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
