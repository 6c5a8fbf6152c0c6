package testbed

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

func netnsList(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	return string(out)
}

func TestTopology(t *testing.T) {
	tb := NewForTest(t, Options{Backends: 2, IPv6: true})

	for _, ns := range tb.Namespaces() {
		if !strings.HasPrefix(ns, tb.ID()) {
			t.Errorf("namespace %s does not start with %s", ns, tb.ID())
		}
	}
	if !strings.HasPrefix(tb.ID(), fmt.Sprintf("%s%d-", Prefix, os.Getpid())) {
		t.Errorf("ID %s does not carry our PID", tb.ID())
	}
	listed := netnsList(t)
	for _, ns := range tb.Namespaces() {
		if !strings.Contains(listed, ns) {
			t.Errorf("namespace %s not in ip netns list", ns)
		}
	}

	// The node forwards and does not filter by reverse path.
	for file, want := range map[string]string{
		"/proc/sys/net/ipv4/ip_forward":          "1",
		"/proc/sys/net/ipv4/conf/all/rp_filter":  "0",
		"/proc/sys/net/ipv4/conf/n0/rp_filter":   "0",
		"/proc/sys/net/ipv4/conf/n1/rp_filter":   "0",
		"/proc/sys/net/ipv6/conf/all/forwarding": "1",
	} {
		out, err := tb.Exec(tb.NodeNS(), "cat", file)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(out)); got != want {
			t.Errorf("node %s = %s, want %s", file, got, want)
		}
	}

	// Accessors agree with the kernel.
	hosts := []Host{tb.Client(), tb.NodeClientSide(), tb.NodeLANSide(), tb.Backend(0), tb.Backend(1)}
	for _, h := range hosts {
		err := tb.Do(h.NS, func() error {
			l, err := netlink.LinkByName(h.Iface)
			if err != nil {
				return err
			}
			if l.Attrs().Index != h.IfIndex || l.Attrs().HardwareAddr.String() != h.MAC.String() {
				return fmt.Errorf("%s/%s: kernel has index %d MAC %s, accessor %d %s",
					h.NS, h.Iface, l.Attrs().Index, l.Attrs().HardwareAddr, h.IfIndex, h.MAC)
			}
			return nil
		})
		if err != nil {
			t.Error(err)
		}
	}

	// Plain kernel routing: the client reaches every backend, both families.
	for i := range tb.NumBackends() {
		b := tb.Backend(i)
		if err := tb.Ping(tb.ClientNS(), b.Addr, 3*time.Second); err != nil {
			t.Errorf("ping backend %d: %v", i, err)
		}
		if err := tb.Ping(tb.ClientNS(), b.Addr6, 3*time.Second); err != nil {
			t.Errorf("ping6 backend %d: %v", i, err)
		}
	}
	// And a ping to an address nobody has fails rather than hangs.
	if err := tb.Ping(tb.ClientNS(), BackendAddr(50), 500*time.Millisecond); err == nil {
		t.Errorf("ping of an absent host succeeded")
	}
}

func TestServers(t *testing.T) {
	tb := NewForTest(t, Options{Backends: 3})
	if err := tb.StartServers(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	client := tb.HTTPClient(tb.ClientNS(), 5*time.Second)
	for i := range tb.NumBackends() {
		url := fmt.Sprintf("http://%s/", tb.Backend(i).Addr)
		resp, err := client.Get(url)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != BackendName(i) || resp.Header.Get("X-Backend") != BackendName(i) {
			t.Errorf("GET %s = %q (X-Backend %q), want %q", url, body, resp.Header.Get("X-Backend"), BackendName(i))
		}

		c, err := tb.Dial(ctx, tb.ClientNS(), "udp", net.JoinHostPort(tb.Backend(i).Addr.String(), strconv.Itoa(UDPPort)))
		if err != nil {
			t.Fatal(err)
		}
		name, err := testserver.Echo(c, "hello", 3*time.Second)
		c.Close()
		if err != nil || name != BackendName(i) {
			t.Errorf("UDP echo of backend %d = %q, %v", i, name, err)
		}
	}

	// HTTP bytes endpoint carries the pattern.
	resp, err := client.Get(fmt.Sprintf("http://%s/bytes?n=100000", tb.Backend(0).Addr))
	if err != nil {
		t.Fatal(err)
	}
	n, mismatch, err := testserver.VerifyPattern(resp.Body)
	resp.Body.Close()
	if err != nil || n != 100000 || mismatch != -1 {
		t.Errorf("GET /bytes: %d bytes, mismatch at %d, %v", n, mismatch, err)
	}

	// 100 MB each way through the node's kernel forwarding, byte-exact.
	const size = 100 << 20
	addr := net.JoinHostPort(tb.Backend(1).Addr.String(), strconv.Itoa(StreamPort))
	c, err := tb.Dial(ctx, tb.ClientNS(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	got, mismatch, err := testserver.Fetch(ctx, c, size)
	if err != nil || got != size || mismatch != -1 {
		t.Errorf("Fetch: %d bytes, mismatch at %d, %v", got, mismatch, err)
	}
	c, err = tb.Dial(ctx, tb.ClientNS(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	got, mismatch, err = testserver.Push(ctx, c, size)
	if err != nil || got != size || mismatch != -1 {
		t.Errorf("Push: server counted %d bytes, mismatch at %d, %v", got, mismatch, err)
	}
}

func TestCloseRemovesEverything(t *testing.T) {
	tb := NewForTest(t, Options{Backends: 1})
	if err := tb.StartServers(); err != nil {
		t.Fatal(err)
	}
	pid := tb.servers[0].cmd.Process.Pid
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	listed := netnsList(t)
	for _, ns := range tb.Namespaces() {
		if strings.Contains(listed, ns) {
			t.Errorf("namespace %s still listed after Close", ns)
		}
	}
	if processAlive(pid) {
		t.Errorf("server process %d still there after Close", pid)
	}
	if err := tb.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestCleanupStale plants namespaces and a cgroup named for a PID that no
// longer exists, with a process running in each, and for our own PID.
func TestCleanupStale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root; make test runs as root")
	}
	// A process that has exited gives a PID that is free (reuse within the
	// test is very unlikely).
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadPID := dead.Process.Pid
	staleNS := fmt.Sprintf("%s%d-abcdef-node", Prefix, deadPID)
	liveNS := fmt.Sprintf("%s%d-fedcba-node", Prefix, os.Getpid())
	for _, ns := range []string{staleNS, liveNS} {
		h, err := newNamespace(ns)
		if err != nil {
			t.Fatal(err)
		}
		h.close()
	}
	t.Cleanup(func() {
		_ = deleteNamespace(staleNS)
		_ = deleteNamespace(liveNS)
	})
	sleeper := exec.Command("ip", "netns", "exec", staleNS, "sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- sleeper.Wait() }()
	// Start returns once ip runs, before it has joined the namespace: a
	// cleanup before that finds nobody in it.
	inStale := func() bool {
		var want, got unix.Stat_t
		return unix.Stat("/run/netns/"+staleNS, &want) == nil &&
			unix.Stat(fmt.Sprintf("/proc/%d/ns/net", sleeper.Process.Pid), &got) == nil &&
			want.Dev == got.Dev && want.Ino == got.Ino
	}
	if wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { return inStale(), nil }) != nil {
		t.Fatal("the sleeper never entered the stale namespace")
	}
	mnt, err := Cgroup2Mount()
	if err != nil {
		t.Fatal(err)
	}
	staleDir := filepath.Join(mnt, fmt.Sprintf("%s%d-abcdef", Prefix, deadPID))
	liveDir := filepath.Join(mnt, fmt.Sprintf("%s%d-fedcba", Prefix, os.Getpid()))
	for _, d := range []string{staleDir, liveDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_ = removeCgroup(staleDir)
		_ = removeCgroup(liveDir)
	})
	inCgroup := exec.Command("sleep", "60")
	if err := startInCgroup(liveNS, staleDir, inCgroup); err != nil {
		t.Fatal(err)
	}
	waitedCg := make(chan error, 1)
	go func() { waitedCg <- inCgroup.Wait() }()

	deleted, err := CleanupStale()
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(deleted, " ")
	if !strings.Contains(joined, staleNS) || !strings.Contains(joined, staleDir) {
		t.Errorf("CleanupStale deleted %v, want %s and %s", deleted, staleNS, staleDir)
	}
	if strings.Contains(joined, liveNS) || strings.Contains(joined, liveDir) {
		t.Errorf("CleanupStale deleted %v, including things of a live process", deleted)
	}
	if _, err := os.Stat(staleDir); !os.IsNotExist(err) {
		t.Errorf("stale cgroup still there: %v", err)
	}
	if _, err := os.Stat(liveDir); err != nil {
		t.Errorf("live cgroup: %v", err)
	}
	listed := netnsList(t)
	if strings.Contains(listed, staleNS) || !strings.Contains(listed, liveNS) {
		t.Errorf("after CleanupStale, ip netns list:\n%s", listed)
	}
	select {
	case <-waited:
	case <-time.After(5 * time.Second):
		t.Errorf("process in the stale namespace still runs")
		_ = sleeper.Process.Kill()
	}
	select {
	case <-waitedCg:
	case <-time.After(5 * time.Second):
		t.Errorf("process in the stale cgroup still runs")
		_ = inCgroup.Process.Kill()
	}
}

func TestTuning(t *testing.T) {
	tb := NewForTest(t, Options{Backends: 1, Queues: 2, MTU: 1400, RPS: map[string]string{NodeClientIface: "1"},
		GRO: []string{NodeLANIface}, Threaded: map[string]int{NodeLANIface: 0}})
	node := tb.NodeNS()
	out, err := tb.Exec(node, "sh", "-c", "ls -d /sys/class/net/n0/queues/rx-* | wc -l; cat /sys/class/net/n0/queues/rx-*/rps_cpus; cat /sys/class/net/n1/threaded /sys/class/net/n0/mtu")
	if err != nil {
		t.Fatal(err)
	}
	fields := strings.Fields(string(out))
	if len(fields) != 5 || fields[0] != "2" || fields[1] != "1" || fields[2] != "1" || fields[3] != "1" || fields[4] != "1400" {
		t.Errorf("queues, rps_cpus, threaded, mtu = %q, want [2 1 1 1 1400]", fields)
	}
	if on, err := tb.GRO(node, NodeLANIface); err != nil || !on {
		t.Errorf("GRO on n1 = %v, %v; want on", on, err)
	}
	if on, err := tb.GRO(node, NodeClientIface); err != nil || on {
		t.Errorf("GRO on n0 = %v, %v; want off", on, err)
	}
	// GRO on gives the veth NAPI instances, threaded makes them kthreads.
	pids, err := tb.PinNAPI(node, NodeLANIface, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if !strings.HasPrefix(string(comm), "napi/n1-") {
			t.Errorf("pid %d is %q, not a napi thread of n1", pid, comm)
		}
		status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if !strings.Contains(string(status), "Cpus_allowed_list:\t0\n") {
			t.Errorf("napi thread %d not pinned to CPU 0:\n%s", pid, status)
		}
	}
	if _, err := tb.PinNAPI(node, NodeClientIface, 0); err != ErrNoNAPIThreads {
		t.Errorf("PinNAPI of n0 (no GRO, no XDP) = %v, want ErrNoNAPIThreads", err)
	}
}
