package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// The end-to-end tests run the real xdproxy binary in the node namespace of
// a testbed, with real servers in the backend namespaces and real clients in
// the client namespace. They need root; `make test` runs them.

// logBuffer collects a daemon's output: os/exec's copying goroutine
// writes it while the test reads it.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// daemonEnv marks a run of this test binary that is the daemon itself:
// TestMain then calls main, so the tests need no separately built binary.
const daemonEnv = "XDPROXY_E2E_DAEMON"

// xdproxyCommand is the daemon with args: this test binary run again as
// xdproxy.
func xdproxyCommand(args ...string) *exec.Cmd {
	cmd := exec.Command("/proc/self/exe", args...)
	cmd.Env = append(os.Environ(), daemonEnv+"=1")
	return cmd
}

// privateBPFFS mounts a bpffs instance of the test's own (each mount of
// bpffs is a separate instance) and returns a directory on it; it is
// unmounted when the test ends, which lets go of everything pinned there.
func privateBPFFS(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, ""); err != nil {
		t.Fatalf("mounting a bpffs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return filepath.Join(dir, "xdproxy")
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("end-to-end tests need root (make test runs as root)")
	}
}

// svc describes one service of a test's service file.
type svc struct {
	name      string
	clusterIP string
	port      int
	target    int
	proto     string // TCP or UDP
	backends  []int  // testbed backend indexes
	extra     string // extra spec lines, indented for spec
	nodePort  int    // makes it a NodePort service when not 0
}

// serviceFile renders services as kubectl-style YAML: a Service and an
// EndpointSlice per service.
func serviceFile(svcs ...svc) string {
	var b strings.Builder
	for _, s := range svcs {
		proto := s.proto
		if proto == "" {
			proto = "TCP"
		}
		typ, nodePort := "ClusterIP", ""
		if s.nodePort != 0 {
			typ, nodePort = "NodePort", fmt.Sprintf("    nodePort: %d\n", s.nodePort)
		}
		fmt.Fprintf(&b, `---
apiVersion: v1
kind: Service
metadata:
  name: %s
  namespace: default
spec:
  type: %s
  clusterIP: %s
  clusterIPs: [%s]
  ports:
  - name: p
    port: %d
    protocol: %s
    targetPort: %d
%s%s---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s-1
  namespace: default
  labels:
    kubernetes.io/service-name: %s
addressType: IPv4
ports:
- name: p
  port: %d
  protocol: %s
endpoints:
`, s.name, typ, s.clusterIP, s.clusterIP, s.port, proto, s.target, nodePort, s.extra, s.name, s.name, s.target, proto)
		for _, i := range s.backends {
			fmt.Fprintf(&b, "- addresses: [%s]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: node-1\n", testbed.BackendAddr(i))
		}
		if len(s.backends) == 0 {
			b.WriteString("  []\n")
		}
	}
	return b.String()
}

// daemon is a running xdproxy process.
type daemon struct {
	t        *testing.T
	tb       *testbed.Testbed // nil for a NodeBed's agent
	ns       string           // the node's namespace, where it runs
	dir      string
	config   string
	services string
	admin    string
	cmd      *exec.Cmd
	log      *logBuffer
	exited   chan struct{} // closed when the process has exited
	exitErr  error
}

type agentOptions struct {
	clusterCIDR string // default 198.18.0.0/24, the client's subnet
	// allQueues leaves queues and cpus out of the config: every queue
	// served, workers on every CPU.
	allQueues bool
	queues    int
	cpus      []int  // per queue, for both interfaces
	cgroup    string // the cgroup for local clients; "": none
	extraCfg  string
	// mountState mounts the state directory with xdproxy mount-state-dir
	// first, as the DaemonSet's init container does.
	mountState bool
}

func writeFileAtomic(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func newAgent(t *testing.T, tb *testbed.Testbed, services string, o agentOptions) *daemon {
	t.Helper()
	return newAgentWith(t, tb, services, o, "")
}

// newAgentWith starts an agent; sourceCfg replaces the file source's
// services section when it is not empty.
func newAgentWith(t *testing.T, tb *testbed.Testbed, services string, o agentOptions, sourceCfg string) *daemon {
	t.Helper()
	needRoot(t)
	dir := t.TempDir()
	a := &daemon{t: t, tb: tb, ns: tb.NodeNS(), dir: dir, config: filepath.Join(dir, "xdproxy.yaml"),
		services: filepath.Join(dir, "services.yaml"), admin: filepath.Join(dir, "admin.sock")}
	// State that outlives the agent, the test's own: a state directory
	// and a bpffs instance for the pinned programs.
	stateDir, pins := filepath.Join(dir, "state"), privateBPFFS(t)
	// Socket translation hooks a cgroup: never the machine's own root in
	// a test. This topology has no pods; the node-shaped tests give the
	// NodeBed's cgroup.
	localClients := "localClients: {enabled: false}"
	if o.cgroup != "" {
		localClients = "localClients: {cgroup: " + o.cgroup + "}"
	}
	writeFileAtomic(t, a.services, services)
	if sourceCfg == "" {
		sourceCfg = "services:\n  file: " + a.services + "\n"
	}
	if o.queues == 0 {
		o.queues = 1
	}
	if o.cpus == nil {
		for q := 0; q < o.queues; q++ {
			o.cpus = append(o.cpus, q%2)
		}
	}
	if o.clusterCIDR == "" {
		o.clusterCIDR = "198.18.0.0/24"
	}
	queues, cpus := "", ""
	for q := 0; q < o.queues; q++ {
		queues += fmt.Sprintf("%d,", q)
		cpus += fmt.Sprintf("%d,", o.cpus[q])
	}
	queues, cpus = strings.TrimSuffix(queues, ","), strings.TrimSuffix(cpus, ",")
	// SNAT ports: the default, above the node's ephemeral ports.
	ifaceLine := func(name string) string {
		if o.allQueues {
			return fmt.Sprintf("  - {name: %s, xdpMode: native, numFrames: 4096}\n", name)
		}
		return fmt.Sprintf("  - {name: %s, queues: [%s], cpus: [%s], xdpMode: native, numFrames: 4096}\n", name, queues, cpus)
	}
	cfg := fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: node-1
interfaces:
%s%s%sclusterCIDR: %s
metricsAddress: 127.0.0.1:0
healthzAddress: 127.0.0.1:0
adminSocket: %s
stateDir: %s
bpffsDir: %s
%s
%s`, ifaceLine(tb.NodeClientSide().Iface), ifaceLine(tb.NodeLANSide().Iface), sourceCfg, o.clusterCIDR, a.admin,
		stateDir, pins, localClients, o.extraCfg)
	writeFileAtomic(t, a.config, cfg)
	if o.mountState {
		// In this process's mount namespace, where the agent runs too
		// (testbed.StartIn changes only the network namespace).
		out, err := xdproxyCommand("mount-state-dir", "--config", a.config).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "mounted tmpfs") {
			t.Fatalf("xdproxy mount-state-dir: %v: %s", err, out)
		}
		t.Cleanup(func() { _ = unix.Unmount(stateDir, unix.MNT_DETACH) }) // after a.stop below
	}
	a.start()
	t.Cleanup(func() { a.stop() })
	return a
}

// start launches the binary in the node namespace and waits until it
// serves its admin socket with a published table.
func (a *daemon) start() {
	a.t.Helper()
	a.log = &logBuffer{}
	a.cmd = xdproxyCommand("run", "--config", a.config)
	a.cmd.Stdout, a.cmd.Stderr = a.log, a.log
	// Not ip netns exec: it would hide the bpffs the agent pins to.
	if err := testbed.StartIn(a.ns, a.cmd); err != nil {
		a.t.Fatal(err)
	}
	a.exited = make(chan struct{})
	go func(c *exec.Cmd, ch chan struct{}) { a.exitErr = c.Wait(); close(ch) }(a.cmd, a.exited)
	a.waitPublished("xdproxy")
}

// waitPublished waits until the process just started, named name in
// failures, serves its admin socket with a published table; it fails the
// test if the process exits first.
func (a *daemon) waitPublished(name string) {
	a.t.Helper()
	if !waitUntil(100*time.Millisecond, 60*time.Second, func() bool {
		select {
		case <-a.exited:
			a.t.Fatalf("%s exited: %v\n%s", name, a.exitErr, a.log)
		default:
		}
		var st struct {
			Table struct{ Frontends int } `json:"table"`
		}
		return a.query("stats", &st) == nil && st.Table.Frontends > 0
	}) {
		a.t.Fatalf("%s did not publish a table in time:\n%s", name, a.log)
	}
}

// waitUntil calls cond every interval until it returns true or timeout has
// passed, and says whether it did. cond may fail the test.
func waitUntil(interval, timeout time.Duration, cond func() bool) bool {
	return wait.PollUntilContextTimeout(context.Background(), interval, timeout, true,
		func(context.Context) (bool, error) { return cond(), nil }) == nil
}

// stop sends SIGTERM and waits; it reports a non-zero exit.
func (a *daemon) stop() {
	if a.cmd == nil || a.cmd.Process == nil {
		return
	}
	select {
	case <-a.exited:
		return
	default:
	}
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.exited:
		if a.exitErr != nil {
			a.t.Errorf("xdproxy exited with %v after SIGTERM\n%s", a.exitErr, a.log)
		}
	case <-time.After(30 * time.Second):
		// Ask the Go runtime for every goroutine's stack before killing.
		_ = a.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-a.exited:
		case <-time.After(3 * time.Second):
			_ = a.cmd.Process.Kill()
		}
		a.t.Errorf("xdproxy did not stop within 30s of SIGTERM\n%s", a.log)
	}
}

func (a *daemon) kill9() {
	_ = a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.exited
}

// query asks the admin socket and decodes its JSON answer.
func (a *daemon) query(what string, v any) error {
	c := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", a.admin)
		}}}
	resp, err := c.Get("http://xdproxy/" + what)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return json.NewDecoder(resp.Body).Decode(v)
}

// dump prints the agent's counters and log, for failure messages.
func (a *daemon) dump() string {
	var st map[string]any
	_ = a.query("stats", &st)
	b, _ := json.MarshalIndent(st, "", " ")
	return fmt.Sprintf("stats: %s\nlog:\n%s", b, a.log)
}

// flows lists the connection table as the admin socket shows it, for
// failure messages.
func (a *daemon) flows() string {
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, f := range flows {
		fmt.Fprintf(&b, "  %s => %s %s\n", f.Original, f.Translated, f.State)
	}
	return b.String()
}

// waitBackends waits until the service named name lists n backends.
func (a *daemon) waitBackends(name string, n int) {
	a.t.Helper()
	if !waitUntil(100*time.Millisecond, 30*time.Second, func() bool {
		var svcs []serviceReply
		if a.query("services", &svcs) != nil {
			return false
		}
		return slices.ContainsFunc(svcs, func(s serviceReply) bool {
			return strings.HasPrefix(s.Name, "default/"+name) && len(s.Backends) == n
		})
	}) {
		a.t.Fatalf("service %s never had %d backends\n%s", name, n, a.dump())
	}
}

// The admin socket's answers, as the tests read them.
type (
	serviceReply struct {
		Name      string   `json:"name"`
		Proto     string   `json:"proto"`
		Frontends []string `json:"frontends"`
		Backends  []string `json:"backends"`
	}
	workerReply struct {
		Interface string             `json:"interface"`
		Queue     int                `json:"queue"`
		CPU       int                `json:"cpu"`
		TID       int                `json:"tid"`
		Counters  dataplane.Snapshot `json:"counters"`
	}
	flowReply struct {
		Original   string `json:"original"`
		Translated string `json:"translated"`
		State      string `json:"state"`
	}
)

// tupleEnds reads the source and destination of a tuple as the admin
// socket writes it ("TCP 10.0.0.1:4242->10.0.0.2:80").
func tupleEnds(tuple string) (src, dst netip.AddrPort, ok bool) {
	_, ends, _ := strings.Cut(tuple, " ")
	s, d, _ := strings.Cut(ends, "->")
	src, err1 := netip.ParseAddrPort(s)
	dst, err2 := netip.ParseAddrPort(d)
	return src, dst, err1 == nil && err2 == nil
}
