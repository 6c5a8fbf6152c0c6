package socklb

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// The privileged tests build this world, each its own copy:
//
//	pod netns (the client)              backend netns (the servers)
//	p0 10.201.0.1/24 fd00:201::1/64 --- b0 10.201.0.2-5/24 fd00:201::2-5/64
//
// Every backend address serves TCP and UDP on backendPort, answering with
// its own address:port. Service addresses (198.19.0.0/16, fd00:5e::/64)
// have no route in the pod netns, so a connect there that is not
// translated fails at once with ENETUNREACH. Clients are this test binary
// run again (TestMain, clientMain) in the pod netns, in the test's own
// cgroup v2 or outside it.

const backendPort = 8080

var (
	backend4 = []string{"10.201.0.2", "10.201.0.3", "10.201.0.4", "10.201.0.5"}
	backend6 = []string{"fd00:201::2", "fd00:201::3", "fd00:201::4", "fd00:201::5"}
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(clientEnv); spec != "" {
		os.Exit(clientMain(spec))
	}
	os.Exit(m.Run())
}

// requireRoot skips tests that need CAP_NET_ADMIN and CAP_BPF under -short
// and fails them otherwise.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("needs root: creates network namespaces and cgroups, loads BPF programs")
		}
		t.Fatal("needs root: creates network namespaces and cgroups, loads BPF programs")
	}
}

var seq atomic.Int32

func uniqueName(prefix string) string {
	return fmt.Sprintf("%s-%d-%d", prefix, os.Getpid(), seq.Add(1))
}

// newNetns creates a named network namespace that is deleted when the
// test ends, pass or fail.
func newNetns(t *testing.T) string {
	t.Helper()
	name := uniqueName("slbt")
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	run(t, "ip", "-n", name, "link", "set", "lo", "up")
	return name
}

func run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// inNetns runs fn on an OS thread in namespace ns. The thread stays locked
// when fn returns, so the runtime ends it instead of reusing it.
func inNetns(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(ns)
		if err != nil {
			errc <- err
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// cgroup2Root returns where cgroup v2 is mounted, from mountinfo.
func cgroup2Root(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		if f := strings.Fields(post); len(f) > 0 && f[0] == "cgroup2" {
			if g := strings.Fields(pre); len(g) >= 5 {
				return g[4]
			}
		}
	}
	t.Skip("no cgroup v2 mounted")
	return ""
}

// cgroup is a cgroup v2 of the test's own, removed when the test ends.
type cgroup struct {
	path string
	fd   int // for SysProcAttr.CgroupFD
}

func newCgroup(t *testing.T) *cgroup {
	t.Helper()
	path := filepath.Join(cgroup2Root(t), uniqueName("socklb-test"))
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(path, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		os.Remove(path)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(fd)
		// Its processes are gone (every client is waited for); retry
		// briefly in case the kernel has not let go of one yet.
		for i := 0; i < 50; i++ {
			if err := os.Remove(path); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", path)
	})
	return &cgroup{path: path, fd: fd}
}

// privateBPFFS mounts a bpffs instance of the test's own (each mount of
// bpffs is a separate instance) and unmounts it when the test ends.
func privateBPFFS(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, ""); err != nil {
		t.Fatalf("mounting a bpffs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return filepath.Join(dir, "socklb")
}

// world is a pod netns joined to a backend netns by a veth, with servers.
type world struct {
	pod, backend string
	cg           *cgroup
}

func newWorld(t *testing.T) *world {
	t.Helper()
	w := &world{pod: newNetns(t), backend: newNetns(t), cg: newCgroup(t)}
	run(t, "ip", "link", "add", "p0", "netns", w.pod, "type", "veth", "peer", "b0", "netns", w.backend)
	run(t, "ip", "-n", w.pod, "addr", "add", "10.201.0.1/24", "dev", "p0")
	run(t, "ip", "-n", w.pod, "addr", "add", "fd00:201::1/64", "dev", "p0", "nodad")
	for i := range backend4 {
		run(t, "ip", "-n", w.backend, "addr", "add", backend4[i]+"/24", "dev", "b0")
		run(t, "ip", "-n", w.backend, "addr", "add", backend6[i]+"/64", "dev", "b0", "nodad")
	}
	run(t, "ip", "-n", w.pod, "link", "set", "p0", "up")
	run(t, "ip", "-n", w.backend, "link", "set", "b0", "up")
	var addrs []string
	for i := range backend4 {
		addrs = append(addrs, backend4[i], backend6[i])
	}
	serve(t, w.backend, addrs, backendPort)
	return w
}

// serve starts, in netns ns, a TCP server and a UDP echo server on every
// addr:port; both answer with "addr:port" (the UDP one then "|" and the
// datagram). They stop when the test ends.
func serve(t *testing.T, ns string, addrs []string, port int) {
	t.Helper()
	var tcp []net.Listener
	var udp []net.PacketConn
	err := inNetns(ns, func() error {
		for _, a := range addrs {
			ap := netip.AddrPortFrom(netip.MustParseAddr(a), uint16(port)).String()
			l, err := net.Listen("tcp", ap)
			if err != nil {
				return err
			}
			tcp = append(tcp, l)
			u, err := net.ListenPacket("udp", ap)
			if err != nil {
				return err
			}
			udp = append(udp, u)
		}
		return nil
	})
	t.Cleanup(func() {
		for _, l := range tcp {
			l.Close()
		}
		for _, u := range udp {
			u.Close()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range tcp {
		go func() {
			id := []byte(l.Addr().String())
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Write(id)
				c.Close()
			}
		}()
	}
	for _, u := range udp {
		go func() {
			id := u.LocalAddr().String()
			buf := make([]byte, 1500)
			for {
				n, from, err := u.ReadFrom(buf)
				if err != nil {
					return
				}
				u.WriteTo([]byte(id+"|"+string(buf[:n])), from)
			}
		}()
	}
}

// ---- Clients ----

const clientEnv = "SOCKLB_TEST_CLIENT"

// clientSpec tells a client process what to do.
type clientSpec struct {
	// Mode: "tcp" connects, reads the server's id and closes; "udpconn"
	// connects a UDP socket, sends and receives; "udp" sends with
	// sendto and receives with recvfrom; "loop" runs tcp for Duration
	// from Workers goroutines; "bench" times connects (see TestConnectOverhead).
	Mode string
	// Family: "4", "6", or "mapped" (an AF_INET6 socket to the IPv4
	// address ::ffff:Addr).
	Family string
	Addr   string
	Port   int
	Count  int // attempts; 0 is 1
	// Reuse: in mode "udp", one socket for every attempt.
	Reuse    bool
	Duration time.Duration
	Workers  int
	// Direct is the backend address:port that mode "bench" also
	// connects to without the frontend.
	Direct string
}

// result is one attempt of a client.
type result struct {
	Err     string // errno name, "" when it worked
	Backend string // the server's id
	Peer    string // getpeername, or recvfrom's source
	From    string // recvfrom's source (udpconn)
	Start   int64  // CLOCK_MONOTONIC ns, around connect (tcp and loop)
	End     int64
	// Bench results (mode bench).
	Bench *benchResult `json:",omitempty"`
}

// benchResult has connect(2) times in ns, through the frontend and
// directly to the backend.
type benchResult struct {
	N             int
	VIP, Direct   benchStats
	Failed, Wrong int // connects that failed, or reached another backend
}

type benchStats struct {
	Median, Mean, P90 float64
}

// runClient runs a client in netns ns, inside the test's cgroup or not,
// and returns its results.
func (w *world) runClient(t *testing.T, ns string, inCgroup bool, spec clientSpec) []result {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(spec)
	cmd := exec.Command("ip", "netns", "exec", ns, exe)
	// Fewer signals to interrupt the client's blocking calls.
	cmd.Env = append(os.Environ(), clientEnv+"="+string(js), "GODEBUG=asyncpreemptoff=1")
	if inCgroup {
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: w.cg.fd}
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("client %+v: %v\n%s", spec, err, stderr.String())
	}
	var rs []result
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("client output %q: %v", sc.Text(), err)
		}
		rs = append(rs, r)
	}
	return rs
}

// one runs a client for one attempt and returns its result.
func (w *world) one(t *testing.T, ns string, inCgroup bool, spec clientSpec) result {
	t.Helper()
	rs := w.runClient(t, ns, inCgroup, spec)
	if len(rs) != 1 {
		t.Fatalf("client %+v: %d results, want 1", spec, len(rs))
	}
	return rs[0]
}

func addrPort(a string, port int) string {
	return netip.AddrPortFrom(netip.MustParseAddr(a), uint16(port)).String()
}

func frontend(vip string, port int, proto packet.Proto, backends ...string) Frontend {
	f := Frontend{Addr: packet.MustParseAddr(vip), Port: uint16(port), Proto: proto, ServiceID: 1}
	for _, b := range backends {
		f.Backends = append(f.Backends, Backend{Addr: packet.MustParseAddr(b), Port: backendPort})
	}
	return f
}

// loadAttach loads an LB with small tables, gives it fes and attaches it
// to the world's cgroup; it is closed when the test ends.
func (w *world) loadAttach(t *testing.T, opts Options, fes ...Frontend) *LB {
	t.Helper()
	if opts.MaxFrontends == 0 {
		opts = Options{MaxFrontends: 64, MaxBackends: 256, MaxAffinity: 256, MaxReverse: 4096,
			NodeNetnsCookie: opts.NodeNetnsCookie, PinDir: opts.PinDir}
	}
	lb, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lb.Close() })
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if err := lb.Attach(w.cg.path); err != nil {
		t.Fatal(err)
	}
	return lb
}

func counters(t *testing.T, lb *LB) Counters {
	t.Helper()
	c, err := lb.Counters()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// netnsCookieOf returns the netns cookie of ns.
func netnsCookieOf(t *testing.T, ns string) uint64 {
	t.Helper()
	var c uint64
	if err := inNetns(ns, func() (err error) {
		c, err = netnsCookie()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return c
}
