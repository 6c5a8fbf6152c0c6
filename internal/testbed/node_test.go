package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

// TestNode builds one node topology with its servers and checks it from
// several angles.
func TestNode(t *testing.T) {
	nb := NewNodeForTest(t, NodeOptions{})
	if err := nb.StartServers(); err != nil {
		t.Fatal(err)
	}
	t.Run("Shape", func(t *testing.T) { testNodeShape(t, nb) })
	t.Run("Paths", func(t *testing.T) { testNodePaths(t, nb) })
	t.Run("Queues", func(t *testing.T) { testNodeQueues(t, nb) })
	t.Run("Processes", func(t *testing.T) { testNodeProcesses(t, nb) })
	t.Run("SlowProtocols", func(t *testing.T) { testNodeSlowProtocols(t, nb) })
}

func testNodeShape(t *testing.T, nb *NodeBed) {
	listed := netnsList(t)
	for _, ns := range nb.Namespaces() {
		if !strings.HasPrefix(ns, nb.ID()) || !strings.Contains(listed, ns) {
			t.Errorf("namespace %s: not listed, or not named after %s", ns, nb.ID())
		}
	}
	if len(nb.Namespaces()) != 9 {
		t.Errorf("%d namespaces, want 9: %v", len(nb.Namespaces()), nb.Namespaces())
	}
	if st, err := os.Stat(filepath.Join(nb.Cgroup(), "cgroup.procs")); err != nil || filepath.Base(nb.Cgroup()) != nb.ID() {
		t.Errorf("cgroup %s: %v, %v", nb.Cgroup(), st, err)
	}
	if nb.NIC() != "eth0" || nb.Queues() != 4 {
		t.Errorf("NIC %s with %d queues, want eth0 with 4", nb.NIC(), nb.Queues())
	}

	// Accessors agree with the kernel.
	hosts := []Host{nb.Node(), nb.Node2(), nb.Client(), nb.NodeLANPort()}
	for _, p := range nb.Pods() {
		hosts = append(hosts, p.Host, Host{NS: p.NodeNS, Iface: p.HostIface, IfIndex: p.HostIfIndex, MAC: p.HostMAC})
	}
	for _, h := range hosts {
		err := nb.Do(h.NS, func() error {
			l, err := netlink.LinkByName(h.Iface)
			if err != nil {
				return err
			}
			if l.Attrs().Index != h.IfIndex || l.Attrs().HardwareAddr.String() != h.MAC.String() {
				return fmt.Errorf("kernel has index %d MAC %s, accessor %d %s",
					l.Attrs().Index, l.Attrs().HardwareAddr, h.IfIndex, h.MAC)
			}
			if !h.Addr.IsValid() {
				return nil
			}
			addrs, err := netlink.AddrList(l, netlink.FAMILY_V4)
			if err != nil || len(addrs) != 1 || addrs[0].IP.String() != h.Addr.String() {
				return fmt.Errorf("addresses %v (%v), want %s", addrs, err, h.Addr)
			}
			return nil
		})
		if err != nil {
			t.Errorf("%s/%s: %v", h.NS, h.Iface, err)
		}
	}
	want := map[string]string{
		"pod-a": "10.244.1.10 169.254.1.1 " + nb.NodeNS(), "pod-b": "10.244.1.11 169.254.1.1 " + nb.NodeNS(),
		"pod-c": "10.244.1.130 10.244.1.129 " + nb.NodeNS(), "n2-pod-a": "10.244.2.10 169.254.1.1 " + nb.Node2NS(),
		"n2-pod-b": "10.244.2.11 169.254.1.1 " + nb.Node2NS(),
	}
	for name, w := range want {
		p := nb.Pod(name)
		if got := fmt.Sprintf("%s %s %s", p.Addr, p.Gateway, p.NodeNS); got != w || p.Name != name {
			t.Errorf("pod %s: %s, want %s", name, got, w)
		}
	}

	// Queues on both ends of the node's link, counted as sysfs does.
	out, err := nb.Exec(nb.NodeNS(), "sh", "-c", "ls -d /sys/class/net/eth0/queues/rx-* /sys/class/net/eth0/queues/tx-* | wc -l; cat /proc/sys/net/ipv4/ip_forward /proc/sys/net/ipv4/conf/eth0/send_redirects")
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(out)); strings.Join(f, " ") != "8 1 0" {
		t.Errorf("node: queues, ip_forward, send_redirects = %v, want 8 1 0", f)
	}
	out, err = nb.Exec(nb.LANNS(), "sh", "-c", "ls -d /sys/class/net/node/queues/tx-* | wc -l")
	if err != nil || strings.TrimSpace(string(out)) != "4" {
		t.Errorf("lan port node: %q tx queues, want 4 (%v)", out, err)
	}
	// The routed pod's gateway is a permanent neighbour with its veth's MAC.
	out, err = nb.Exec(nb.Pod("pod-a").NS, "ip", "neigh", "show", "169.254.1.1")
	if err != nil || !strings.Contains(string(out), nb.Pod("pod-a").HostMAC.String()) || !strings.Contains(string(out), "PERMANENT") {
		t.Errorf("pod-a neighbour 169.254.1.1: %q, %v", out, err)
	}
}

// testNodePaths runs ping, HTTP and UDP echo along the topology's paths.
func testNodePaths(t *testing.T, nb *NodeBed) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A server of the node itself (a host process), for the pods to reach.
	var nodeSrv *testserver.Server
	err := nb.Do(nb.NodeNS(), func() (err error) {
		nodeSrv, err = testserver.Listen(testserver.Config{Name: "the-node", HTTPAddr: ":80", UDPAddr: ":53"})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer nodeSrv.Close()

	type path struct {
		from string
		to   netip.Addr
		name string // what the server there answers
	}
	podA, client := nb.Pod("pod-a").NS, nb.ClientNS()
	paths := []path{
		{podA, nb.Pod("pod-b").Addr, "pod-b"}, // routed to routed
		{podA, nb.Pod("pod-c").Addr, "pod-c"}, // routed to cni0
		{nb.Pod("pod-c").NS, nb.Pod("pod-a").Addr, "pod-a"},
		{podA, nb.Pod("n2-pod-a").Addr, "n2-pod-a"}, // to the other node over the LAN
		{nb.Pod("n2-pod-b").NS, nb.Pod("pod-b").Addr, "pod-b"},
		{podA, nb.Client().Addr, "client"},      // off the cluster
		{podA, nb.Node().Addr, "the-node"},      // to its own node
		{client, nb.Pod("pod-a").Addr, "pod-a"}, // routed through the node
		{client, nb.Pod("pod-c").Addr, "pod-c"},
		{client, nb.Pod("n2-pod-a").Addr, "n2-pod-a"}, // through the node, then node2
		{nb.NodeNS(), nb.Client().Addr, "client"},     // the node's own outbound traffic
		{nb.NodeNS(), nb.Pod("n2-pod-b").Addr, "n2-pod-b"},
	}
	for _, p := range paths {
		if err := nb.Ping(p.from, p.to, 3*time.Second); err != nil {
			t.Errorf("ping %s from %s: %v", p.to, p.from, err)
		}
		resp, err := nb.HTTPClient(p.from, 5*time.Second).Get("http://" + p.to.String() + "/")
		if err != nil {
			t.Errorf("GET %s from %s: %v", p.to, p.from, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != p.name {
			t.Errorf("GET %s from %s = %q, want %q", p.to, p.from, body, p.name)
		}
		c, err := nb.Dial(ctx, p.from, "udp", net.JoinHostPort(p.to.String(), strconv.Itoa(UDPPort)))
		if err != nil {
			t.Fatal(err)
		}
		name, err := testserver.Echo(c, "hello", 3*time.Second)
		c.Close()
		if err != nil || name != p.name {
			t.Errorf("UDP echo of %s from %s = %q, %v; want %q", p.to, p.from, name, err, p.name)
		}
	}
}

// testNodeQueues sends flows from many client ports through the node and
// finds them on more than one rx queue of its eth0. A veth counts per
// queue only on its NAPI path, which an XDP program turns on.
func testNodeQueues(t *testing.T, nb *NodeBed) {
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	var xdp link.Link
	err = nb.Do(nb.NodeNS(), func() (err error) {
		xdp, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: nb.Node().IfIndex, Flags: link.XDPDriverMode})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer xdp.Close()
	before, err := RxQueuePackets(nb.NodeNS(), nb.NIC())
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != nb.Queues() {
		t.Fatalf("%d rx queue counters, want %d", len(before), nb.Queues())
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const flows = 16
	for i := range flows {
		c, err := nb.Dial(ctx, nb.ClientNS(), "udp", net.JoinHostPort(nb.Pod("pod-a").Addr.String(), strconv.Itoa(UDPPort)))
		if err != nil {
			t.Fatal(err)
		}
		name, err := testserver.Echo(c, fmt.Sprintf("flow %d", i), 3*time.Second)
		c.Close()
		if err != nil || name != "pod-a" {
			t.Errorf("flow %d with XDP on the node: %q, %v", i, name, err)
		}
	}
	after, err := RxQueuePackets(nb.NodeNS(), nb.NIC())
	if err != nil {
		t.Fatal(err)
	}
	used, total := 0, uint64(0)
	for q := range after {
		if d := after[q] - before[q]; d > 0 {
			used++
			total += d
		}
	}
	if used < 2 || total < flows {
		t.Errorf("%d flows from the client went to %d rx queue(s) (%v -> %v), want at least 2 queues and %d packets",
			flows, used, before, after, flows)
	}
}

// testNodeProcesses starts processes with Start and StartInCgroup and
// checks their namespace, their cgroup and that they see the host's /sys.
func testNodeProcesses(t *testing.T, nb *NodeBed) {
	pod := nb.Pod("pod-a")
	cgName := "/" + nb.ID()

	cmd := exec.Command("sleep", "30")
	if err := nb.StartInCgroup(pod.NS, cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	pid := cmd.Process.Pid
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if !strings.Contains(string(cg), "0::"+cgName+"\n") {
		t.Errorf("process %d in cgroups\n%s\nwant 0::%s", pid, cg, cgName)
	}
	if same, err := sameNetns(pid, pod.NS); err != nil || !same {
		t.Errorf("process %d not in %s: %v", pid, pod.NS, err)
	}
	pids, err := cgroupPIDs(nb.Cgroup())
	found := false
	for _, p := range pids {
		found = found || p == pid
	}
	if err != nil || !found {
		t.Errorf("cgroup.procs %v (%v) lacks %d", pids, err, pid)
	}
	// The servers of the node's pods run in the cgroup, the others not.
	for _, s := range nb.servers {
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", s.cmd.Process.Pid))
		in := strings.Contains(string(cg), "0::"+cgName+"\n")
		if want := strings.HasPrefix(s.spec.name, "pod-"); in != want {
			t.Errorf("server %s in the cgroup: %v, want %v", s.spec.name, in, want)
		}
	}

	// Without "ip netns exec", /sys stays the host's: the cgroup tree is
	// there, and the process is in the namespace.
	var out strings.Builder
	check := exec.Command("sh", "-c", "cat /proc/self/cgroup; test -d "+nb.Cgroup()+" && echo cgroup-visible; readlink /proc/self/ns/net")
	check.Stdout, check.Stderr = &out, &out
	if err := RunIn(nb.NodeNS(), check); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join("/run/netns", nb.NodeNS()), &st); err != nil {
		t.Fatal(err)
	}
	if s := out.String(); !strings.Contains(s, "cgroup-visible") || !strings.Contains(s, fmt.Sprintf("net:[%d]", st.Ino)) ||
		strings.Contains(s, "0::"+cgName) {
		t.Errorf("process run with RunIn in the node saw:\n%s", s)
	}

	_ = cmd.Process.Kill()
	<-done
}

// sameNetns says whether process pid is in the named namespace.
func sameNetns(pid int, ns string) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &a); err != nil {
		return false, err
	}
	if err := unix.Stat(filepath.Join("/run/netns", ns), &b); err != nil {
		return false, err
	}
	return a.Dev == b.Dev && a.Ino == b.Ino, nil
}

// testNodeSlowProtocols uses the delayed UDP echo and the TCP ticks over
// paths that cross the node.
func testNodeSlowProtocols(t *testing.T, nb *NodeBed) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := nb.Dial(ctx, nb.ClientNS(), "udp", net.JoinHostPort(nb.Pod("n2-pod-a").Addr.String(), strconv.Itoa(UDPPort)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	name, err := testserver.EchoDelayed(c, 500*time.Millisecond, "late", 5*time.Second)
	if took := time.Since(start); err != nil || name != "n2-pod-a" || took < 500*time.Millisecond {
		t.Errorf("delayed echo = %q, %v after %v", name, err, took)
	}

	tc, err := nb.Dial(ctx, nb.Pod("pod-c").NS, "tcp", net.JoinHostPort(nb.Client().Addr.String(), strconv.Itoa(StreamPort)))
	if err != nil {
		t.Fatal(err)
	}
	ticks, err := testserver.StartTicks(tc, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer ticks.Close()
	for want := int64(1); want <= 3; want++ {
		seq, name, err := ticks.Next(3 * time.Second)
		if err != nil || seq != want || name != "client" {
			t.Fatalf("tick %d = %d %q, %v", want, seq, name, err)
		}
	}
}

// TestNodeCloseRemovesEverything builds a node topology with servers and a
// process in its cgroup, closes it and looks for leftovers.
func TestNodeCloseRemovesEverything(t *testing.T) {
	nb := NewNodeForTest(t, NodeOptions{Queues: 2, MTU: 1400, RPFilter: 2})
	out, err := nb.Exec(nb.NodeNS(), "sh", "-c", "cat /proc/sys/net/ipv4/conf/eth0/rp_filter /sys/class/net/eth0/mtu; ls -d /sys/class/net/eth0/queues/rx-* | wc -l")
	if f := strings.Fields(string(out)); err != nil || strings.Join(f, " ") != "2 1400 2" {
		t.Errorf("node rp_filter, mtu, rx queues = %v (%v), want 2 1400 2", f, err)
	}
	if err := nb.StartServers(); err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, s := range nb.servers {
		pids = append(pids, s.cmd.Process.Pid)
	}
	// A process in the cgroup but in another namespace (the client's) and
	// one that no Wait reaps: Close must still remove the cgroup.
	stray := exec.Command("sleep", "60")
	if err := nb.StartInCgroup(nb.ClientNS(), stray); err != nil {
		t.Fatal(err)
	}
	pids = append(pids, stray.Process.Pid)
	if err := nb.Close(); err != nil {
		t.Fatal(err)
	}
	listed := netnsList(t)
	for _, ns := range nb.Namespaces() {
		if strings.Contains(listed, ns) {
			t.Errorf("namespace %s still listed after Close", ns)
		}
	}
	if _, err := os.Stat(nb.Cgroup()); !os.IsNotExist(err) {
		t.Errorf("cgroup %s still there after Close: %v", nb.Cgroup(), err)
	}
	for _, pid := range pids {
		if processAlive(pid) && !isZombie(pid) {
			t.Errorf("process %d still runs after Close", pid)
		}
	}
	_ = stray.Wait()
	if err := nb.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestServeHookMissing starts "servers" from programs that do not call
// ServeIfRequested and wants the error that says so, quickly.
func TestServeHookMissing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root; make test runs as root")
	}
	id, err := newID()
	if err != nil {
		t.Fatal(err)
	}
	ns := id + "-hook"
	h, err := newNamespace(ns)
	if err != nil {
		t.Fatal(err)
	}
	h.close()
	t.Cleanup(func() { _ = deleteNamespace(ns) })

	dir := t.TempDir()
	script := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// The scripts get a short timeout, so that the one that never says
	// it is ready fails quickly; the real server keeps the default, which
	// a loaded machine or the race detector needs.
	defer func(d time.Duration) { serverReadyTimeout = d }(serverReadyTimeout)
	realTimeout := serverReadyTimeout
	for _, c := range []struct {
		name, binary string
		hook         bool // the error is ErrNoServeHook
	}{
		{"exits at once", script("exits", "echo 'usage: prog [flags]' >&2; exit 2"), true},
		{"prints something else", script("prints", "echo PASS; exec sleep 5"), true},
		{"ignores the marker", script("sleeps", "exec sleep 30"), true},
		{"server fails", script("fails", "echo 'xdproxy-testserver failed: listen tcp :80: address already in use'; exit 1"), false},
		{"a real server", "", false},
	} {
		serverReadyTimeout = 500 * time.Millisecond
		if c.binary == "" {
			serverReadyTimeout = realTimeout
		}
		start := time.Now()
		servers, err := startServers(c.binary, []serverSpec{{ns: ns, name: "x"}})
		took := time.Since(start)
		if c.binary == "" {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			stopServers(servers)
			continue
		}
		if err == nil {
			stopServers(servers)
			t.Errorf("%s: no error", c.name)
			continue
		}
		if errors.Is(err, ErrNoServeHook) != c.hook || !strings.Contains(err.Error(), "server x") {
			t.Errorf("%s: %v", c.name, err)
		}
		if took > 3*time.Second {
			t.Errorf("%s: took %v", c.name, took)
		}
	}

	// A process started as a server that went on to build a testbed is
	// told why it may not.
	t.Setenv(serveEnv, "1")
	if _, err := NewNode(NodeOptions{}); !errors.Is(err, ErrNoServeHook) {
		t.Errorf("NewNode in a server process: %v", err)
	}
	if _, err := New(Options{}); !errors.Is(err, ErrNoServeHook) {
		t.Errorf("New in a server process: %v", err)
	}
}
