// Command xdproxy-bench measures xdproxy against the paths kube-proxy
// programs into the kernel, on one veth topology, in one run, and writes
// CSV, a markdown report and PNG plots to <out>/<date>/.
//
//	xdproxy-bench --out bench/results           # full run
//	xdproxy-bench --quick --out bench/results   # under 3 minutes
//
// It needs root. The subcommands dataplane, tcp-server and tcp-client are
// the processes it starts inside the topology's namespaces.
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

	"github.com/xdproxy/xdproxy/bench/kernelrules"
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
		case "dataplane":
			err = dataplaneCmd(os.Args[2:])
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
		quick        = fs.Bool("quick", false, "the short run (under 3 minutes): fewer service counts, shorter trials")
		services     = fs.String("services", "", "service counts (default 1,1000,10000,100000; quick 1,10000)")
		flows        = fs.String("flows", "1,100000", "flow counts: one flow and many flows")
		genCPU       = fs.Int("gen-cpu", 0, "CPU of the generator, the sink's receive work, and the TCP client and server")
		fwdCPU       = fs.Int("forward-cpu", 1, "CPU that forwards")
		trial        = fs.Duration("trial", 0, "length of one trial (default 1s; quick 500ms)")
		costRate     = fs.Float64("cost-rate", 0, "offered pps of the cost runs (default: min(200k, half the generator ceiling))")
		size         = fs.Int("size", 64, "frame size including FCS")
		tcp          = fs.Bool("tcp", true, "run the TCP connection test")
		packet       = fs.Bool("packet", true, "run the packet-rate tests")
		profile      = fs.Bool("profile", true, "write a CPU profile of xdproxy at the most services and flows")
		pktgenBin    = fs.String("pktgen", "", "xdproxy-pktgen binary (default: next to this one)")
		nice         = fs.Int("nice", -10, "nice value of the generator, the forwarding threads and xdproxy")
		rulesTimeout = fs.Duration("rules-timeout", 3*time.Minute, "give up on a ruleset that takes longer than this to load")
		only         = fs.String("only", "", "measure only these paths (comma-separated; the limit always runs first)")
		verbose      = fs.Bool("v", false, "log every trial")
		xdproxyBin   = fs.String("xdproxy", "auto", "xdproxy binary to measure; auto: the one next to this program if present; none: the engine run by the dataplane subcommand (with --profile, that engine is also run once under the profiler)")
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
	switch *xdproxyBin {
	case "auto":
		*xdproxyBin = filepath.Join(filepath.Dir(self), "xdproxy")
		if _, err := os.Stat(*xdproxyBin); err != nil {
			*xdproxyBin = ""
		}
	case "none":
		*xdproxyBin = ""
	}
	if _, err := os.Stat(*pktgenBin); err != nil {
		return fmt.Errorf("generator: %w (run make build)", err)
	}
	for _, tool := range []string{"ip", "ethtool", "nft", "taskset", *iptables} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing (make deps installs it): %w", tool, err)
		}
	}
	if stale, _ := testbed.CleanupStale(); len(stale) > 0 {
		fmt.Fprintf(os.Stderr, "removed %d namespaces a killed run left behind\n", len(stale))
	}
	if *kubeBin != "" {
		if err := os.Setenv(kubetest.BinDirEnv, *kubeBin); err != nil {
			return err
		}
	}
	kubeBins, kubeErr := kubeproxy.FindBinaries()
	cfg := &runner.Config{
		Quick: *quick, Plan: topo.Plan{GenCPU: *genCPU, ForwardCPU: *fwdCPU},
		Trial: time.Second, CostRuns: 5, SearchTrials: 7, CurvePoints: 5, WarmUps: 5, CostRate: *costRate,
		FrameSize: *size, Tolerance: 0.001, Settle: 150 * time.Millisecond,
		Packet: *packet, TCP: *tcp, TCPServices: []int{1, 10000}, TCPDuration: 3 * time.Second, TCPConcurrency: 8,
		Self: self, Pktgen: *pktgenBin, IPTablesRestore: *iptables, RulesTimeout: *rulesTimeout, Profile: *profile, Verbose: *verbose, Nice: *nice,
		Only: splitList(*only), XDProxyBin: *xdproxyBin, KubeBins: kubeBins, KubeBinsErr: kubeErr,
	}
	svc := "1,1000,10000,100000"
	if *quick {
		svc = "1,10000"
		cfg.Trial, cfg.CostRuns, cfg.SearchTrials, cfg.CurvePoints, cfg.WarmUps = 500*time.Millisecond, 3, 5, 0, 2
		cfg.TCPServices, cfg.TCPDuration = []int{1}, 2*time.Second
	}
	if *services != "" {
		svc = *services
	}
	if *trial > 0 {
		cfg.Trial = *trial
	}
	if cfg.Services, err = ints(svc); err != nil {
		return err
	}
	if cfg.Flows, err = ints(*flows); err != nil {
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
		topo.CloseAll()
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
	if r.Profile != "" {
		top, err := exec.Command("go", "tool", "pprof", "-top", "-nodecount=30", self, filepath.Join(dir, r.Profile)).CombinedOutput()
		if err != nil {
			r.Notes = append(r.Notes, fmt.Sprintf("go tool pprof failed (%v): %s", err, top))
		} else {
			r.ProfileTop = string(top)
			_ = os.WriteFile(filepath.Join(dir, "xdproxy.cpu.top.txt"), top, 0o644)
		}
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
		"The generator shares its CPU with the sink's receive work; its AF_XDP ceiling caps every zero-loss search, so paths that reach it are marked 'generator limit' and compared by cost instead.",
		"Cost per packet (threads) is the run time of the node's NAPI kthreads (pinned to the forwarding CPU) plus, for xdproxy, every thread of its process, divided by packets that reached the sink; it is not disturbed by other work on the machine. throughput.csv also has cpu_ns_per_pkt, /proc/stat busy time of the forwarding CPU per packet: on this VM those tick-sampled counters disagree with the threads' own run time by up to 10x in both directions, so the report does not use them.",
		"Kernel paths: GRO is on for n0/n1 so that receive work runs in their (threaded, pinned) NAPI instances; TSO is off on g0/s0 for every variant (an XDP program on the peer turns it off anyway).",
		"Many-flow runs cycle through the flows over and over (after warm-up trials that send each), so most packets hit established connection-tracking entries in both the kernel and xdproxy; new-connection cost is what the TCP test measures. Where a path could not establish the flows during the warm-up (iptables at 10,000 services and more: every new flow walks the KUBE-SERVICES chain), its row's note says so and its cost is that of new flows.",
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

func dataplaneCmd(args []string) error {
	fs := flag.NewFlagSet("dataplane", flag.ExitOnError)
	services := fs.Int("services", 1, "number of services")
	proto := fs.String("proto", "udp", "udp or tcp")
	cpu := fs.Int("cpu", -1, "worker CPU")
	prof := fs.String("cpuprofile", "", "write a CPU profile here")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return runner.RunDataplane(runner.DataplaneOptions{Services: *services, Proto: kernelrules.Proto(*proto), CPU: *cpu, CPUProfile: *prof})
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
