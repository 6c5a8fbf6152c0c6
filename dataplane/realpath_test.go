package dataplane

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// TestRealPathIdleModes measures the worker's idle strategies on the real
// path: the real Kernel and Engine on veths in namespaces, fed by an
// AF_XDP generator, counted by an XDP sink. It runs only when
// XDPROXY_REALPATH=1 (root; a few minutes):
//
//	gen ns          node ns (the engine)                    sink ns
//	g0 198.18.0.2 - n0 198.18.0.1     n1 198.18.1.1 - s0 198.18.1.2
//	CPU 0: generator, s0's NAPI    CPU 1: the worker, n0's NAPI (threaded)
//
// UDP to the service 198.19.0.1:80 (1,000 flows from one pod address, no
// masquerade) is translated to 198.18.1.2:8080 and counted on s0. For each
// mode: the CPU time per delivered packet at fixed rates (the worker's
// thread and n0's NAPI thread, from their schedstat: what forwarding costs
// on CPU 1, without the other tenants of a shared machine), the poll()
// wake-ups per batch, the zero-loss rate (loss <= 0.1%, bisection), and the
// worker thread's CPU over XDPROXY_IDLE_SECONDS (default 10) without
// traffic. The modes are in realPathModes.
func TestRealPathIdleModes(t *testing.T) {
	if os.Getenv("XDPROXY_REALPATH") != "1" {
		t.Skip("XDPROXY_REALPATH=1 runs the real-path measurement")
	}
	needRoot(t)
	rates := []int{50_000, 100_000, 200_000}
	if s := os.Getenv("XDPROXY_REALPATH_RATES"); s != "" {
		rates = rates[:0]
		for _, f := range strings.Split(s, ",") {
			r, _ := strconv.Atoi(f)
			rates = append(rates, r)
		}
	}
	idle := 10
	if s, err := strconv.Atoi(os.Getenv("XDPROXY_IDLE_SECONDS")); err == nil {
		idle = s
	}
	rounds := 3
	if s, err := strconv.Atoi(os.Getenv("XDPROXY_REALPATH_ROUNDS")); err == nil {
		rounds = s
	}
	top := newRealTopo(t)
	modes := realPathModes()
	// cost[mode][rate] are the per-round figures; interleaved by round so
	// that a noisy minute hits every mode alike.
	type result struct{ cpuPerPkt, wakePerBatch, loss []float64 }
	res := map[string]map[int]*result{}
	zeroLoss := map[string][]float64{}
	idleShare := map[string][]float64{}
	for round := range rounds {
		for _, m := range modes {
			e, w := top.startEngine(t, m)
			if res[m.name] == nil {
				res[m.name] = map[int]*result{}
			}
			top.trial(t, w, 100_000, time.Second) // warm up: neighbours, flows
			for _, r := range rates {
				tr := top.trial(t, w, r, 3*time.Second)
				x := res[m.name][r]
				if x == nil {
					x = &result{}
					res[m.name][r] = x
				}
				x.cpuPerPkt = append(x.cpuPerPkt, tr.cpuPerPkt())
				x.wakePerBatch = append(x.wakePerBatch, tr.wakePerBatch())
				x.loss = append(x.loss, tr.loss())
				t.Logf("round %d %-22s %7d pps: %s", round, m.name, r, tr)
			}
			zl := top.zeroLossRate(t, w)
			zeroLoss[m.name] = append(zeroLoss[m.name], float64(zl))
			t.Logf("round %d %-22s zero-loss rate %d pps", round, m.name, zl)
			if round == 0 && idle > 0 {
				sh := top.idleShare(t, w, time.Duration(idle)*time.Second)
				idleShare[m.name] = append(idleShare[m.name], sh)
				t.Logf("%-22s idle for %ds: worker thread %.4f%% of a CPU", m.name, idle, 100*sh)
			}
			e.Close()
		}
	}
	t.Logf("medians over %d rounds (CPU per delivered packet = worker thread + n0 NAPI thread):", rounds)
	for _, m := range modes {
		line := fmt.Sprintf("%-22s", m.name)
		for _, r := range rates {
			x := res[m.name][r]
			line += fmt.Sprintf(" | %dk: %.0f ns/pkt, %.2f wake/batch, loss %.2f%%", r/1000,
				median(x.cpuPerPkt), median(x.wakePerBatch), 100*median(x.loss))
		}
		line += fmt.Sprintf(" | zero-loss %.0f kpps", median(zeroLoss[m.name])/1000)
		if len(idleShare[m.name]) > 0 {
			line += fmt.Sprintf(" | idle %.4f%%", 100*median(idleShare[m.name]))
		}
		t.Log(line)
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// realPathMode is one way to run the workers.
type realPathMode struct {
	name   string
	tweak  func(*EngineConfig)
	socket func(*afxdp.Config)
}

func (m realPathMode) neverSleeps() bool {
	var c EngineConfig
	if m.tweak != nil {
		m.tweak(&c)
	}
	return c.BusyPoll
}

func realPathModes() []realPathMode {
	return []realPathMode{
		{name: "io-floor", tweak: func(c *EngineConfig) {
			c.IOFloor = &IOFloor{Peers: []packet.Addr{packet.AddrFrom4([4]byte{198, 18, 1, 2}), packet.AddrFrom4([4]byte{198, 18, 0, 2})}}
		}},
		{name: "poll+adaptive-spin"},
		{name: "busy-poll-socket", socket: func(c *afxdp.Config) { c.BusyPoll = 50 * time.Microsecond; c.BusyPollBudget = 64 }},
		{name: "busy-poll-never-sleep", tweak: func(c *EngineConfig) { c.BusyPoll = true },
			socket: func(c *afxdp.Config) { c.BusyPoll = 50 * time.Microsecond; c.BusyPollBudget = 64 }},
	}
}

// realTopo is the three namespaces, the generator and the sink.
type realTopo struct {
	gen, node, sink string
	n0MAC, g0MAC    net.HardwareAddr
	gsock           *afxdp.Socket
	frames          [][]byte
	sinkMap         *ebpf.Map
	napiPID         int // n0's NAPI thread
}

func newRealTopo(t *testing.T) *realTopo {
	t.Helper()
	top := &realTopo{}
	for _, p := range []*string{&top.gen, &top.node, &top.sink} {
		*p = fmt.Sprintf("xdrp-%d-%d", os.Getpid(), nsSeq.Add(1))
		sh(t, "ip", "netns", "add", *p)
		ns := *p
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	}
	sh(t, "ip", "link", "add", "g0", "netns", top.gen, "type", "veth", "peer", "n0", "netns", top.node)
	sh(t, "ip", "link", "add", "n1", "netns", top.node, "type", "veth", "peer", "s0", "netns", top.sink)
	for _, c := range [][]string{
		{top.gen, "198.18.0.2/24", "g0"}, {top.node, "198.18.0.1/24", "n0"},
		{top.node, "198.18.1.1/24", "n1"}, {top.sink, "198.18.1.2/24", "s0"},
	} {
		sh(t, "ip", "-n", c[0], "addr", "add", c[1], "dev", c[2])
		sh(t, "ip", "-n", c[0], "link", "set", c[2], "up")
	}
	sh(t, "ip", "-n", top.gen, "route", "add", "198.19.0.0/16", "via", "198.18.0.1")
	top.n0MAC = linkMAC(t, top.node, "n0")
	top.g0MAC = linkMAC(t, top.gen, "g0")
	s0MAC := linkMAC(t, top.sink, "s0")
	sh(t, "ip", "-n", top.node, "neigh", "replace", "198.18.1.2", "lladdr", s0MAC.String(), "dev", "n1", "nud", "permanent")

	// The sink: count and drop IPv4 on s0 (native XDP: s0's NAPI).
	inNetns(t, top.sink, func() error {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 1})
		if err != nil {
			return err
		}
		top.sinkMap = m
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL", Instructions: asm.Instructions{
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, m.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "drop"),
			asm.LoadMem(asm.R1, asm.R0, 0, asm.DWord),
			asm.Add.Imm(asm.R1, 1),
			asm.StoreMem(asm.R0, 0, asm.R1, asm.DWord),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("drop"), // XDP_DROP
			asm.Return(),
		}})
		if err != nil {
			return err
		}
		ifc, err := net.InterfaceByName("s0")
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifc.Index, Flags: link.XDPDriverMode})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close(); prog.Close(); m.Close() })
		return nil
	})
	// NAPI: n0's receive work (XDP, the copy into the socket) on CPU 1
	// with the worker, the sink's on CPU 0 with the generator.
	// A veth has a NAPI instance only with XDP or GRO on; GRO keeps n0's
	// across the engine's attaches and detaches.
	sh(t, "ip", "netns", "exec", top.node, "ethtool", "-K", "n0", "gro", "on")
	sh(t, "ip", "netns", "exec", top.node, "sh", "-c", "echo 1 > /sys/class/net/n0/threaded")
	sh(t, "ip", "netns", "exec", top.sink, "sh", "-c", "echo 1 > /sys/class/net/s0/threaded")
	top.napiPID = pinNAPI(t, "n0", 1)
	sinkNAPI := pinNAPI(t, "s0", 0)
	if realTime() {
		// Other tenants' work on a shared machine must not decide the
		// figures: the NAPI threads run as real-time threads above the
		// worker and the generator, as a softirq would preempt them.
		for _, pid := range []int{top.napiPID, sinkNAPI} {
			sh(t, "chrt", "-f", "-p", "20", strconv.Itoa(pid))
		}
	}

	// The generator: an AF_XDP socket on g0, frames prebuilt.
	inNetns(t, top.gen, func() error {
		ifc, err := net.InterfaceByName("g0")
		if err != nil {
			return err
		}
		cfg := afxdp.DefaultConfig()
		cfg.Mode = afxdp.Copy
		top.gsock, err = afxdp.Open(ifc.Index, 0, cfg)
		return err
	})
	t.Cleanup(func() { top.gsock.Close() })
	for f := range 1000 {
		top.frames = append(top.frames, udpFrame(top.g0MAC, top.n0MAC, [4]byte{198, 18, 0, 2}, [4]byte{198, 19, 0, 1}, uint16(10000+f), 80))
	}
	return top
}

func linkMAC(t *testing.T, ns, name string) net.HardwareAddr {
	t.Helper()
	var mac net.HardwareAddr
	inNetns(t, ns, func() error {
		ifc, err := net.InterfaceByName(name)
		if err == nil {
			mac = ifc.HardwareAddr
		}
		return err
	})
	return mac
}

// realTime says whether the measurement runs its threads real-time
// (SCHED_FIFO; XDPROXY_REALPATH_RT=0 turns it off).
func realTime() bool { return os.Getenv("XDPROXY_REALPATH_RT") != "0" }

// setFIFO makes thread tid SCHED_FIFO at prio.
func setFIFO(t *testing.T, tid, prio int) {
	t.Helper()
	sh(t, "chrt", "-f", "-p", strconv.Itoa(prio), strconv.Itoa(tid))
}

// pinNAPI pins the threaded NAPI kthread of dev to cpu and returns its pid.
func pinNAPI(t *testing.T, dev string, cpu int) int {
	t.Helper()
	out := sh(t, "ps", "-e", "-o", "pid=,comm=")
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) == 2 && strings.HasPrefix(f[1], "napi/"+dev+"-") {
			sh(t, "taskset", "-pc", strconv.Itoa(cpu), f[0])
			pid, _ := strconv.Atoi(f[0])
			return pid
		}
	}
	t.Fatalf("no NAPI thread for %s", dev)
	return 0
}

// inNetns runs fn on a thread that entered ns; the thread is discarded.
func inNetns(t *testing.T, ns string, fn func() error) {
	t.Helper()
	if err := inNamespace(ns, fn); err != nil {
		t.Fatalf("in %s: %v", ns, err)
	}
}

// udpFrame is a 60-byte Ethernet/IPv4/UDP frame with valid checksums.
func udpFrame(src, dst net.HardwareAddr, sip, dip [4]byte, sport, dport uint16) []byte {
	f := make([]byte, 60)
	copy(f[0:6], dst)
	copy(f[6:12], src)
	f[12], f[13] = 0x08, 0x00
	ip := f[14:34]
	ip[0], ip[8], ip[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(ip[2:], 46)
	copy(ip[12:16], sip[:])
	copy(ip[16:20], dip[:])
	binary.BigEndian.PutUint16(ip[10:], nat.Checksum(ip, 0))
	u := f[34:60]
	binary.BigEndian.PutUint16(u[0:], sport)
	binary.BigEndian.PutUint16(u[2:], dport)
	binary.BigEndian.PutUint16(u[4:], 26)
	ps := nat.PseudoHeaderSum(packet.AddrFrom4(sip), packet.AddrFrom4(dip), packet.ProtoUDP, 26)
	binary.BigEndian.PutUint16(u[6:], nat.Checksum(u, ps))
	return f
}

// startEngine runs the engine in the node namespace in mode m, its worker
// on CPU 1, with the one service.
func (top *realTopo) startEngine(t *testing.T, m realPathMode) (*Engine, *Worker) {
	t.Helper()
	sc := afxdp.DefaultConfig()
	sc.Mode = afxdp.Copy
	if m.socket != nil {
		m.socket(&sc)
	}
	var e *Engine
	inNetns(t, top.node, func() error {
		k, err := NewKernel(KernelOptions{Interfaces: []string{"n0", "n1"}, Tables: xdp.Options{MaxFlows: 1 << 16}, Log: quietLog()})
		if err != nil {
			return err
		}
		cfg := EngineConfig{
			Kernel: k,
			Interfaces: []InterfaceConfig{
				{Name: "n0", Queues: []int{0}, CPUs: []int{1}, Mode: xdp.Native, Socket: sc},
				{Name: "n1", Queues: []int{0}, CPUs: []int{1}, Mode: xdp.Native, Socket: sc},
			},
			BatchSize: 64,
			Conntrack: conntrack.Config{Capacity: 1 << 16},
			SNATPorts: conntrack.PortRange{First: 61000, Last: 65535},
			Log:       quietLog(),
		}
		if m.tweak != nil {
			m.tweak(&cfg)
		}
		e, err = Start(cfg)
		return err
	})
	model := &service.Model{Node: service.Node{Name: "node-1"}, Ports: []service.ServicePort{{
		Name: service.PortName{Namespace: "bench", Name: "svc"}, Proto: packet.ProtoUDP,
		ClusterIPs: []packet.Addr{packet.AddrFrom4([4]byte{198, 19, 0, 1})}, Port: 80,
		Endpoints: []service.Endpoint{{Addr: packet.AddrFrom4([4]byte{198, 18, 1, 2}), Port: 8080, Ready: true, Serving: true}},
	}}}
	if err := e.Publish(service.Compile(model, service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/16")}})); err != nil {
		e.Close()
		t.Fatal(err)
	}
	var w0 *Worker
	for _, w := range e.Workers() {
		await(t, "the worker", func() bool { return w.TID() != 0 })
		// A worker that never sleeps stays an ordinary thread: as a
		// real-time one it would eat the real-time budget its NAPI
		// thread and the generator need (the kernel throttles
		// real-time threads at 95% of the CPUs, borrowing across them).
		if realTime() && !m.neverSleeps() {
			setFIFO(t, w.TID(), 10)
		}
		if w.Port().Name == "n0" {
			w0 = w
		}
	}
	if w0 != nil {
		return e, w0
	}
	e.Close()
	t.Fatal("no worker on n0")
	return nil, nil
}

// trialResult is one run of traffic at a fixed rate.
type trialResult struct {
	rate             int
	sent, received   uint64
	workerNs, napiNs int64
	wakeups, batches uint64
	dur              time.Duration
}

func (r trialResult) cpuPerPkt() float64 {
	return float64(r.workerNs+r.napiNs) / float64(max(r.received, 1))
}
func (r trialResult) wakePerBatch() float64 { return float64(r.wakeups) / float64(max(r.batches, 1)) }
func (r trialResult) loss() float64 {
	if r.sent == 0 {
		return 1
	}
	return float64(int64(r.sent)-int64(r.received)) / float64(r.sent)
}

func (r trialResult) String() string {
	return fmt.Sprintf("sent %d received %d (loss %.3f%%), worker %.0f ns/pkt + NAPI %.0f ns/pkt = %.0f, %d batches (%.1f pkt/batch), %.2f wake-ups/batch",
		r.sent, r.received, 100*r.loss(), float64(r.workerNs)/float64(max(r.received, 1)), float64(r.napiNs)/float64(max(r.received, 1)),
		r.cpuPerPkt(), r.batches, float64(r.received)/float64(max(r.batches, 1)), r.wakePerBatch())
}

// schedNs is a thread's run time from /proc/<pid>/task/<tid>/schedstat.
func schedNs(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ns, _ := strconv.ParseInt(strings.Fields(string(b))[0], 10, 64)
	return ns
}

func (top *realTopo) sinkCount(t *testing.T) uint64 {
	t.Helper()
	var per []uint64
	if err := top.sinkMap.Lookup(uint32(0), &per); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, v := range per {
		n += v
	}
	return n
}

// trial sends at rate pps for d from CPU 0 and measures.
func (top *realTopo) trial(t *testing.T, w *Worker, rate int, d time.Duration) trialResult {
	t.Helper()
	wpath := fmt.Sprintf("/proc/self/task/%d/schedstat", w.TID())
	npath := fmt.Sprintf("/proc/%d/schedstat", top.napiPID)
	r := trialResult{rate: rate, dur: d}
	c0 := w.Counters.Snapshot()
	s0, w0, n0 := top.sinkCount(t), schedNs(t, wpath), schedNs(t, npath)
	r.sent = top.send(rate, d)
	time.Sleep(100 * time.Millisecond) // what is in flight arrives
	c1 := w.Counters.Snapshot()
	r.received = top.sinkCount(t) - s0
	r.workerNs, r.napiNs = schedNs(t, wpath)-w0, schedNs(t, npath)-n0
	r.wakeups, r.batches = c1.Wakeups-c0.Wakeups, c1.Batches-c0.Batches
	if os.Getenv("XDPROXY_REALPATH_DIAG") == "1" && r.loss() > 0.001 {
		st, _ := w.Port().Sock.Stats()
		t.Logf("loss diagnosis: worker drops %v; n0 socket %+v", c1.ByReason, st)
		for _, c := range [][]string{{top.node, "n0"}, {top.node, "n1"}, {top.sink, "s0"}, {top.gen, "g0"}} {
			out, _ := exec.Command("ip", "netns", "exec", c[0], "ethtool", "-S", c[1]).CombinedOutput()
			var keep []string
			for _, l := range strings.Split(string(out), "\n") {
				if f := strings.Fields(l); len(f) == 2 && f[1] != "0" && (strings.Contains(l, "drop") || strings.Contains(l, "xdp") || strings.Contains(l, "full") || strings.Contains(l, "err")) {
					keep = append(keep, strings.Join(f, ""))
				}
			}
			t.Logf("  %s: %s", c[1], strings.Join(keep, " "))
		}
	}
	return r
}

// send transmits rate frames per second for d, paced in bursts of 32, on
// a thread pinned to CPU 0, and returns how many went out.
func (top *realTopo) send(rate int, d time.Duration) uint64 {
	done := make(chan uint64)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var set unix.CPUSet
		set.Set(0)
		_ = unix.SchedSetaffinity(0, &set)
		if realTime() {
			p := struct{ prio int32 }{10}
			unix.Syscall(unix.SYS_SCHED_SETSCHEDULER, 0, 1 /* SCHED_FIFO */, uintptr(unsafe.Pointer(&p)))
			defer func() {
				p.prio = 0
				unix.Syscall(unix.SYS_SCHED_SETSCHEDULER, 0, 0 /* SCHED_OTHER */, uintptr(unsafe.Pointer(&p)))
			}()
		}
		s := top.gsock
		const burst = 32
		descs := make([]afxdp.Desc, 0, burst)
		interval := time.Duration(int64(time.Second) * burst / int64(rate))
		start := time.Now()
		var sent uint64
		next := start
		f := 0
		for time.Since(start) < d {
			for time.Now().Before(next) {
			}
			next = next.Add(interval)
			s.Complete()
			descs = descs[:0]
			for range burst {
				dd, ok := s.Alloc()
				if !ok {
					break
				}
				n := copy(s.Frame(afxdp.Desc{Addr: dd.Addr, Len: 60}), top.frames[f%len(top.frames)])
				dd.Len = uint32(n)
				descs = append(descs, dd)
				f++
			}
			n := s.Transmit(descs)
			for _, dd := range descs[n:] {
				s.Release(dd)
			}
			sent += uint64(n)
		}
		for range 100 {
			s.Transmit(nil)
			s.Complete()
		}
		done <- sent
	}()
	return <-done
}

// zeroLossRate bisects the highest rate (25 kpps steps, up to 800 kpps)
// that loses at most 0.1% in 2 s trials.
func (top *realTopo) zeroLossRate(t *testing.T, w *Worker) int {
	lo, hi := 0, 800_000
	for hi-lo > 25_000 {
		mid := (lo + hi) / 2
		tr := top.trial(t, w, mid, 2*time.Second)
		// The generator may not reach the rate: judge by what it sent.
		if tr.loss() <= 0.001 && float64(tr.sent) >= 0.95*float64(mid)*2 {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// idleShare is the share of a CPU the worker's thread uses over d without
// traffic.
func (top *realTopo) idleShare(t *testing.T, w *Worker, d time.Duration) float64 {
	path := fmt.Sprintf("/proc/self/task/%d/schedstat", w.TID())
	time.Sleep(time.Second) // the spin settles
	a, start := schedNs(t, path), time.Now()
	time.Sleep(d)
	return float64(schedNs(t, path)-a) / float64(time.Since(start))
}
