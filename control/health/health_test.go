package health

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

func get(t *testing.T, h http.Handler, path string) (int, Status) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
	var s Status
	if err := json.Unmarshal(rec.Body.Bytes(), &s); err != nil {
		t.Fatalf("%s: %v: %s", path, err, rec.Body)
	}
	return rec.Code, s
}

// TestProxyFollowsKubeProxy walks kube-proxy's rules: healthy while
// starting and while synced, still healthy while a queued update is
// younger than the timeout, unhealthy after, healthy again once applied;
// node eligibility only for /healthz; checks for each endpoint.
func TestProxyFollowsKubeProxy(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
	node := NodeState{Known: true}
	var iface, worker error
	p := NewProxy(ProxyOptions{
		Timeout: time.Minute, Clock: clk,
		Node:  func() NodeState { return node },
		Ready: []Check{{"interfaces", func() error { return iface }}},
		Live:  []Check{{"workers", func() error { return worker }}},
	})
	h := p.Handler()
	steps := []struct {
		name           string
		do             func()
		healthz, livez int
	}{
		{"starting", func() {}, 200, 200},
		{"update queued", p.QueuedUpdate, 200, 200},
		{"59s later", func() { clk.Step(59 * time.Second) }, 200, 200},
		{"another queued (the oldest counts)", p.QueuedUpdate, 200, 200},
		{"60s after the first", func() { clk.Step(time.Second) }, 503, 503},
		{"applied", p.Updated, 200, 200},
		{"node being deleted", func() { node.Deleting = true }, 503, 200},
		{"node fine", func() { node.Deleting = false }, 200, 200},
		{"node unknown", func() { node.Known = false }, 503, 200},
		{"node known", func() { node.Known = true }, 200, 200},
		{"interface not served", func() { iface = errors.New("eth0: queue 3 not served") }, 503, 200},
		{"interface back", func() { iface = nil }, 200, 200},
		{"worker stuck", func() { worker = errors.New("eth0 queue 0: no progress for 10s") }, 200, 503},
	}
	for _, s := range steps {
		s.do()
		if code, st := get(t, h, "/healthz"); code != s.healthz || st.Healthy != (code == 200) || st.NodeEligible == nil {
			t.Errorf("%s: /healthz %d %+v, want %d", s.name, code, st, s.healthz)
		}
		if code, _ := get(t, h, "/livez"); code != s.livez {
			t.Errorf("%s: /livez %d, want %d", s.name, code, s.livez)
		}
	}
	_, st := get(t, h, "/healthz")
	if len(st.Problems) != 0 {
		t.Errorf("problems %v while only /livez is failing", st.Problems)
	}
	_, st = get(t, h, "/livez")
	if len(st.Problems) != 1 || st.Problems[0] != "workers: eth0 queue 0: no progress for 10s" {
		t.Errorf("/livez problems %v", st.Problems)
	}
}

func TestServicesAnswerPerService(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
	p := NewProxy(ProxyOptions{Timeout: time.Minute, Clock: clk})
	s := NewServices(p, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil)
	defer s.Close()
	free := func() uint16 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return uint16(ln.Addr().(*net.TCPAddr).Port)
	}
	web, db := ServiceName{"default", "web"}, ServiceName{"prod", "db"}
	pw, pd := free(), free()
	if err := s.Sync(map[ServiceName]uint16{web: pw, db: pd}, map[ServiceName]int{web: 2}); err != nil {
		t.Fatal(err)
	}
	ask := func(port uint16) (int, serviceHealth) {
		t.Helper()
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var h serviceHealth
		if err := json.Unmarshal(b, &h); err != nil {
			t.Fatalf("%v: %s", err, b)
		}
		if resp.Header.Get("X-Load-Balancing-Endpoint-Weight") != fmt.Sprint(h.LocalEndpoints) {
			t.Errorf("weight header %q, body %d", resp.Header.Get("X-Load-Balancing-Endpoint-Weight"), h.LocalEndpoints)
		}
		return resp.StatusCode, h
	}
	if code, h := ask(pw); code != 200 || h.LocalEndpoints != 2 || !h.ServiceProxyHealthy || h.Service.Name != "web" {
		t.Errorf("web: %d %+v", code, h)
	}
	if code, h := ask(pd); code != 503 || h.LocalEndpoints != 0 || h.Service.Namespace != "prod" {
		t.Errorf("db without local endpoints: %d %+v", code, h)
	}
	// Scale: db gets one local endpoint, web none.
	if err := s.Sync(map[ServiceName]uint16{web: pw, db: pd}, map[ServiceName]int{db: 1}); err != nil {
		t.Fatal(err)
	}
	if code, _ := ask(pw); code != 503 {
		t.Errorf("web after scaling down: %d", code)
	}
	if code, _ := ask(pd); code != 200 {
		t.Errorf("db after scaling up: %d", code)
	}
	// A proxy that is behind answers 503 even with endpoints.
	p.QueuedUpdate()
	clk.Step(2 * time.Minute)
	if code, h := ask(pd); code != 503 || h.ServiceProxyHealthy {
		t.Errorf("db while the proxy is stale: %d %+v", code, h)
	}
	p.Updated()
	// web's port goes away.
	if err := s.Sync(map[ServiceName]uint16{db: pd}, map[ServiceName]int{db: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", pw)); err == nil {
		t.Error("web's health check port still answers after its service went")
	}
	// A port that cannot be opened is an error, counted, and retried.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bp := uint16(busy.Addr().(*net.TCPAddr).Port)
	if err := s.Sync(map[ServiceName]uint16{db: pd, web: bp}, nil); err == nil || s.Failures() != 1 {
		t.Errorf("busy port: %v, %d failures", err, s.Failures())
	}
	busy.Close()
	if err := s.Sync(map[ServiceName]uint16{db: pd, web: bp}, nil); err != nil {
		t.Errorf("retry after the port was freed: %v", err)
	}
}
