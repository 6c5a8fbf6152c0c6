package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// recordingPublisher is the engine's place in the decorator's tests.
type recordingPublisher struct {
	mu     sync.Mutex
	tables []*service.Table
	err    error
}

func (r *recordingPublisher) Publish(t *service.Table) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tables = append(r.tables, t)
	return r.err
}

func (r *recordingPublisher) got() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.tables)
}

// TestFaultyPublisherFailsTheNextN: armed for N, the decorator fails
// exactly the next N publishes with ErrInjected without passing them on,
// then passes every table on and returns the engine's own answer; arming
// replaces what was left, 0 disarms, and the counts it reports follow.
func TestFaultyPublisherFailsTheNextN(t *testing.T) {
	next := &recordingPublisher{}
	f := &faultyPublisher{next: next}
	tbl := service.Compile(&service.Model{}, service.CompileOptions{})

	if err := f.Publish(tbl); err != nil || next.got() != 1 {
		t.Fatalf("unarmed: err %v, %d tables reached the engine, want nil and 1", err, next.got())
	}
	if st := f.arm(2); st != (faultState{Publish: 2}) {
		t.Errorf("arm(2) answered %+v", st)
	}
	for i := range 2 {
		if err := f.Publish(tbl); !errors.Is(err, ErrInjected) {
			t.Fatalf("armed publish %d: %v, want ErrInjected", i, err)
		}
	}
	if next.got() != 1 {
		t.Fatalf("a failed publish reached the engine (%d tables)", next.got())
	}
	if err := f.Publish(tbl); err != nil || next.got() != 2 || next.tables[1] != tbl {
		t.Fatalf("after the faults: err %v, %d tables reached the engine", err, next.got())
	}
	if st := f.state(); st != (faultState{Publish: 0, Injected: 2}) {
		t.Errorf("state %+v, want 0 left and 2 injected", st)
	}

	f.arm(5)
	if st := f.arm(1); st.Publish != 1 {
		t.Errorf("arm(1) after arm(5) leaves %d, want 1 (arming replaces)", st.Publish)
	}
	if err := f.Publish(tbl); !errors.Is(err, ErrInjected) {
		t.Fatalf("re-armed: %v", err)
	}
	f.arm(3)
	f.arm(0)
	if err := f.Publish(tbl); err != nil {
		t.Fatalf("disarmed: %v", err)
	}

	// Unarmed, the engine's error is the answer, unchanged.
	engineErr := errors.New("programming XDP: no space")
	next.err = engineErr
	if err := f.Publish(tbl); err != engineErr {
		t.Errorf("unarmed with a failing engine: %v, want the engine's error", err)
	}
	if st := f.state(); st.Injected != 3 {
		t.Errorf("%d injected, want 3", st.Injected)
	}
}

// TestFaultyPublisherConcurrent: publishes racing with each other fail
// exactly as many times as armed (run with -race).
func TestFaultyPublisherConcurrent(t *testing.T) {
	next := &recordingPublisher{}
	f := &faultyPublisher{next: next}
	f.arm(100)
	tbl := service.Compile(&service.Model{}, service.CompileOptions{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	failed := 0
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				if f.Publish(tbl) != nil {
					mu.Lock()
					failed++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if failed != 100 || next.got() != 300 {
		t.Errorf("%d failed and %d reached the engine, want 100 and 300", failed, next.got())
	}
}

// fakeAgent is an agent on the fake kernel with a publisher, health
// servers listening on 127.0.0.1, and no source.
func fakeAgent(t testing.TB) (*agent, *fakeKernel) {
	t.Helper()
	e, k := startFakeEngine(t, 1)
	a := &agent{cfg: &config.Config{NodeName: "node-1"}, log: quietLog(), engine: e}
	a.proxy = health.NewProxy(health.ProxyOptions{})
	a.services = health.NewServices(a.proxy, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, a.log)
	t.Cleanup(a.services.Close)
	var err error
	if a.pub, err = newPublisher(a, prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.pub.close)
	return a, k
}

// freePort is a TCP port nothing listens on at 127.0.0.1 just now.
func freePort(t testing.TB) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// lbModel is one Service with externalTrafficPolicy Local and its
// healthCheckNodePort, with local endpoints on node-1, and extra
// ClusterIP services.
func lbModel(hcPort uint16, local int, extra ...string) *service.Model {
	sp := service.ServicePort{Name: service.PortName{Namespace: "default", Name: "lb", Port: "p"},
		Proto: packet.ProtoTCP, ClusterIPs: []packet.Addr{packet.MustParseAddr("198.19.0.40")}, Port: 80,
		NodePort: 30040, ExternalPolicyLocal: true, HealthCheckNodePort: hcPort,
		LoadBalancerIPs: []packet.Addr{packet.MustParseAddr("198.19.1.40")}}
	for i := range local {
		sp.Endpoints = append(sp.Endpoints, service.Endpoint{Addr: packet.MustParseAddr(fmt.Sprintf("198.18.1.%d", 11+i)),
			Port: 8080, Ready: true, Serving: true, NodeName: "node-1"})
	}
	m := &service.Model{Ports: []service.ServicePort{sp}}
	for i, name := range extra {
		m.Ports = append(m.Ports, service.ServicePort{Name: service.PortName{Namespace: "default", Name: name},
			Proto: packet.ProtoTCP, ClusterIPs: []packet.Addr{packet.MustParseAddr(fmt.Sprintf("198.19.0.%d", 50+i))},
			Port: 80, Endpoints: []service.Endpoint{{Addr: packet.MustParseAddr("198.18.1.11"), Port: 8080,
				Ready: true, Serving: true, NodeName: "node-2"}}})
	}
	return m
}

// localEndpoints asks the healthCheckNodePort at 127.0.0.1:port.
func localEndpoints(t *testing.T, port uint16) (int, int) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
	if err != nil {
		t.Fatalf("healthCheckNodePort %d: %v", port, err)
	}
	defer resp.Body.Close()
	var body struct {
		LocalEndpoints int `json:"localEndpoints"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body.LocalEndpoints
}

// TestInjectedFaultLeavesTheEngineAlone: a publish the seam fails is the
// agent's publish failing as a whole, before anything changes: the error
// says it was injected, the engine keeps the table it had (same
// generation, XDP tables not reprogrammed), and the healthCheckNodePort
// servers keep the old counts. The next publish after the faults applies
// the latest model, counts included.
func TestInjectedFaultLeavesTheEngineAlone(t *testing.T) {
	a, k := fakeAgent(t)
	hc := freePort(t)
	if err := a.pub.publish(lbModel(hc, 1)); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	before, programmed := a.engine.Services().Load(), k.tables.programmed()
	if code, n := localEndpoints(t, hc); code != http.StatusOK || n != 1 {
		t.Fatalf("healthCheckNodePort after the first publish: %d, %d local endpoints; want 200 and 1", code, n)
	}

	a.pub.faults.arm(2)
	for i := range 2 {
		err := a.pub.publish(lbModel(hc, 3, "late"))
		if !errors.Is(err, ErrInjected) || !strings.Contains(err.Error(), "programming the dataplane") {
			t.Fatalf("armed publish %d: %v, want the injected fault as a dataplane error", i, err)
		}
		if a.engine.Services().Load() != before || k.tables.programmed() != programmed {
			t.Fatalf("an injected fault changed the engine's table or the XDP tables")
		}
		if code, n := localEndpoints(t, hc); code != http.StatusOK || n != 1 {
			t.Fatalf("healthCheckNodePort during the faults: %d, %d local endpoints; want the old 200 and 1", code, n)
		}
	}

	if err := a.pub.publish(lbModel(hc, 3, "late")); err != nil {
		t.Fatalf("publish after the faults: %v", err)
	}
	after := a.engine.Services().Load()
	if after.Generation() <= before.Generation() || k.tables.programmed() <= programmed {
		t.Errorf("the publish after the faults did not reach the engine: generation %d -> %d", before.Generation(),
			after.Generation())
	}
	if fe := after.Lookup(packet.ProtoTCP, packet.MustParseAddr("198.19.0.50"), 80); fe == nil {
		t.Errorf("the service added while publishes failed is not in the engine's table")
	}
	if code, n := localEndpoints(t, hc); code != http.StatusOK || n != 3 {
		t.Errorf("healthCheckNodePort after the faults: %d, %d local endpoints; want 200 and 3", code, n)
	}
}

// TestAdminArmsFaults: the admin socket arms the seam with POST
// /debug/faults?publish=N, reports it with GET, refuses anything but a
// count, and the publishes then fail.
func TestAdminArmsFaults(t *testing.T) {
	a, _ := fakeAgent(t)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	admin, err := startAdmin(sock, a)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.close)
	request := func(method, path string) (faultState, error) {
		b, err := AdminRequest(sock, method, path)
		var st faultState
		if err == nil {
			err = json.Unmarshal(b, &st)
		}
		return st, err
	}
	for _, bad := range []string{"", "?publish=", "?publish=-1", "?publish=two", "?other=1"} {
		if _, err := request("POST", "/debug/faults"+bad); err == nil || !strings.Contains(err.Error(), "400") {
			t.Errorf("POST /debug/faults%s: %v, want 400 Bad Request", bad, err)
		}
	}
	if st, err := request("POST", "/debug/faults?publish=2"); err != nil || st != (faultState{Publish: 2}) {
		t.Fatalf("arming: %+v %v", st, err)
	}
	for range 2 {
		if err := a.pub.publish(lbModel(0, 1)); !errors.Is(err, ErrInjected) {
			t.Fatalf("publish after arming: %v", err)
		}
	}
	if err := a.pub.publish(lbModel(0, 1)); err != nil {
		t.Fatalf("publish after the faults: %v", err)
	}
	if st, err := request("GET", "/debug/faults"); err != nil || st != (faultState{Publish: 0, Injected: 2}) {
		t.Fatalf("GET /debug/faults: %+v %v, want 0 left and 2 injected", st, err)
	}
	// The socket is the agent's other endpoints' (root only); it answers
	// nothing on a path it does not know.
	if _, err := AdminRequest(sock, "DELETE", "/debug/faults"); err == nil {
		t.Errorf("DELETE /debug/faults was accepted")
	}
}
