package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

var (
	webSvc    = svc{name: "web", clusterIP: "198.19.0.10", port: 80, target: testbed.HTTPPort, backends: []int{0, 1, 2}}
	dnsSvc    = svc{name: "dns", clusterIP: "198.19.0.20", port: 53, target: testbed.UDPPort, proto: "UDP", backends: []int{0, 1, 2}}
	streamSvc = svc{name: "stream", clusterIP: "198.19.0.30", port: 5001, target: testbed.StreamPort, backends: []int{0, 1, 2}}
)

func newTopology(t *testing.T, opts testbed.Options) *testbed.Testbed {
	needRoot(t)
	tb := testbed.NewForTest(t, opts)
	if err := tb.StartServers(); err != nil {
		t.Fatal(err)
	}
	return tb
}

// get fetches url with a fresh connection from the client namespace and
// returns the backend name that answered.
func get(tb *testbed.Testbed, url string) (string, error) {
	resp, err := tb.HTTPClient(tb.ClientNS(), 10*time.Second).Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(b)), err
}

// TestHTTPReachesEveryBackend: 300 requests, each on a new connection, to a
// cluster IP; each of three backends must get its share within 5 standard
// deviations of the binomial (100 ± 41).
func TestHTTPReachesEveryBackend(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	const n = 300
	hits := map[string]int{}
	for i := 0; i < n; i++ {
		name, err := get(tb, "http://198.19.0.10/")
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
		hits[name]++
	}
	sd := math.Sqrt(n * (1.0 / 3) * (2.0 / 3))
	for i := 0; i < 3; i++ {
		got := hits[testbed.BackendName(i)]
		if math.Abs(float64(got)-n/3.0) > 5*sd {
			t.Errorf("%s got %d of %d requests, want %d ± %.0f", testbed.BackendName(i), got, n, n/3, 5*sd)
		}
	}
	t.Logf("hits per backend: %v", hits)
}

// TestCurlThroughVIP uses a real curl from the client namespace.
func TestCurlThroughVIP(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl is not installed (make test installs it)")
	}
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	out, err := tb.Exec(tb.ClientNS(), "curl", "-sS", "--max-time", "5", "http://198.19.0.10/")
	if err != nil || !strings.HasPrefix(string(out), "backend-") {
		t.Fatalf("curl: %v %q\n%s", err, out, a.dump())
	}
}

// TestUDPThroughVIP: datagrams to a UDP cluster IP are answered by the
// backends, each reply coming back from the VIP.
func TestUDPThroughVIP(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{})
	seen := map[string]bool{}
	for i := 0; i < 60; i++ {
		c, err := tb.Dial(context.Background(), tb.ClientNS(), "udp", "198.19.0.20:53")
		if err != nil {
			t.Fatal(err)
		}
		msg := fmt.Sprintf("q%d", i)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 512)
		n, err := c.Read(buf) // a connected UDP socket only accepts replies from the VIP
		c.Close()
		if err != nil {
			t.Fatalf("datagram %d: %v\n%s", i, err, a.dump())
		}
		name, echo, _ := strings.Cut(string(buf[:n]), " ")
		if echo != msg {
			t.Fatalf("reply %q to %q", buf[:n], msg)
		}
		seen[name] = true
	}
	if len(seen) != 3 {
		t.Errorf("UDP reached %d backends: %v", len(seen), seen)
	}
}

// TestFirstDatagramWaitsForTheNeighbour: with the node's neighbour
// entries for the backends gone, each backend's first datagram goes
// through the kernel, which holds it while it resolves the neighbour (as
// kube-proxy's path does); none is lost, so every datagram is answered at
// the first try.
func TestFirstDatagramWaitsForTheNeighbour(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(dnsSvc), agentOptions{})
	lan := tb.NodeLANSide()
	if out, err := tb.Exec(lan.NS, "ip", "neigh", "flush", "dev", lan.Iface); err != nil {
		t.Fatalf("ip neigh flush: %v %s", err, out)
	}
	// Until every backend answered and a frame went through the kernel:
	// the route cache may learn of the flush only after a first
	// datagram went out with the old, still right, MAC.
	seen := map[string]bool{}
	for i := 0; i < 60 && (len(seen) < tb.NumBackends() || a.workerTotals().Unresolved == 0); i++ {
		c, err := tb.Dial(context.Background(), tb.ClientNS(), "udp", "198.19.0.20:53")
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		msg := fmt.Sprintf("q%d", i)
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 512)
		n, err := c.Read(buf)
		c.Close()
		if err != nil {
			t.Fatalf("datagram %d (backends answered so far: %v): %v\n%s", i, seen, err, a.dump())
		}
		name, _, _ := strings.Cut(string(buf[:n]), " ")
		seen[name] = true
	}
	if s := a.workerTotals(); s.Unresolved == 0 || s.ByReason["drop_neighbor_unresolved"] != 0 {
		t.Errorf("workers %+v: want frames sent through the kernel for want of a neighbour, none dropped", s)
	}
}

// TestTCPTransfer100MB moves 100 MiB each way through the VIP and checks
// every byte.
func TestTCPTransfer100MB(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(streamSvc), agentOptions{})
	const size = 100 << 20
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()

	// Server to client.
	c, err := tb.Dial(ctx, tb.ClientNS(), "tcp", "198.19.0.30:5001")
	if err != nil {
		t.Fatalf("%v\n%s", err, a.dump())
	}
	start := time.Now()
	fmt.Fprintf(c, "SEND %d\n", size)
	n, mismatch, err := testserver.VerifyPattern(c)
	c.Close()
	if err != nil || n != size || mismatch != -1 {
		t.Fatalf("download: %d bytes, mismatch at %d, err %v\n%s", n, mismatch, err, a.dump())
	}
	t.Logf("download: %d MiB in %v", size>>20, time.Since(start).Round(time.Millisecond))

	// Client to server.
	c, err = tb.Dial(ctx, tb.ClientNS(), "tcp", "198.19.0.30:5001")
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	fmt.Fprintf(c, "RECV\n")
	if _, err := io.Copy(c, testserver.Pattern(size)); err != nil {
		t.Fatalf("upload: %v\n%s", err, a.dump())
	}
	_ = c.(interface{ CloseWrite() error }).CloseWrite()
	line, err := bufio.NewReader(c).ReadString('\n')
	c.Close()
	if err != nil || strings.TrimSpace(line) != fmt.Sprintf("%d -1", size) {
		t.Fatalf("upload: server says %q, err %v\n%s", line, err, a.dump())
	}
	t.Logf("upload: %d MiB in %v", size>>20, time.Since(start).Round(time.Millisecond))
}

// TestRemoveBackend edits the service file while connections are open: new
// connections avoid the removed backend, established connections to the
// others keep working.
func TestRemoveBackend(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc, streamSvc), agentOptions{})
	ctx := context.Background()
	type conn struct {
		c       io.ReadWriteCloser
		backend string
		sent    int64
	}
	var conns []*conn
	for i := 0; i < 12; i++ {
		c, err := tb.Dial(ctx, tb.ClientNS(), "tcp", "198.19.0.30:5001")
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "RECV\n")
		buf := make([]byte, 1000)
		testserver.FillPattern(buf, 0)
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, &conn{c: c, sent: 1000, backend: backendOf(t, a, c.LocalAddr().String())})
	}
	removed := testbed.BackendAddr(2).String()
	kept := svc(streamSvc)
	kept.backends = []int{0, 1}
	web := webSvc
	web.backends = []int{0, 1}
	writeFileAtomic(t, a.services, serviceFile(web, kept))
	a.waitBackends("stream", 2)
	a.waitBackends("web", 2)

	for i := 0; i < 60; i++ {
		name, err := get(tb, "http://198.19.0.10/")
		if err != nil {
			t.Fatalf("request %d after removal: %v\n%s", i, err, a.dump())
		}
		if name == testbed.BackendName(2) {
			t.Fatalf("request %d went to the removed backend", i)
		}
	}
	survivors := 0
	for _, k := range conns {
		if k.backend == removed {
			k.c.Close()
			continue
		}
		survivors++
		buf := make([]byte, 5000)
		testserver.FillPattern(buf, k.sent)
		if _, err := k.c.Write(buf); err != nil {
			t.Fatalf("established connection to %s broke: %v", k.backend, err)
		}
		k.sent += int64(len(buf))
		_ = k.c.(interface{ CloseWrite() error }).CloseWrite()
		line, err := bufio.NewReader(k.c).ReadString('\n')
		k.c.Close()
		if err != nil || strings.TrimSpace(line) != fmt.Sprintf("%d -1", k.sent) {
			t.Fatalf("connection to %s after removal: %q %v", k.backend, line, err)
		}
	}
	if survivors == 0 {
		t.Fatal("no connection went to a kept backend")
	}
}

// backendOf finds the backend a client connection was sent to, from the
// agent's connection table.
func backendOf(t *testing.T, a *daemon, local string) string {
	t.Helper()
	ap := netip.MustParseAddrPort(local)
	want := fmt.Sprintf(":%d->", ap.Port())
	var flows []flowReply
	for i := 0; i < 20; i++ {
		if err := a.query("conntrack", &flows); err != nil {
			t.Fatal(err)
		}
		for _, f := range flows {
			if strings.Contains(f.Original, ap.Addr().String()+want) {
				// Translated is "TCP src:port->backend:port".
				_, dst, _ := strings.Cut(f.Translated, "->")
				host, _, _ := strings.Cut(dst, ":")
				return host
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("no tracked flow for %s", local)
	return ""
}

// TestOtherTrafficStaysWithKernel: ping and TCP straight to a backend still
// work while xdproxy runs, and never reach its workers.
func TestOtherTrafficStaysWithKernel(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	if err := tb.Ping(tb.ClientNS(), testbed.BackendAddr(1), 2*time.Second); err != nil {
		t.Fatalf("ping: %v\n%s", err, a.dump())
	}
	if err := tb.Ping(tb.ClientNS(), tb.NodeClientSide().Addr, 2*time.Second); err != nil {
		t.Fatalf("ping node: %v", err)
	}
	name, err := get(tb, "http://"+testbed.BackendAddr(1).String()+"/")
	if err != nil || name != testbed.BackendName(1) {
		t.Fatalf("direct HTTP: %q %v\n%s", name, err, a.dump())
	}
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		t.Fatal(err)
	}
	if len(flows) != 0 {
		t.Fatalf("xdproxy tracked traffic that is not a service's: %v", flows)
	}
}

// TestWorkersRunOnTheirCPUs: a two-queue veth gets two workers per
// interface, each pinned to the CPU the config names, checked in /proc.
func TestWorkersRunOnTheirCPUs(t *testing.T) {
	tb := newTopology(t, testbed.Options{Queues: 2})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{queues: 2, cpus: []int{1, 0}})
	// Many flows so that both queues see traffic.
	for i := 0; i < 64; i++ {
		if _, err := get(tb, "http://198.19.0.10/"); err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
	}
	var all, workers []workerReply
	if err := a.query("workers", &all); err != nil {
		t.Fatal(err)
	}
	for _, w := range all {
		if w.Interface != "xdpx0-dp" { // the exception link's worker
			workers = append(workers, w)
		}
	}
	if len(workers) != 4 {
		t.Fatalf("%d workers, want 4 (2 interfaces x 2 queues): %+v", len(workers), all)
	}
	pid := a.cmd.Process.Pid
	busy := 0
	for _, w := range workers {
		want := []int{1, 0}[w.Queue]
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/status", pid, w.TID))
		if err != nil {
			t.Fatalf("worker %+v: %v", w, err)
		}
		allowed := ""
		for _, l := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(l, "Cpus_allowed_list:"); ok {
				allowed = strings.TrimSpace(v)
			}
		}
		if allowed != strconv.Itoa(want) || w.CPU != want {
			t.Errorf("worker %s queue %d: allowed CPUs %q, config %d, want %d", w.Interface, w.Queue, allowed, w.CPU, want)
		}
		stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, w.TID))
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		if last, _ := strconv.Atoi(fields[36]); last != want {
			t.Errorf("worker %s queue %d last ran on CPU %d, want %d", w.Interface, w.Queue, last, want)
		}
		if w.Counters.RxFrames > 0 {
			busy++
		}
		t.Logf("worker %s queue %d tid %d cpu %d rx %d", w.Interface, w.Queue, w.TID, want, w.Counters.RxFrames)
	}
	if busy < 3 {
		t.Errorf("only %d of 4 workers received frames; traffic did not spread over the queues", busy)
	}
}

// TestKillAndRestart: after kill -9 the program stays attached (pinned),
// claiming the service's frames for the next process rather than letting
// the kernel reset them; a new xdproxy adopts it and forwards.
func TestKillAndRestart(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	if _, err := get(tb, "http://198.19.0.10/"); err != nil {
		t.Fatalf("before kill: %v\n%s", err, a.dump())
	}
	a.kill9()
	out, _ := tb.Exec(tb.NodeNS(), "ip", "-d", "link", "show", tb.NodeClientSide().Iface)
	if !strings.Contains(string(out), "prog/xdp") {
		t.Errorf("XDP program gone after kill -9; it is pinned and should stay for the next process:\n%s", out)
	}
	a.start()
	if !strings.Contains(a.log.String(), "adopted=true") {
		t.Errorf("the new process did not adopt the pinned program:\n%s", a.log)
	}
	for i := 0; i < 10; i++ {
		if _, err := get(tb, "http://198.19.0.10/"); err != nil {
			t.Fatalf("after restart, request %d: %v\n%s", i, err, a.dump())
		}
	}
}

// TestStopKeepsStateCleanupRemovesIt: SIGTERM exits 0 and keeps what the
// next process adopts (programs attached, state files on the tmpfs xdproxy
// mount-state-dir made, the exception link); xdproxy cleanup removes all
// of it.
func TestStopKeepsStateCleanupRemovesIt(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{mountState: true})
	a.stop()
	attached := func() []string {
		var on []string
		for _, ifc := range []string{tb.NodeClientSide().Iface, tb.NodeLANSide().Iface} {
			out, _ := tb.Exec(tb.NodeNS(), "ip", "-d", "link", "show", ifc)
			if strings.Contains(string(out), "prog/xdp") {
				on = append(on, ifc)
			}
		}
		return on
	}
	if on := attached(); len(on) != 2 {
		t.Errorf("programs on %v after SIGTERM, want both interfaces (kept for the next start)", on)
	}
	if _, err := os.Stat(filepath.Join(a.dir, "state", "conntrack.state")); err != nil {
		t.Errorf("conntrack state after SIGTERM: %v", err)
	}
	cmd := xdproxyCommand("cleanup", "--config", a.config)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := testbed.RunIn(tb.NodeNS(), cmd); err != nil {
		t.Fatalf("xdproxy cleanup: %v\n%s", err, out.String())
	}
	if on := attached(); len(on) != 0 {
		t.Errorf("programs left on %v after xdproxy cleanup", on)
	}
	if o, err := tb.Exec(tb.NodeNS(), "ip", "link", "show", "xdpx0"); err == nil {
		t.Errorf("exception link left after cleanup:\n%s", o)
	}
	if entries, _ := os.ReadDir(filepath.Join(a.dir, "state")); len(entries) != 0 {
		t.Errorf("state files left after cleanup: %v", entries)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mounts), " "+filepath.Join(a.dir, "state")+" ") {
		t.Errorf("the state directory's tmpfs (xdproxy mount-state-dir) is still mounted after cleanup")
	}
}

// TestBadConfigNamesTheField: a wrong value exits non-zero with the field,
// from run and from check.
func TestBadConfigNamesTheField(t *testing.T) {
	dir := t.TempDir()
	cfg := dir + "/bad.yaml"
	_ = os.WriteFile(cfg, []byte("apiVersion: xdproxy.io/v1alpha1\nkind: XDProxyConfiguration\nnodeName: n\n"+
		"interfaces:\n  - {name: eth0, queues: [0, 0]}\nservices: {file: /x}\n"), 0o644)
	for _, cmd := range []string{"run", "check"} {
		out, err := xdproxyCommand(cmd, "--config", cfg).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "interfaces[0].queues[1]: queue 0 listed twice") {
			t.Errorf("%s: want a non-zero exit naming interfaces[0].queues[1], got %v: %s", cmd, err, out)
		}
	}
}

var _ = sync.Mutex{}

// TestNodePortMasquerades: a client outside the cluster reaches a NodePort
// on the node's address; the flow is masqueraded to the node's address on
// the backend side and a SNAT port, and the reply comes back by its exact
// tuple.
func TestNodePortMasquerades(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	np := webSvc
	np.nodePort = 30080
	a := newAgent(t, tb, serviceFile(np), agentOptions{})
	node := tb.NodeClientSide().Addr.String()
	seen := map[string]bool{}
	for i := 0; i < 30; i++ {
		name, err := get(tb, "http://"+node+":30080/")
		if err != nil {
			t.Fatalf("request %d to the NodePort: %v\n%s", i, err, a.dump())
		}
		seen[name] = true
	}
	if len(seen) != 3 {
		t.Errorf("NodePort reached %v, want 3 backends", seen)
	}
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		t.Fatal(err)
	}
	lan := tb.NodeLANSide().Addr.String()
	masq := 0
	for _, f := range flows {
		if strings.Contains(f.Original, ":30080") {
			_, src, _ := strings.Cut(f.Translated, " ")
			host, rest, _ := strings.Cut(src, ":")
			port, _ := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
			if ports := config.DefaultPorts; host != lan || port < int(ports.First) || port > int(ports.Last) {
				t.Errorf("flow %s translated to %s: want source %s with a port in %d-%d", f.Original, f.Translated, lan, ports.First, ports.Last)
			}
			masq++
		}
	}
	if masq == 0 {
		t.Fatalf("no NodePort flow tracked: %v", flows)
	}
	var st struct {
		XDP struct{ MatchFlow uint64 } `json:"xdp"`
	}
	if err := a.query("stats", &st); err != nil || st.XDP.MatchFlow == 0 {
		t.Errorf("no reply came back by its exact tuple (%+v, %v)", st, err)
	}
}

// TestSessionAffinity: with sessionAffinity ClientIP every new connection of
// one client goes to the same backend.
func TestSessionAffinity(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	sticky := webSvc
	sticky.extra = "  sessionAffinity: ClientIP\n"
	a := newAgent(t, tb, serviceFile(sticky), agentOptions{})
	first := ""
	for i := 0; i < 20; i++ {
		name, err := get(tb, "http://198.19.0.10/")
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
		if first == "" {
			first = name
		} else if name != first {
			t.Fatalf("request %d went to %s, the first to %s", i, name, first)
		}
	}
}

// TestNoEndpointsRejects: like kube-proxy's REJECT rule, a service without
// endpoints answers TCP with a reset and UDP with ICMP port unreachable, so
// clients fail at once instead of timing out.
func TestNoEndpointsRejects(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	emptyTCP := svc{name: "empty-tcp", clusterIP: "198.19.0.40", port: 80, target: 80}
	emptyUDP := svc{name: "empty-udp", clusterIP: "198.19.0.41", port: 53, target: 53, proto: "UDP"}
	a := newAgent(t, tb, serviceFile(webSvc, emptyTCP, emptyUDP), agentOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	_, err := tb.Dial(ctx, tb.ClientNS(), "tcp", "198.19.0.40:80")
	if err == nil || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("TCP to a service without endpoints: %v, want connection refused\n%s", err, a.dump())
	}
	t.Logf("TCP refused after %v", time.Since(start).Round(time.Millisecond))
	c, err := tb.Dial(ctx, tb.ClientNS(), "udp", "198.19.0.41:53")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("q")); err != nil {
		t.Fatal(err)
	}
	_, err = c.Read(make([]byte, 64))
	if err == nil || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("UDP to a service without endpoints: %v, want connection refused (ICMP port unreachable)\n%s", err, a.dump())
	}
}

// web6Services is an IPv6 web service with the three backends' IPv6
// addresses as endpoints.
func web6Services() string {
	services := `apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec:
  clusterIP: 2001:db8:19::10
  clusterIPs: [2001:db8:19::10]
  ipFamilies: [IPv6]
  ports: [{name: http, port: 80, targetPort: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web6-1
  namespace: default
  labels: {kubernetes.io/service-name: web6}
addressType: IPv6
ports: [{name: http, port: 80, protocol: TCP}]
endpoints:
`
	for i := 0; i < 3; i++ {
		services += fmt.Sprintf("- {addresses: [%s], conditions: {ready: true}}\n", testbed.BackendAddr6(i))
	}
	return services
}

// TestIPv6ClusterIP: an IPv6 service, an IPv6 client and IPv6 endpoints,
// through the same XDP program, conntrack and NAT.
func TestIPv6ClusterIP(t *testing.T) {
	tb := newTopology(t, testbed.Options{IPv6: true})
	a := newAgent(t, tb, web6Services(), agentOptions{clusterCIDR: "198.18.0.0/24,2001:db8:18::/64"})
	seen := map[string]bool{}
	for i := 0; i < 30; i++ {
		name, err := get(tb, "http://[2001:db8:19::10]/")
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
		seen[name] = true
	}
	if len(seen) != 3 {
		t.Errorf("IPv6 service reached %v, want 3 backends", seen)
	}
}

// TestIPv6Masquerades: an IPv6 client outside the cluster CIDRs reaches an
// IPv6 cluster IP; the backend sees the node's IPv6 address on the
// backends' side and a SNAT port, as kube-proxy would masquerade it.
func TestIPv6Masquerades(t *testing.T) {
	tb := newTopology(t, testbed.Options{IPv6: true})
	a := newAgent(t, tb, web6Services(), agentOptions{clusterCIDR: "198.18.0.0/24,2001:db8:aa::/64"})
	ports := config.DefaultPorts
	for i := 0; i < 10; i++ {
		got, err := get(tb, "http://[2001:db8:19::10]/whoami")
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
		_, seen, _ := strings.Cut(got, " ")
		ap, err := netip.ParseAddrPort(seen)
		if err != nil || ap.Addr() != tb.NodeLANSide().Addr6 || ap.Port() < ports.First || ap.Port() > ports.Last {
			t.Fatalf("the backend saw %q: want %v with a port in %d-%d\n%s", got, tb.NodeLANSide().Addr6, ports.First, ports.Last, a.dump())
		}
	}
}
