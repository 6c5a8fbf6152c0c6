package runner

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdproxy/xdproxy/bench/cpuacct"
	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/kubeproxy"
	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/search"
	"github.com/xdproxy/xdproxy/bench/sink"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// env is one variant's live setup: its topology, the programmed path, the
// sink and the probe of the forwarding threads.
type env struct {
	cfg     *Config
	t       *topo.Topology
	sink    *sink.Sink
	probe   cpuacct.Probe
	proc    *exec.Cmd     // xdproxy's dataplane process, if any
	procErr *bytes.Buffer // its stderr (the counters it prints on exit)
	setup   time.Duration
	dst     netip.Addr
	dsts    int
	dport   uint16
	closers []func() error
	set     kernelrules.ServiceSet
	limit   bool
	admin   string // the xdproxy binary's admin socket
	stats   string // its stats, read just before it was stopped
	note    string // about the setup, for the results' notes
}

// aim points the generator: at the node itself for the limit (its sink
// drops everything), at the sink without services, else at the services.
// Many flows are spread over min(flows, services, AddrsPerPort) cluster IPs; a
// single flow goes to the last service.
func (e *env) aim(services, flows int) {
	e.dst, e.dsts, e.dport = topo.SinkAddrs[0], 1, UDPEndpointPort
	if e.set.Proto == kernelrules.TCP {
		e.dport = TCPEndpointPort
	}
	switch {
	case e.limit:
		e.dst = topo.NodeInAddr
	case services > 0 && flows == 1:
		e.dst, e.dport = e.set.VIP(services-1), e.set.Port(services-1)
	case services > 0:
		e.dst, e.dsts, e.dport = e.set.VIP(0), min(flows, services, kernelrules.AddrsPerPort), e.set.Port(0)
	}
}

// stopXDProxy stops the dataplane process and returns the counters it
// printed on the way out ("" without one).
func (e *env) stopXDProxy() string {
	if e.proc == nil || e.proc.Process == nil {
		return ""
	}
	if e.admin != "" {
		out, err := exec.Command("ip", "netns", "exec", e.t.Node, e.cfg.XDProxyBin, "admin", "--socket", e.admin, "stats").Output()
		if err == nil {
			var v any
			if json.Unmarshal(out, &v) == nil {
				b, _ := json.Marshal(v)
				e.stats = "xdproxy admin stats: " + string(b)
			}
		}
	}
	_ = e.proc.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- e.proc.Wait() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = e.proc.Process.Kill()
		<-done
	}
	e.proc = nil
	for _, l := range strings.Split(e.procErr.String(), "\n") {
		if strings.HasPrefix(l, "xdproxy counters:") {
			return l
		}
	}
	var problems []string
	for _, l := range strings.Split(e.procErr.String(), "\n") {
		if strings.Contains(l, "level=ERROR") || strings.Contains(l, "level=WARN") || strings.HasPrefix(l, "xdproxy-bench:") || strings.HasPrefix(l, "xdproxy:") {
			problems = append(problems, l)
		}
	}
	if e.stats != "" {
		problems = append(problems, e.stats)
	}
	return tail(strings.Join(problems, "; "), 1500)
}

func (e *env) close() error {
	var errs []error
	if c := e.stopXDProxy(); c != "" && e.cfg.Verbose {
		e.cfg.Log.Printf("      %s", c)
	}
	for i := len(e.closers) - 1; i >= 0; i-- {
		errs = append(errs, e.closers[i]())
	}
	if e.sink != nil {
		errs = append(errs, e.sink.Close())
	}
	if e.t != nil {
		errs = append(errs, e.t.Close())
	}
	return errors.Join(errs...)
}

// attachSink puts the counter on iface in ns, with threaded NAPI pinned to
// cpu, and returns the NAPI thread PIDs.
func (e *env) attachSink(ns, iface string, cpu int) ([]int, error) {
	err := testbed.DoIn(ns, func() error {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			return err
		}
		e.sink, err = sink.Attach(l.Attrs().Index, sink.Native)
		return err
	})
	if err != nil {
		return nil, err
	}
	return e.threaded(ns, iface, cpu)
}

// threaded turns threaded NAPI on for iface and pins its kthreads to cpu.
func (e *env) threaded(ns, iface string, cpu int) ([]int, error) {
	pids, err := e.t.SetThreaded(ns, iface)
	if err != nil {
		return nil, err
	}
	if err := topo.Pin(cpu, pids...); err != nil {
		return nil, err
	}
	return pids, topo.SetNice(e.cfg.Nice, pids...)
}

// newEnv builds the topology and programs path. For paths with services
// the generator's destinations are spread over min(flows, services,
// 65536) cluster IPs; a single flow goes to the last service.
func newEnv(cfg *Config, path string, services, flows int, proto kernelrules.Proto) (_ *env, err error) {
	e := &env{cfg: cfg, limit: path == report.PathLimit}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.close())
		}
	}()
	if e.t, err = topo.New(topo.Options{}); err != nil {
		return nil, err
	}
	gen, fwd := cfg.Plan.GenCPU, cfg.Plan.ForwardCPU
	// Frames of the generator's interface must qualify for the peer's
	// NAPI (GRO) path: a veth with TSO on sends through the sender's
	// backlog instead. An XDP program on the peer turns it off anyway.
	if err := e.t.SetOffload(e.t.Gen, topo.GenIface, "tso", false); err != nil {
		return nil, err
	}
	if err := e.t.SetOffload(e.t.Sink, topo.SinkIface, "tso", false); err != nil {
		return nil, err
	}
	set := Services(max(services, 1), proto)
	if report.IsKubeProxy(path) {
		set.VIPBase = KubeProxyVIPBase
	}
	e.set = set
	e.aim(services, flows)
	var fwdThreads []int
	start := time.Now()
	switch path {
	case report.PathLimit:
		if fwdThreads, err = e.attachSink(e.t.Node, topo.NodeInIface, fwd); err != nil {
			return nil, err
		}
	case report.PathKernel, report.PathIPTables, report.PathNFTables:
		switch path {
		case report.PathIPTables:
			var buf bytes.Buffer
			if err := set.WriteIPTables(&buf); err != nil {
				return nil, err
			}
			if err := e.t.ExecInput(e.t.Node, buf.Bytes(), cfg.RulesTimeout, cfg.IPTablesRestore); err != nil {
				return nil, err
			}
		case report.PathNFTables:
			var buf bytes.Buffer
			if err := set.WriteNFT(&buf); err != nil {
				return nil, err
			}
			if err := e.t.ExecInput(e.t.Node, buf.Bytes(), cfg.RulesTimeout, "nft", "-f", "-"); err != nil {
				return nil, err
			}
		}
		e.setup = time.Since(start)
		if fwdThreads, err = e.kernelForwarding(); err != nil {
			return nil, err
		}
	case report.PathKubeProxyIPTables, report.PathKubeProxyNFTables:
		mode := kubeproxy.IPTables
		if path == report.PathKubeProxyNFTables {
			mode = kubeproxy.NFTables
		}
		kp, err := kubeproxy.Start(kubeproxy.Options{
			Mode: mode, Namespace: e.t.Node, Services: set, ClusterCIDR: topo.PodCIDR,
			NodeName: "bench-node", NodeAddr: topo.NodeInAddr, Bins: cfg.KubeBins, CPU: cfg.Plan.GenCPU, Timeout: cfg.RulesTimeout,
		})
		if err != nil {
			return nil, err
		}
		e.closers = append(e.closers, kp.Close)
		e.setup = kp.Programmed
		e.note = fmt.Sprintf("kube-proxy %s programmed %d services in %v after they were created through the API in %v.", mode, set.Count, kp.Programmed.Round(time.Millisecond), kp.Applied.Round(time.Millisecond))
		if fwdThreads, err = e.kernelForwarding(); err != nil {
			return nil, err
		}
	case report.PathXDProxy:
		launch := e.startXDProxy
		if cfg.XDProxyBin != "" {
			launch = func(services int, proto kernelrules.Proto, _ int) error { return e.startBinary(services, proto) }
		}
		if err := launch(services, proto, flows); err != nil {
			return nil, err
		}
		e.setup = time.Since(start)
		for _, ifc := range []string{topo.NodeInIface, topo.NodeOutIface} {
			th, err := e.threaded(e.t.Node, ifc, fwd)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", ifc, err)
			}
			fwdThreads = append(fwdThreads, th...)
		}
		e.probe.Processes = []int{e.proc.Process.Pid}
	default:
		return nil, fmt.Errorf("runner: unknown path %q", path)
	}
	e.probe.Threads = fwdThreads
	if path != report.PathLimit && proto == kernelrules.UDP {
		if _, err := e.attachSink(e.t.Sink, topo.SinkIface, gen); err != nil {
			return nil, err
		}
	}
	if proto == kernelrules.TCP {
		// Frames the node sends to the client and the server go through
		// their backlog; steer that to the generator CPU.
		if err := e.t.SetRPS(e.t.Gen, topo.GenIface, gen); err != nil {
			return nil, err
		}
		if err := e.t.SetRPS(e.t.Sink, topo.SinkIface, gen); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// kernelForwarding turns GRO on for the node's veths, which gives them
// NAPI instances, and threaded NAPI then runs those on the forwarding CPU:
// all of the kernel's forwarding work happens in the kthreads it returns.
func (e *env) kernelForwarding() ([]int, error) {
	var threads []int
	for _, ifc := range []string{topo.NodeInIface, topo.NodeOutIface} {
		if err := e.t.SetOffload(e.t.Node, ifc, "gro", true); err != nil {
			return nil, err
		}
		th, err := e.threaded(e.t.Node, ifc, e.cfg.Plan.ForwardCPU)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", ifc, err)
		}
		threads = append(threads, th...)
	}
	return threads, nil
}

// startXDProxy starts the dataplane process in the node namespace and
// waits for its table to be published.
func (e *env) startXDProxy(services int, proto kernelrules.Proto, flows int) error {
	args := []string{"netns", "exec", e.t.Node, "nice", "-n", strconv.Itoa(e.cfg.Nice), e.cfg.Self, "dataplane",
		"--services", strconv.Itoa(max(services, 1)), "--proto", string(proto), "--cpu", strconv.Itoa(e.cfg.Plan.ForwardCPU)}
	if e.cfg.profileNext != "" {
		args = append(args, "--cpuprofile", e.cfg.profileNext)
		e.cfg.profileNext = ""
	}
	cmd := exec.Command("ip", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	e.procErr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	e.proc = cmd
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), ReadyLine) {
				ready <- nil
				_, _ = bufio.NewReader(out).WriteTo(discard{})
				return
			}
		}
		ready <- fmt.Errorf("xdproxy dataplane exited before it was ready: %s", strings.TrimSpace(stderr.String()))
	}()
	select {
	case err := <-ready:
		return err
	case <-time.After(120 * time.Second):
		return fmt.Errorf("xdproxy dataplane not ready after 120s: %s", stderr.String())
	}
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }

// pktgenOut is the generator's JSON output.
type pktgenOut struct {
	pktgen.Result
}

// measurement is one trial: the search point and the forwarding cost.
type measurement struct {
	point   search.Point
	costNs  float64 // probe ns per received packet
	cpuNs   float64 // forwarding CPU busy ns per received packet
	genRes  pktgen.Result
	recvPkt uint64
}

// send runs the generator once.
func (e *env) send(mode string, rate float64, d time.Duration, count uint64, flows int) (pktgen.Result, error) {
	args := []string{"netns", "exec", e.t.Gen, "nice", "-n", strconv.Itoa(e.cfg.Nice), e.cfg.Pktgen, "--json", "--mode", mode,
		"--dev", topo.GenIface, "--dst-mac", e.t.NodeInMAC.String(), "--cpu", strconv.Itoa(e.cfg.Plan.GenCPU),
		"--src", topo.FlowSource.String(), "--dst", e.dst.String(), "--dsts", strconv.Itoa(e.dsts),
		"--dport", strconv.Itoa(int(e.dport)), "--flows", strconv.Itoa(flows), "--size", strconv.Itoa(e.cfg.FrameSize),
		"--rate", strconv.FormatFloat(rate, 'f', 0, 64), "--proto", "udp"}
	if d > 0 {
		args = append(args, "--duration", d.String())
	}
	if count > 0 {
		args = append(args, "--count", strconv.FormatUint(count, 10))
	}
	cmd := exec.Command("ip", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return pktgen.Result{}, fmt.Errorf("pktgen: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	var res pktgenOut
	if err := json.Unmarshal(out, &res); err != nil {
		return pktgen.Result{}, fmt.Errorf("pktgen output %q: %w", out, err)
	}
	return res.Result, nil
}

// trial offers rate for d and measures loss and cost.
func (e *env) trial(mode string, rate float64, d time.Duration, flows int) (measurement, error) {
	var m measurement
	s0, err := e.sink.Read()
	if err != nil {
		return m, err
	}
	p0, err := e.probe.Read()
	if err != nil {
		return m, err
	}
	c0, err := cpuacct.ReadCPU(e.cfg.Plan.ForwardCPU)
	if err != nil {
		return m, err
	}
	res, err := e.send(mode, rate, d, 0, flows)
	if err != nil {
		return m, err
	}
	time.Sleep(e.cfg.Settle)
	s1, err := e.sink.Read()
	if err != nil {
		return m, err
	}
	p1, err := e.probe.Read()
	if err != nil {
		return m, err
	}
	c1, err := cpuacct.ReadCPU(e.cfg.Plan.ForwardCPU)
	if err != nil {
		return m, err
	}
	recv := s1.Sub(s0).Packets
	secs := res.Elapsed.Seconds()
	if secs <= 0 {
		return m, fmt.Errorf("pktgen reported no elapsed time")
	}
	m.genRes, m.recvPkt = res, recv
	m.point = search.Point{Offered: rate, Sent: float64(res.Sent) / secs, Received: float64(recv) / secs}
	if rate == 0 {
		m.point.Offered = m.point.Sent
	}
	if recv > 0 {
		m.costNs = float64(p1-p0) / float64(recv)
		m.cpuNs = float64(c1.Sub(c0).BusyTime()) / float64(recv)
	}
	if e.cfg.Verbose {
		e.cfg.Log.Printf("      trial %s offered %.0f sent %.0f recv %.0f loss %.3f%% late %d cost %.0f ns cpu %.0f ns (threads %v, %v busy)",
			mode, rate, m.point.Sent, m.point.Received, m.point.Loss()*100, res.Late, m.costNs, m.cpuNs, time.Duration(p1-p0), c1.Sub(c0).BusyTime())
	}
	return m, nil
}
