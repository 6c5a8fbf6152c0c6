package runner

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdproxy/xdproxy/bench/cpuacct"
	"github.com/xdproxy/xdproxy/bench/feed"
	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/kubeproxy"
	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/search"
	"github.com/xdproxy/xdproxy/bench/sink"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// env is one variant's live setup: its topology and feed, the programmed
// path, the sink and the probe of the forwarding threads.
type env struct {
	cfg     *Config
	t       *topo.Topology
	feed    *feed.Feed
	sink    *sink.Sink
	probe   cpuacct.Probe
	xdproxy *xdproxyProc // the xdproxy binary, on its paths
	setup   time.Duration
	dst     netip.Addr
	dsts    int
	dport   uint16
	flows   int
	// seq is the generator's next sequence number: with new-flow traffic
	// each trial continues where the last one ended, so that no flow
	// repeats.
	seq     uint64
	newFlow bool
	closers []func() error
	set     kernelrules.ServiceSet
	limit   bool
	note    string // about the setup, for the results' notes
}

// aim points the generator: at the node itself for the limit (its sink
// drops everything), at the sink without services, else at the services,
// spread over min(flows, services, AddrsPerPort) cluster IPs (a new flow
// per packet: over min(services, AddrsPerPort)).
func (e *env) aim(services int, tr Traffic) {
	e.dst, e.dsts, e.dport = topo.SinkAddrs[0], 1, UDPEndpointPort
	e.flows, e.newFlow, e.seq = tr.Flows, tr.New, 0
	if e.set.Proto == kernelrules.TCP {
		e.dport = TCPEndpointPort
	}
	switch {
	case e.limit:
		e.dst = topo.NodeInAddr
	case services > 0:
		e.dst, e.dsts, e.dport = e.set.VIP(0), min(tr.Flows, services, kernelrules.AddrsPerPort), e.set.Port(0)
	}
}

// stopXDProxy stops the xdproxy binary and returns a summary of its
// counters ("" without one).
func (e *env) stopXDProxy() string {
	if e.xdproxy == nil {
		return ""
	}
	s := e.xdproxy.stop()
	e.xdproxy = nil
	return s
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
	if e.feed != nil {
		errs = append(errs, e.feed.Close())
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

// threaded turns threaded NAPI on for iface and pins its kthreads to cpu,
// with the benchmark's priority.
func (e *env) threaded(ns, iface string, cpu int) ([]int, error) {
	pids, err := e.t.SetThreaded(ns, iface)
	if err != nil {
		return nil, err
	}
	if err := topo.Pin(cpu, pids...); err != nil {
		return nil, err
	}
	return pids, e.cfg.napiPriority(cpu, pids...)
}

// napiPriority gives NAPI kthreads on cpu the benchmark's priority. On the
// forwarding CPU that is SCHED_FIFO at RTPriority (as a NIC's softirqs run
// before any thread); elsewhere, and without RTPriority, the nice value of
// the generator: a real-time NAPI kthread on the generator's CPU would
// preempt the generator at every frame it sends and hand n0 its frames one
// at a time, where a NIC hands over batches.
func (c *Config) napiPriority(cpu int, tids ...int) error {
	if c.RTPriority > 0 && cpu == c.Plan.ForwardCPU {
		return topo.SetFIFO(c.RTPriority, tids...)
	}
	return topo.SetNice(c.Nice, tids...)
}

// workerPriority is the SCHED_FIFO priority of xdproxy's workers, below
// the NAPI kthreads they share the CPU with (0: none).
func (c *Config) workerPriority() int {
	if c.RTPriority <= 0 {
		return 0
	}
	return max(1, c.RTPriority-10)
}

// newEnv builds the topology with the feed, and programs path.
func newEnv(cfg *Config, fk feed.Kind, path string, services int, proto kernelrules.Proto) (_ *env, err error) {
	e := &env{cfg: cfg, limit: path == report.PathLimit}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.close())
		}
	}()
	if e.t, err = topo.New(fk.TopoOptions()); err != nil {
		return nil, err
	}
	gen, fwd := cfg.Plan.GenCPU, cfg.Plan.ForwardCPU
	if e.feed, err = feed.Setup(e.t, fk, gen, cfg.Nice); err != nil {
		return nil, err
	}
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
		if fwdThreads, err = e.kernelForwarding(fk); err != nil {
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
		if fwdThreads, err = e.kernelForwarding(fk); err != nil {
			return nil, err
		}
	case report.PathXDProxy, report.PathBusyPoll, report.PathIOFloor:
		if e.xdproxy, err = startXDProxy(cfg, e.t, path, set); err != nil {
			return nil, err
		}
		e.setup = time.Since(start)
		if h := e.xdproxy.health; h != "" {
			e.note = "xdproxy's /health when it was ready: " + h + "."
		}
		for _, ifc := range []string{topo.NodeInIface, topo.NodeOutIface} {
			th, err := e.threaded(e.t.Node, ifc, fwd)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", ifc, err)
			}
			fwdThreads = append(fwdThreads, th...)
		}
		e.probe.Processes = []int{e.xdproxy.pid()}
		// Poll-mode workers sleep when idle and may be real-time like the
		// NAPI kthreads; busy-polling ones never sleep and would starve
		// each other at one real-time priority, so they stay ordinary.
		if prio := cfg.workerPriority(); prio > 0 && path != report.PathBusyPoll {
			tids, err := e.xdproxy.workerThreads(fwd)
			if err != nil {
				return nil, err
			}
			if err := topo.SetFIFO(prio, tids...); err != nil {
				return nil, err
			}
		}
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

// kernelForwarding prepares the node's veths for the kernel's own
// forwarding: with the NIC feed an XDP_PASS program on n0 (a veth takes
// redirected frames only while its peer has NAPI, and then builds the skb
// in n0's NAPI, as a NIC driver does); GRO on for both, which gives them
// NAPI instances for skbs; and threaded NAPI pinned to the forwarding CPU.
// All of the kernel's forwarding work then happens in the kthreads it
// returns.
func (e *env) kernelForwarding(fk feed.Kind) ([]int, error) {
	if fk == feed.NIC {
		err := testbed.DoIn(e.t.Node, func() error {
			p, err := feed.AttachPass(e.t.NodeInIdx)
			if err == nil {
				e.closers = append(e.closers, p.Close)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
	}
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

// measurement is one trial: the search point and the forwarding cost.
type measurement struct {
	point   search.Point
	costNs  float64 // probe ns per received packet
	cpuNs   float64 // forwarding CPU busy ns per received packet
	genRes  pktgen.Result
	recvPkt uint64
	// feedLoss is the share of sent frames that never reached n0 (-1:
	// unknown).
	feedLoss float64
	// otherShare estimates the share of the trial during which other work
	// held the forwarding CPU: its busy time (/proc/stat, in ticks) less
	// the probed threads' run time, over the trial's length.
	otherShare float64
}

// send runs the generator once.
func (e *env) send(rate float64, d time.Duration) (pktgen.Result, error) {
	args := []string{"netns", "exec", e.t.Gen, "nice", "-n", strconv.Itoa(e.cfg.Nice), e.cfg.Pktgen, "--json", "--mode", "afxdp",
		"--dev", e.feed.Kind.TxIface(), "--src-mac", e.t.GenMAC.String(), "--dst-mac", e.t.NodeInMAC.String(),
		"--cpu", strconv.Itoa(e.cfg.Plan.GenCPU),
		"--src", topo.FlowSource.String(), "--dst", e.dst.String(), "--dsts", strconv.Itoa(e.dsts),
		"--dport", strconv.Itoa(int(e.dport)), "--flows", strconv.Itoa(e.flows), "--size", strconv.Itoa(e.cfg.FrameSize),
		"--rate", strconv.FormatFloat(rate, 'f', 0, 64), "--proto", "udp", "--duration", d.String()}
	if e.newFlow {
		args = append(args, "--seq", strconv.FormatUint(e.seq, 10))
	}
	cmd := exec.Command("ip", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return pktgen.Result{}, fmt.Errorf("pktgen: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	var res pktgen.Result
	if err := json.Unmarshal(out, &res); err != nil {
		return pktgen.Result{}, fmt.Errorf("pktgen output %q: %w", out, err)
	}
	if e.newFlow {
		e.seq += res.Sent
	}
	return res, nil
}

// arrived is how many frames n0 has taken off its receive ring (veth's
// rx_queue_0_xdp_packets: every frame of its NAPI, XDP frame or skb);
// ok is false where the counter cannot be read.
func (e *env) arrived() (uint64, bool) {
	qs, err := testbed.RxQueuePackets(e.t.Node, topo.NodeInIface)
	if err != nil {
		return 0, false
	}
	var n uint64
	for _, q := range qs {
		n += q
	}
	return n, true
}

// trial offers rate (0: as fast as the generator can) for d and measures
// loss and cost.
func (e *env) trial(rate float64, d time.Duration, tr Traffic) (measurement, error) {
	m := measurement{feedLoss: -1}
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
	a0, okA0 := e.arrived()
	res, err := e.send(rate, d)
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
	a1, okA1 := e.arrived()
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
	if span := res.Elapsed + e.cfg.Settle; span > 0 {
		m.otherShare = max(0, float64(c1.Sub(c0).BusyTime()-(p1-p0))/float64(span))
	}
	if okA0 && okA1 && res.Sent > 0 {
		m.feedLoss = 0
		if got := a1 - a0; got < res.Sent {
			m.feedLoss = float64(res.Sent-got) / float64(res.Sent)
		}
	}
	if e.cfg.Verbose {
		e.cfg.Log.Printf("      trial %v offered %.0f sent %.0f recv %.0f loss %.3f%% (before n0 %.3f%%) late %d cost %.0f ns cpu %.0f ns (threads %v, %v busy, other work %.0f%%)",
			tr, rate, m.point.Sent, m.point.Received, m.point.Loss()*100, m.feedLoss*100, res.Late, m.costNs, m.cpuNs, time.Duration(p1-p0), c1.Sub(c0).BusyTime(), m.otherShare*100)
	}
	return m, nil
}

// MachineBusy is the share of time every CPU was busy over d (from
// /proc/stat), with nothing of the benchmark running: other work on a
// shared machine.
func MachineBusy(cpus []int, d time.Duration) (float64, error) {
	before := make([]cpuacct.CPUTimes, len(cpus))
	for i, c := range cpus {
		var err error
		if before[i], err = cpuacct.ReadCPU(c); err != nil {
			return 0, err
		}
	}
	time.Sleep(d)
	var busy, total uint64
	for i, c := range cpus {
		now, err := cpuacct.ReadCPU(c)
		if err != nil {
			return 0, err
		}
		dt := now.Sub(before[i])
		busy, total = busy+dt.Busy(), total+dt.Total()
	}
	if total == 0 {
		return 0, nil
	}
	return float64(busy) / float64(total), nil
}
