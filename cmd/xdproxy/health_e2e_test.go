package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/xdproxy/xdproxy/control/agent"
	"github.com/xdproxy/xdproxy/internal/kubetest"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// The tests of "failures are visible": a publish the dataplane refuses is
// retried and shows in the metrics and in /healthz by kube-proxy's rules,
// an API server outage changes nothing while nothing waits, and the
// healthCheckNodePorts answer what load balancers ask, all with the real
// binary. Publishes are made to fail through the agent's fault seam on the
// admin socket (POST /debug/faults).

// lateSvc is a Service added while publishes fail.
var lateSvc = svc{name: "late", clusterIP: "198.19.0.50", port: 80, target: testbed.HTTPPort, backends: []int{0, 1, 2}}

// The kubernetes source's settings of the fault tests: the agent's health
// timeout is twice maxSyncPeriod.
const (
	shortMaxSync  = 3 * time.Second
	healthTimeout = 2 * shortMaxSync
)

// kubeAgentWith is kubeAgent with settings as the lines of
// services.kubernetes other than kubeconfig, and with this node's Node.
func kubeAgentWith(t *testing.T, tb *testbed.Testbed, settings ...string) (*kubetest.Cluster, *daemon) {
	t.Helper()
	cluster := kubetest.Start(t, kubetest.Options{})
	cfg, err := clientcmd.LoadFromFile(cluster.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	var target string
	for _, c := range cfg.Clusters {
		target = strings.TrimPrefix(c.Server, "https://")
	}
	ln, err := testbed.ForwardInto(tb.NodeNS(), target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	for _, c := range cfg.Clusters {
		c.Server = "https://" + ln.Addr().String()
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	apply(t, cluster, serviceFile(webSvc)) // the agent waits for a table with frontends
	// /healthz needs the node known, as kube-proxy's does (nodeEligible).
	apply(t, cluster, "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\n")
	source := "services:\n  kubernetes:\n    kubeconfig: " + kubeconfig + "\n"
	for _, s := range settings {
		source += "    " + s + "\n"
	}
	return cluster, newAgentWith(t, tb, "", agentOptions{}, source)
}

// httpEnds are where a daemon serves its metrics and /healthz.
type httpEnds struct {
	tb               *testbed.Testbed
	ns               string
	metrics, healthz string // host:port in ns
}

// ends finds the daemon's metrics and health listeners. The test configs
// put both on 127.0.0.1:0 in the node's namespace: they are the daemon's
// listening TCP sockets on 127.0.0.1 there (/proc/PID/net/tcp, matched
// with the sockets the process holds), told apart by what they answer.
func (a *daemon) ends() httpEnds {
	a.t.Helper()
	pid := a.cmd.Process.Pid
	held := map[string]bool{}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		a.t.Fatal(err)
	}
	for _, fd := range fds {
		l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if inode, ok := strings.CutPrefix(l, "socket:["); ok {
			held[strings.TrimSuffix(inode, "]")] = true
		}
	}
	tcp, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/tcp", pid))
	if err != nil {
		a.t.Fatal(err)
	}
	e := httpEnds{tb: a.tb, ns: a.ns}
	client := a.tb.HTTPClient(a.ns, 5*time.Second)
	for _, line := range strings.Split(string(tcp), "\n")[1:] {
		// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
		f := strings.Fields(line)
		if len(f) < 10 || f[3] != "0A" || !held[f[9]] {
			continue
		}
		hexPort, ok := strings.CutPrefix(f[1], "0100007F:") // 127.0.0.1, little-endian
		if !ok {
			continue
		}
		port, _ := strconv.ParseUint(hexPort, 16, 16)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if resp, err := client.Get("http://" + addr + "/healthz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusNotFound {
				e.healthz = addr
				continue
			}
		}
		if resp, err := client.Get("http://" + addr + "/metrics"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				e.metrics = addr
			}
		}
	}
	if e.metrics == "" || e.healthz == "" {
		a.t.Fatalf("the daemon's listeners: metrics %q, healthz %q\n/proc/%d/net/tcp:\n%s", e.metrics, e.healthz, pid, tcp)
	}
	return e
}

// scrape reads /metrics: each series, labels as exposed, to its value.
func (e httpEnds) scrape(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := e.tb.HTTPClient(e.ns, 5*time.Second).Get("http://" + e.metrics + "/metrics")
	if err != nil {
		t.Fatalf("scraping metrics: %v", err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// publishMetrics are the series the fault tests follow.
type publishMetrics struct {
	failures, pending, healthy float64
}

func (e httpEnds) publishMetrics(t *testing.T) publishMetrics {
	t.Helper()
	m := e.scrape(t)
	return publishMetrics{failures: m["xdproxy_publish_failures_total"], pending: m["xdproxy_publish_pending"],
		healthy: m[`xdproxy_healthy{check="healthz"}`]}
}

// healthBody is /healthz's and /livez's JSON.
type healthBody struct {
	LastUpdated  time.Time `json:"lastUpdated"`
	CurrentTime  time.Time `json:"currentTime"`
	NodeEligible *bool     `json:"nodeEligible"`
	Healthy      bool      `json:"healthy"`
	Problems     []string  `json:"problems"`
}

// health asks path (/healthz or /livez).
func (e httpEnds) health(t *testing.T, path string) (int, healthBody) {
	t.Helper()
	resp, err := e.tb.HTTPClient(e.ns, 5*time.Second).Get("http://" + e.healthz + path)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	defer resp.Body.Close()
	var b healthBody
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return resp.StatusCode, b
}

// faultState is the fault seam's answer on the admin socket.
type faultState struct {
	Publish  int `json:"publish"`
	Injected int `json:"injected"`
}

// faultSeam asks the admin socket's /debug/faults.
func (a *daemon) faultSeam(method string, query string) faultState {
	a.t.Helper()
	b, err := agent.AdminRequest(a.admin, method, "/debug/faults"+query)
	var f faultState
	if err == nil {
		err = json.Unmarshal(b, &f)
	}
	if err != nil {
		a.t.Fatalf("%s /debug/faults%s: %v", method, query, err)
	}
	return f
}

// armFaults makes the daemon's next n publishes fail.
func (a *daemon) armFaults(n int) {
	a.t.Helper()
	if f := a.faultSeam("POST", fmt.Sprintf("?publish=%d", n)); f.Publish != n {
		a.t.Fatalf("armed %d faults, the daemon says %d", n, f.Publish)
	}
}

// within retries check every 200 ms until it returns "" or d passes.
func within(t *testing.T, d time.Duration, what string, check func() string) {
	t.Helper()
	last := ""
	if !waitUntil(200*time.Millisecond, d, func() bool { last = check(); return last == "" }) {
		t.Fatalf("%s, not within %v: %s", what, d, last)
	}
}

// forwards says whether a connection to the VIP addr (host:port) is
// forwarded to a backend.
func forwards(tb *testbed.Testbed, addr string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c, err := tb.Dial(ctx, tb.ClientNS(), "tcp", addr)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// waitUnhealthy polls /healthz until it answers 503, and checks that it
// did so no sooner than healthTimeout after queued (the latest moment the
// change can have been queued), that the body names the update not
// applied, and that the healthz gauge agrees. It fails if the publish
// succeeds (pending 0) first.
func waitUnhealthy(t *testing.T, a *daemon, e httpEnds, queued time.Time) healthBody {
	t.Helper()
	var body healthBody
	if !waitUntil(200*time.Millisecond, healthTimeout+30*time.Second, func() bool {
		var code int
		code, body = e.health(t, "/healthz")
		if code == http.StatusServiceUnavailable {
			return true
		}
		if code != http.StatusOK || !body.Healthy {
			t.Fatalf("/healthz answered %d %+v, want 200 or the queued update's 503", code, body)
		}
		if m := e.publishMetrics(t); m.pending == 0 {
			t.Fatalf("the failing publish went through before /healthz failed (%v after the change); faults: %+v\n%s",
				time.Since(queued).Round(time.Millisecond), a.faultSeam("GET", ""), a.dump())
		}
		return false
	}) {
		t.Fatalf("/healthz never failed while a change waited\n%s", a.dump())
	}
	if waited := time.Since(queued); waited < healthTimeout {
		t.Errorf("/healthz failed %v after the change was made; kube-proxy's rule allows %v", waited, healthTimeout)
	}
	want := "is not applied after " + healthTimeout.String()
	if body.Healthy || len(body.Problems) == 0 || !strings.Contains(strings.Join(body.Problems, "\n"), want) {
		t.Errorf("/healthz 503 body does not name the queued update (%q): %+v", want, body)
	}
	if m := e.publishMetrics(t); m.healthy != 0 || m.pending != 1 {
		t.Errorf("while /healthz fails: %+v, want healthy 0 and pending 1", m)
	}
	return body
}

// waitRecovered waits for the pending publish to go through and checks
// what the recovery must show: pending 0, /healthz 200 again, exactly
// wantFailures more failed publishes than before, every fault spent.
func waitRecovered(t *testing.T, a *daemon, e httpEnds, before publishMetrics, wantFailures int, d time.Duration) {
	t.Helper()
	within(t, d, "the retried publish going through", func() string {
		if m := e.publishMetrics(t); m.pending != 0 {
			return fmt.Sprintf("pending %v, faults %+v", m.pending, a.faultSeam("GET", ""))
		}
		return ""
	})
	m := e.publishMetrics(t)
	if m.failures-before.failures != float64(wantFailures) || m.healthy != 1 {
		t.Errorf("after recovery: %+v; want %d more failures than %v and healthy 1", m, wantFailures, before.failures)
	}
	if f := a.faultSeam("GET", ""); f.Publish != 0 {
		t.Errorf("faults left after recovery: %+v", f)
	}
	if code, body := e.health(t, "/healthz"); code != http.StatusOK || !body.Healthy || len(body.Problems) != 0 {
		t.Errorf("/healthz after recovery: %d %+v", code, body)
	}
}

// logSays stops the daemon (its log is written until it exits) and checks
// that the log has each of lines.
func logSays(t *testing.T, a *daemon, lines ...string) {
	t.Helper()
	a.stop()
	log := a.log.String()
	for _, l := range lines {
		if !strings.Contains(log, l) {
			t.Errorf("the log does not say %q:\n%s", l, log)
		}
	}
}

// TestPublishFailureIsRetriedAndVisible proves, with the real binary and
// API server, that a publish the dataplane refuses is neither lost nor
// silent: while it fails (4 injected failures, retried after 1, 2, 4 and
// 8 s) xdproxy_publish_failures_total counts each try, xdproxy_publish_pending
// is 1, the new Service is not forwarded and the old one still is;
// /healthz stays 200 until the change has waited the health timeout
// (2 x maxSyncPeriod) and then answers 503 naming the update, as
// kube-proxy's does; once the faults are spent the retry applies the
// change without any new event, the new Service forwards, /healthz is 200
// and pending 0 again.
func TestPublishFailureIsRetriedAndVisible(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	cluster, a := kubeAgentWith(t, tb, "minSyncPeriod: 100ms", "maxSyncPeriod: "+shortMaxSync.String())
	e := a.ends()
	within(t, 10*time.Second, "/healthz 200 after start", func() string {
		if code, body := e.health(t, "/healthz"); code != http.StatusOK {
			return fmt.Sprintf("%d %+v", code, body)
		}
		return ""
	})
	before := e.publishMetrics(t)
	if before.pending != 0 || before.healthy != 1 {
		t.Fatalf("before the faults: %+v", before)
	}

	a.armFaults(4)
	queued := time.Now()
	apply(t, cluster, serviceFile(lateSvc))
	within(t, 10*time.Second, "the failed publish counted", func() string {
		if m := e.publishMetrics(t); m.failures < before.failures+1 || m.pending != 1 {
			return fmt.Sprintf("%+v", m)
		}
		return ""
	})
	if forwards(tb, "198.19.0.50:80") {
		t.Fatalf("the new Service forwards although its publish failed\n%s", a.dump())
	}
	if _, err := get(tb, "http://198.19.0.10/"); err != nil {
		t.Fatalf("the existing Service while publishes fail: %v\n%s", err, a.dump())
	}

	body := waitUnhealthy(t, a, e, queued)
	t.Logf("/healthz 503 after %v: %v", time.Since(queued).Round(time.Millisecond), body.Problems)
	if forwards(tb, "198.19.0.50:80") {
		t.Errorf("the new Service forwards while /healthz says its update is not applied")
	}

	waitRecovered(t, a, e, before, 4, 40*time.Second)
	t.Logf("recovered %v after the change", time.Since(queued).Round(time.Millisecond))
	if got := backendsReachedAt(t, tb, a, "198.19.0.50", 30); len(got) != 3 {
		t.Errorf("the Service added during the failures reached %v, want 3 backends", got)
	}
	if f := a.faultSeam("GET", ""); f.Injected != 4 {
		t.Errorf("%d faults injected, want 4", f.Injected)
	}
	logSays(t, a, "kubesource: publishing the service model failed", "kubesource: publishing recovered after 4 failures")
}

// backendsReachedAt is backendsReached for the VIP vip.
func backendsReachedAt(t *testing.T, tb *testbed.Testbed, a *daemon, vip string, n int) map[string]bool {
	t.Helper()
	seen := map[string]bool{}
	for i := 0; i < n; i++ {
		name, err := get(tb, "http://"+vip+"/")
		if err != nil {
			t.Fatalf("request %d to %s: %v\n%s", i, vip, err, a.dump())
		}
		seen[name] = true
	}
	return seen
}

// TestFilePublishFailureIsRetried proves the same retry with the file
// source, whose own loop retries a refused Model: two injected failures
// are counted, pending is 1 meanwhile, and the edited file is applied by
// the retry alone. /healthz stays 200 throughout, since the change waits
// less than the file source's health timeout (2 x 30 s), and /livez is
// 200 as well.
func TestFilePublishFailureIsRetried(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	e := a.ends()
	before := e.publishMetrics(t)
	if before.pending != 0 {
		t.Fatalf("before the faults: %+v", before)
	}
	a.armFaults(2)
	writeFileAtomic(t, a.services, serviceFile(webSvc, lateSvc))
	within(t, 15*time.Second, "the failed publish counted", func() string {
		if m := e.publishMetrics(t); m.failures < before.failures+1 || m.pending != 1 {
			return fmt.Sprintf("%+v", m)
		}
		return ""
	})
	if forwards(tb, "198.19.0.50:80") {
		t.Fatalf("the new Service forwards although its publish failed\n%s", a.dump())
	}
	if code, body := e.health(t, "/healthz"); code != http.StatusOK || !body.Healthy {
		t.Errorf("/healthz while a change has waited less than its timeout: %d %+v", code, body)
	}
	waitRecovered(t, a, e, before, 2, 30*time.Second)
	if got := backendsReachedAt(t, tb, a, "198.19.0.50", 30); len(got) != 3 {
		t.Errorf("the Service added during the failures reached %v, want 3 backends", got)
	}
	if code, body := e.health(t, "/livez"); code != http.StatusOK || !body.Healthy {
		t.Errorf("/livez: %d %+v", code, body)
	}
	logSays(t, a, "filesource: publishing the service model failed", "filesource: publishing recovered after 2 failures")
}

// TestAPIServerOutage proves that losing the API server is not a failure
// of xdproxy's: for 60 s without it a new connection through an existing
// Service succeeds every second and /healthz and /livez stay 200, since
// nothing is queued (kube-proxy's rule); after it returns, a change
// applied through it is forwarded. Then a change is made to fail (5
// injected failures) and the API server stopped again: /healthz answers
// 503 once the queued change has waited the health timeout, while the
// last applied table keeps forwarding; the retry applies the change with
// the API server still down, and /healthz is 200 again.
func TestAPIServerOutage(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	cluster, a := kubeAgentWith(t, tb, "minSyncPeriod: 100ms", "maxSyncPeriod: "+shortMaxSync.String())
	e := a.ends()
	if got := backendsReached(t, tb, a, 30); len(got) != 3 {
		t.Fatalf("before the outage reached %v, want 3 backends", got)
	}
	before := e.publishMetrics(t)

	cluster.StopAPIServer()
	t.Log("API server stopped for 60 s")
	start := time.Now()
	for i := 0; time.Since(start) < 60*time.Second; i++ {
		next := start.Add(time.Duration(i+1) * time.Second)
		if _, err := get(tb, "http://198.19.0.10/"); err != nil {
			t.Fatalf("%v into the outage, a request through the Service failed: %v\n%s",
				time.Since(start).Round(time.Second), err, a.dump())
		}
		for _, path := range []string{"/healthz", "/livez"} {
			if code, body := e.health(t, path); code != http.StatusOK || !body.Healthy {
				t.Fatalf("%v into the outage, %s: %d %+v\n%s", time.Since(start).Round(time.Second), path, code, body, a.dump())
			}
		}
		time.Sleep(time.Until(next))
	}
	if m := e.publishMetrics(t); m != before {
		t.Errorf("the outage moved the publish metrics: %+v, before %+v", m, before)
	}

	cluster.StartAPIServer()
	t.Log("API server back: a change made through it is forwarded")
	one := webSvc
	one.backends = []int{0}
	apply(t, cluster, serviceFile(one))
	a.waitBackends("web", 1)
	if got := backendsReached(t, tb, a, 20); len(got) != 1 || !got[testbed.BackendName(0)] {
		t.Fatalf("after the outage, scaled to backend-0, reached %v\nflows:\n%s\n%s", got, a.flows(), a.dump())
	}
	if code, body := e.health(t, "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz after the outage: %d %+v", code, body)
	}

	t.Log("a change that cannot be published, then the API server stopped again")
	before = e.publishMetrics(t)
	a.armFaults(5)
	queued := time.Now()
	apply(t, cluster, serviceFile(webSvc)) // back to three backends
	within(t, 10*time.Second, "the failed publish counted", func() string {
		if m := e.publishMetrics(t); m.failures < before.failures+1 || m.pending != 1 {
			return fmt.Sprintf("%+v", m)
		}
		return ""
	})
	cluster.StopAPIServer()
	t.Logf("API server stopped %v after the change", time.Since(queued).Round(time.Millisecond))
	// The last applied table forwards: backend-0 only.
	if got := backendsReached(t, tb, a, 10); len(got) != 1 || !got[testbed.BackendName(0)] {
		t.Errorf("while the change waits, reached %v; want the applied table's backend-0 only", got)
	}
	body := waitUnhealthy(t, a, e, queued)
	t.Logf("/healthz 503 after %v: %v", time.Since(queued).Round(time.Millisecond), body.Problems)
	if got := backendsReached(t, tb, a, 10); len(got) != 1 {
		t.Errorf("while /healthz fails, reached %v; want backend-0, forwarding as before", got)
	}

	waitRecovered(t, a, e, before, 5, 60*time.Second)
	t.Logf("applied by the retry %v after the change, the API server still down", time.Since(queued).Round(time.Millisecond))
	if got := backendsReached(t, tb, a, 40); len(got) != 3 {
		t.Errorf("after the retry, with the API server down, reached %v, want 3 backends", got)
	}

	cluster.StartAPIServer()
	two := webSvc
	two.backends = []int{1, 2}
	apply(t, cluster, serviceFile(two))
	a.waitBackends("web", 2)
	if code, body := e.health(t, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz at the end: %d %+v", code, body)
	}
	logSays(t, a, "kubesource: publishing recovered after 5 failures")
}

// lbService is a Service of type LoadBalancer with externalTrafficPolicy
// Local, whose healthCheckNodePort the API server allocates, and its
// EndpointSlice: backend i on node nodes[i].
func lbService(nodes ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  ports: [{name: p, port: 80, protocol: TCP, targetPort: %d}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-1
  namespace: default
  labels: {kubernetes.io/service-name: lb}
addressType: IPv4
ports: [{name: p, port: %d, protocol: TCP}]
endpoints:
`, testbed.HTTPPort, testbed.HTTPPort)
	for i, n := range nodes {
		fmt.Fprintf(&b, "- addresses: [%s]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: %s\n",
			testbed.BackendAddr(i), n)
	}
	return b.String()
}

// TestHealthCheckNodePort proves the healthCheckNodePort servers against
// the real API server, as a cloud load balancer sees them from outside the
// node: the port the API server allocated answers 200 and kube-proxy's
// JSON with the count of this node's endpoints (and the count as
// X-Load-Balancing-Endpoint-Weight), follows scaling up and endpoints
// moving to another node, answers 503 with localEndpoints 0 when none is
// on this node, and closes when the Service is deleted.
func TestHealthCheckNodePort(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	cluster, a := kubeAgentWith(t, tb, "minSyncPeriod: 100ms", "maxSyncPeriod: 10s")
	apply(t, cluster, lbService("node-1"))
	out, err := cluster.Kubectl("get", "service", "lb", "-o", "jsonpath={.spec.healthCheckNodePort}")
	hcPort, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil || hcPort == 0 {
		t.Fatalf("the API server allocated no healthCheckNodePort: %v %q", err, out)
	}
	url := fmt.Sprintf("http://%s:%d/", tb.NodeClientSide().Addr, hcPort)
	t.Logf("healthCheckNodePort %d", hcPort)
	client := tb.HTTPClient(tb.ClientNS(), 5*time.Second)
	type answer struct {
		code   int
		weight string
		body   string
	}
	ask := func() (answer, error) {
		resp, err := client.Get(url)
		if err != nil {
			return answer{}, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if ct := resp.Header.Get("Content-Type"); err == nil && ct != "application/json" {
			err = fmt.Errorf("Content-Type %q", ct)
		}
		return answer{resp.StatusCode, resp.Header.Get("X-Load-Balancing-Endpoint-Weight"),
			string(bytes.TrimSpace(b))}, err
	}
	expect := func(what string, code, local int) {
		t.Helper()
		want := answer{code, strconv.Itoa(local), fmt.Sprintf(
			`{"service":{"namespace":"default","name":"lb"},"localEndpoints":%d,"serviceProxyHealthy":true}`, local)}
		within(t, 30*time.Second, what, func() string {
			got, err := ask()
			if err != nil {
				return err.Error()
			}
			if got != want {
				return fmt.Sprintf("got %+v, want %+v", got, want)
			}
			return ""
		})
	}
	expect("one local endpoint", http.StatusOK, 1)

	apply(t, cluster, lbService("node-1", "node-1", "node-1"))
	expect("scaled up to three local endpoints", http.StatusOK, 3)

	apply(t, cluster, lbService("node-1", "node-2", "node-1"))
	expect("one of them on another node", http.StatusOK, 2)

	apply(t, cluster, lbService("node-2", "node-2", "node-2"))
	expect("only endpoints on another node", http.StatusServiceUnavailable, 0)

	if out, err := cluster.Kubectl("delete", "service", "lb"); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	within(t, 30*time.Second, "the healthCheckNodePort closing with its Service", func() string {
		_, err := ask()
		if err != nil && strings.Contains(err.Error(), "connection refused") {
			return ""
		}
		return fmt.Sprintf("still answered (err %v)", err)
	})
	if code, body := a.ends().health(t, "/livez"); code != http.StatusOK || !body.Healthy {
		t.Errorf("/livez: %d %+v", code, body)
	}
}
