// Command xdproxy-bench measures xdproxy against the paths kube-proxy
// programs into the kernel, on one veth topology, side by side in one run,
// and writes CSV, a markdown report and PNG plots to <out>/<date>/.
//
//	xdproxy-bench --out bench/results           # full run
//	xdproxy-bench --quick --out bench/results   # a few minutes
//
// xdproxy is always the real binary (bin/xdproxy run --config), driven
// through its config file and admin socket. It needs root. The
// subcommands tcp-server and tcp-client are the processes it starts inside
// the topology's namespaces; report renders a results directory again.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/xdproxy/xdproxy/bench/feed"
	"github.com/xdproxy/xdproxy/bench/kubeproxy"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/runner"
	"github.com/xdproxy/xdproxy/bench/tcpbench"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/kubetest"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

func main() {
	testbed.ServeIfRequested() // testbed servers are this program run again
	var err error
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "tcp-server":
			err = tcpServerCmd(os.Args[2:])
		case "tcp-client":
			err = tcpClientCmd(os.Args[2:])
		case "report":
			err = reportCmd(os.Args[2:])
		default:
			err = benchCmd(os.Args[1:])
		}
	} else {
		err = benchCmd(nil)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdproxy-bench:", err)
		os.Exit(1)
	}
}

func splitList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%q: %w", s, err)
		}
		out = append(out, v)
	}
	return out, nil
}

func benchCmd(args []string) error {
	fs := flag.NewFlagSet("xdproxy-bench", flag.ExitOnError)
	var (
		out          = fs.String("out", "bench/results", "results go to OUT/<date>/")
		quick        = fs.Bool("quick", false, "the short run (a few minutes): the NIC feed, xdproxy against the nftables shape and the I/O floor at 1 and 1,000 services, shorter trials")
		feeds        = fs.String("feed", "nic", "how frames reach the node, comma-separated: nic (XDP frames redirected into n0, as from a NIC) and/or pod (skbs from a veth, as from a pod)")
		services     = fs.String("services", "", "service counts (default 1,1000,10000,100000; quick 1,1000)")
		traffic      = fs.String("traffic", "1000,new", "traffic patterns: a number of long flows, and/or new (a new flow per packet)")
		genCPU       = fs.Int("gen-cpu", 0, "CPU of the generator, the feed's redirect, the sink's receive work, and the TCP client and server")
		fwdCPU       = fs.Int("forward-cpu", 1, "CPU that forwards")
		trial        = fs.Duration("trial", 0, "length of one trial (default 1s; quick 500ms)")
		costRate     = fs.Float64("cost-rate", 0, "offered pps of the cost runs (default: min(200k, half the generator ceiling))")
		size         = fs.Int("size", 64, "frame size including FCS")
		tcp          = fs.Bool("tcp", true, "run the TCP connection test")
		tcpDuration  = fs.Duration("tcp-duration", 0, "length of one round of the TCP connection test (default 3s; quick 2s)")
		tcpRounds    = fs.Int("tcp-rounds", 3, "rounds of the TCP connection test, the paths in turn; each path reports its median round")
		packet       = fs.Bool("packet", true, "run the packet-rate tests")
		profile      = fs.Bool("profile", true, "profile the running xdproxy binary under traffic (admin socket /debug/pprof/profile)")
		profileSvc   = fs.Int("profile-services", 0, "service count of the profiles (default 1000 when measured, else the most)")
		pktgenBin    = fs.String("pktgen", "", "xdproxy-pktgen binary (default: next to this one)")
		xdproxyBin   = fs.String("xdproxy", "", "xdproxy binary to measure (default: next to this one)")
		nice         = fs.Int("nice", -10, "nice value of the generator, the forwarding threads and xdproxy")
		rtPrio       = fs.Int("rt-priority", 50, "SCHED_FIFO priority of the NAPI kthreads on the forwarding CPU (xdproxy's poll-mode workers get ten less), so that other work on a shared machine cannot preempt the forwarding; 0: ordinary threads at --nice")
		rulesTimeout = fs.Duration("rules-timeout", 3*time.Minute, "give up on a ruleset that takes longer than this to load")
		only         = fs.String("only", "", "measure only these paths (comma-separated; the limit always runs first)")
		verbose      = fs.Bool("v", false, "log every trial")
		quietWait    = fs.Duration("quiet-wait", 0, "before each group of paths, wait up to this long for other work on the machine to calm down (default 30s; quick 15s; negative: never wait)")
		redos        = fs.Int("redos", -1, "repeat a cost run up to this many times when other work held the forwarding CPU for more than 25% of it (default 2; quick 1)")
		iptables     = fs.String("iptables-restore", "iptables-restore", "iptables-restore binary (iptables-legacy-restore for the legacy backend)")
		kubeBin      = fs.String("kube-bin", "", "directory holding etcd, kube-apiserver and kube-proxy for the real kube-proxy paths (default: build/kube/bin of the repository, from make kube-tools)")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("needs root (network namespaces, XDP)")
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if *pktgenBin == "" {
		*pktgenBin = filepath.Join(filepath.Dir(self), "xdproxy-pktgen")
	}
	if *xdproxyBin == "" {
		*xdproxyBin = filepath.Join(filepath.Dir(self), "xdproxy")
	}
	for _, b := range []string{*pktgenBin, *xdproxyBin} {
		if _, err := os.Stat(b); err != nil {
			return fmt.Errorf("%w (run make build)", err)
		}
	}
	for _, tool := range []string{"ip", "ethtool", "nft", "taskset", *iptables} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing (make deps installs it): %w", tool, err)
		}
	}
	if stale, _ := testbed.CleanupStale(); len(stale) > 0 {
		fmt.Fprintf(os.Stderr, "removed %d namespaces a killed run left behind\n", len(stale))
	}
	runner.RemoveDirs(true)
	if *kubeBin != "" {
		if err := os.Setenv(kubetest.BinDirEnv, *kubeBin); err != nil {
			return err
		}
	}
	kubeBins, kubeErr := kubeproxy.FindBinaries()
	cfg := &runner.Config{
		Quick: *quick, Plan: topo.Plan{GenCPU: *genCPU, ForwardCPU: *fwdCPU},
		Trial: time.Second, CostRuns: 5, SearchTrials: 7, CurvePoints: 3, WarmUps: 5, CostRate: *costRate,
		FrameSize: *size, Tolerance: 0.001, Settle: 150 * time.Millisecond,
		Packet: *packet, TCP: *tcp, TCPServices: []int{1, 1000}, TCPDuration: 3 * time.Second, TCPConcurrency: 8, TCPRounds: 3,
		Self: self, Pktgen: *pktgenBin, XDProxyBin: *xdproxyBin, IPTablesRestore: *iptables, RulesTimeout: *rulesTimeout,
		Profile: *profile, ProfileServices: *profileSvc, ProfileTrial: 3 * time.Second, Verbose: *verbose, Nice: *nice, RTPriority: *rtPrio,
		Only: splitList(*only), KubeBins: kubeBins, KubeBinsErr: kubeErr,
		QuietWait: 30 * time.Second, QuietBusy: 0.3, Redos: 2, RedoOther: 0.25,
	}
	svc := "1,1000,10000,100000"
	if *quick {
		svc = "1,1000"
		cfg.Trial, cfg.CostRuns, cfg.SearchTrials, cfg.CurvePoints, cfg.WarmUps = 500*time.Millisecond, 3, 5, 0, 2
		cfg.TCPServices, cfg.TCPDuration, cfg.ProfileTrial, cfg.QuietWait = []int{1}, 2*time.Second, 2*time.Second, 15*time.Second
	}
	if *quick {
		cfg.Redos = 1
	}
	if *redos >= 0 {
		cfg.Redos = *redos
	}
	if *quietWait != 0 {
		cfg.QuietWait = max(*quietWait, 0)
	}
	if *services != "" {
		svc = *services
	}
	if *trial > 0 {
		cfg.Trial = *trial
	}
	if *tcpDuration > 0 {
		cfg.TCPDuration = *tcpDuration
	}
	cfg.TCPRounds = *tcpRounds
	if cfg.Services, err = ints(svc); err != nil {
		return err
	}
	if cfg.Traffic, err = runner.ParseTraffic(*traffic); err != nil {
		return err
	}
	if cfg.Feeds, err = feed.ParseList(*feeds); err != nil {
		return err
	}
	dir := filepath.Join(*out, time.Now().UTC().Format("2006-01-02T15-04"))
	if *quick {
		dir += "-quick"
	}
	// Two runs started in the same minute must not write over each other.
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	for i, base := 2, dir; ; i++ {
		err := os.Mkdir(dir, 0o755)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrExist) {
			return err
		}
		dir = fmt.Sprintf("%s-%d", base, i)
	}
	cfg.OutDir = dir
	// An interrupted run must not leave namespaces and processes behind.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-sigs
		fmt.Fprintf(os.Stderr, "xdproxy-bench: %v: removing the topology\n", s)
		kubeproxy.CloseAll()
		topo.CloseAll() // kills the xdproxy binaries with their namespaces
		runner.RemoveDirs(false)
		os.Exit(130)
	}()
	r, runErr := runner.Run(cfg)
	if r == nil {
		return runErr
	}
	r.Command = strings.Join(os.Args, " ")
	if runErr != nil {
		r.Notes = append(r.Notes, "the run stopped early: "+runErr.Error())
	}
	for _, p := range r.Profiles {
		_ = os.WriteFile(filepath.Join(dir, strings.TrimSuffix(p.File, ".pprof")+".top.txt"), []byte(p.Top), 0o644)
	}
	r.Notes = append(r.Notes, notes(r)...)
	if err := report.WriteCSV(dir, r); err != nil {
		return err
	}
	plots, err := report.WritePlots(dir, r)
	if err != nil {
		return err
	}
	if err := report.WriteMarkdown(dir, r, plots); err != nil {
		return err
	}
	fmt.Println("results in", dir)
	return runErr
}

// notes are the standing caveats of a run on this kind of machine.
func notes(r *report.Run) []string {
	return []string{
		"Trials are short (" + r.Trial + ") compared with RFC 2544's 60 s; each zero-loss figure is one bisection in which a failing trial is repeated once and the rate passes if either passes (other work on this shared machine deschedules the forwarding threads now and then), each cost figure the median of several runs in the same run.",
		"The generator shares its CPU with the feed's redirect and the sink's receive work; its AF_XDP ceiling caps every zero-loss search, so paths that reach it are marked 'generator limit' and compared by CPU per packet instead. 'Lost before the node' is the share of sent frames that n0 never took off its ring (veth's rx_queue_0_xdp_packets): loss on the generator's side, not the path's.",
		"CPU per packet is the run time of the node's NAPI kthreads (pinned to the forwarding CPU) plus, for xdproxy, every thread of its process (Go runtime and control plane included, wherever they ran), divided by packets that reached the sink; it is not disturbed by other work on the machine. throughput.csv also has cpu_ns_per_pkt, /proc/stat busy time of the forwarding CPU per packet: on this VM those tick-sampled counters disagree with the threads' own run time by up to 10x in both directions, so the report does not use them.",
		"Busy poll: xdproxy's workers (n0, n1 and the exception link's) spin on the forwarding CPU, which they share with n0's and n1's NAPI kthreads; its CPU per packet is the whole core's time divided by the packets, so it only falls as the rate rises.",
		"Kernel paths: GRO is on for n0/n1 so that receive work runs in their (threaded, pinned) NAPI instances, and with the NIC feed n0 runs an XDP_PASS program (a veth takes redirected frames only while its peer has NAPI); TSO is off on g0/s0 for every variant.",
		"Long flows are sent over and over after warm-up trials that send each, so their packets hit established connection-tracking entries in both the kernel and xdproxy. With a new flow per packet the generator walks a space of 12.9M flows (every source port of 200 pod addresses) across the trials of a variant without repeating one, so every packet creates an entry: the kernel's nf_conntrack_max (262144 here, global) fills within seconds and it evicts unreplied entries to make room, as xdproxy does at its 1M capacity. Where a path could not establish the long flows during the warm-up, its row's note says so.",
	}
}

// reportCmd renders report.md, the CSV files and the plots of a results
// directory again from its run.json.
func reportCmd(args []string) error {
	fs := flag.NewFlagSet("report", flag.ExitOnError)
	dir := fs.String("dir", "", "results directory holding run.json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(*dir, report.RunJSON))
	if err != nil {
		return err
	}
	var r report.Run
	if err := json.Unmarshal(b, &r); err != nil {
		return err
	}
	if err := report.WriteCSV(*dir, &r); err != nil {
		return err
	}
	plots, err := report.WritePlots(*dir, &r)
	if err != nil {
		return err
	}
	return report.WriteMarkdown(*dir, &r, plots)
}

func tcpServerCmd(args []string) error {
	fs := flag.NewFlagSet("tcp-server", flag.ExitOnError)
	listen := fs.String("listen", "", "comma-separated host:port list")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return runner.ServeTCP(strings.Split(*listen, ","))
}

func tcpClientCmd(args []string) error {
	fs := flag.NewFlagSet("tcp-client", flag.ExitOnError)
	target := fs.String("target", "", "host:port")
	d := fs.Duration("duration", 2*time.Second, "how long")
	c := fs.Int("concurrency", 8, "parallel connection loops")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return runner.ClientTCP(tcpbench.Options{Target: *target, Duration: *d, Concurrency: *c})
}
