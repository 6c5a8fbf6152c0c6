package runner

import (
	"errors"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/kubeproxy"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/search"
	"github.com/xdproxy/xdproxy/bench/topo"
)

// Config of a benchmark run.
type Config struct {
	Quick bool
	Plan  topo.Plan
	// Services are the service counts of the kernel-rule and xdproxy
	// paths; Flows the flow counts (the first is used for the paths
	// measured with one flow count only).
	Services []int
	Flows    []int
	// Trial is the length of one trial; CostRuns how many cost runs make
	// the median; SearchTrials caps the zero-loss search; CostRate is the
	// rate of the cost runs (0: half the generator's ceiling, at most
	// 200 kpps).
	Trial        time.Duration
	CostRuns     int
	SearchTrials int
	CostRate     float64
	CurvePoints  int // extra evenly spaced curve points beyond the search's
	WarmUps      int // most warm-up trials before the cost runs
	FrameSize    int
	Tolerance    float64
	Settle       time.Duration
	// Packet runs the packet-rate variants; TCP the connection test.
	Packet         bool
	TCP            bool
	TCPServices    []int
	TCPDuration    time.Duration
	TCPConcurrency int
	// Binaries: Self is this program (for the dataplane, tcp-server and
	// tcp-client subcommands), Pktgen the generator.
	Self, Pktgen string
	// XDProxyBin, when set, is the xdproxy binary to measure (bin/xdproxy
	// run with a generated config and services file); otherwise the
	// dataplane subcommand of Self runs the same engine with a profile.
	XDProxyBin      string
	IPTablesRestore string
	// RulesTimeout bounds one ruleset load (nft -f slows down more than
	// linearly with the number of chains).
	RulesTimeout time.Duration
	// Profile writes a CPU profile of xdproxy for the variant with the
	// most services and the most flows into the results directory.
	Profile bool
	OutDir  string
	Log     *log.Logger
	// Nice is the nice value of every thread the benchmark runs or
	// pins (generator, NAPI kthreads, xdproxy), so that other work on a
	// shared machine disturbs all paths less and equally.
	Nice int
	// Only restricts the run to these paths (the limit always runs).
	Only []string
	// Verbose logs every trial.
	Verbose bool
	// KubeBins are the control plane and kube-proxy binaries of the real
	// kube-proxy paths; KubeBinsErr, when set, says why they are missing
	// and those paths are skipped. The paths run in full runs (and when
	// Only names them) at the service counts up to KubeProxyMaxServices.
	KubeBins    kubeproxy.Binaries
	KubeBinsErr error

	profileNext string
}

// KubeProxyMaxServices is the most services the real kube-proxy paths get:
// creating more through the API server takes too long on this machine.
const KubeProxyMaxServices = 1000

// kubeProxyPaths are the real kube-proxy paths.
var kubeProxyPaths = []string{report.PathKubeProxyIPTables, report.PathKubeProxyNFTables}

// runsKubeProxy says whether path (a kube-proxy path) runs at services:
// in full runs, or when Only names it, up to KubeProxyMaxServices.
func (c *Config) runsKubeProxy(path string, services int) bool {
	return (!c.Quick || slices.Contains(c.Only, path)) && services >= 1 && services <= KubeProxyMaxServices
}

// variant is one setup (path and service count) and the flow counts
// measured on it, in order: programming a large ruleset once per setup
// keeps the run short.
type variant struct {
	path     string
	services int
	flows    []int
}

func (c *Config) variants() []variant {
	many := c.Flows[len(c.Flows)-1]
	vs := []variant{{report.PathLimit, 0, []int{1}}, {report.PathKernel, 0, []int{many}}}
	for _, s := range c.Services {
		vs = append(vs, variant{report.PathIPTables, s, []int{many}})
	}
	for _, p := range []string{report.PathNFTables, report.PathXDProxy} {
		for i, s := range c.Services {
			flows := c.Flows
			// In the quick run the kernel's single-flow case is
			// measured at the smallest service count only.
			if p == report.PathNFTables && c.Quick && i > 0 {
				flows = []int{many}
			}
			vs = append(vs, variant{p, s, flows})
		}
	}
	for _, p := range kubeProxyPaths {
		for _, s := range c.Services {
			if c.runsKubeProxy(p, s) {
				vs = append(vs, variant{p, s, c.Flows})
			}
		}
	}
	if len(c.Only) == 0 {
		return vs
	}
	var out []variant
	for _, v := range vs {
		if v.path == report.PathLimit || slices.Contains(c.Only, v.path) {
			out = append(out, v)
		}
	}
	return out
}

// Run measures everything and returns the results; the caller writes them.
func Run(cfg *Config) (*report.Run, error) {
	if cfg.Log == nil {
		cfg.Log = log.New(os.Stderr, "", log.Ltime)
	}
	if len(cfg.Services) == 0 || len(cfg.Flows) == 0 {
		return nil, errors.New("runner: need service and flow counts")
	}
	r := &report.Run{
		Started: time.Now(), Quick: cfg.Quick, CPUs: runtime.NumCPU(), GenCPU: cfg.Plan.GenCPU, FwdCPU: cfg.Plan.ForwardCPU,
		FrameSize: cfg.FrameSize, Trial: cfg.Trial.String(), Tolerance: cfg.Tolerance,
		XDProxy: "the dataplane engine (package dataplane) run by xdproxy-bench's dataplane subcommand in its own process in the node namespace, workers pinned to the forwarding CPU, AF_XDP copy mode, 64-frame batches, conntrack capacity 1M",
		Clients: fmt.Sprintf("pods: every source is inside the cluster CIDR %v, so neither kube-proxy's rules nor xdproxy masquerade", topo.PodCIDR),
	}
	if cfg.XDProxyBin != "" {
		r.XDProxy = "the xdproxy binary (" + cfg.XDProxyBin + " run --config, services from a kubectl-style file) in the node namespace, workers pinned to the forwarding CPU by its config, AF_XDP copy mode, 64-frame batches, conntrack capacity 1M"
	}
	r.Kernel = strings.TrimSpace(cmdOut("uname", "-r"))
	r.LoadAvg = strings.Join(strings.Fields(readFile("/proc/loadavg"))[:3], " ")
	r.IPTables = strings.TrimSpace(cmdOut(cfg.IPTablesRestore, "--version"))
	r.NFT = strings.TrimSpace(cmdOut("nft", "--version"))

	var vs []variant
	if cfg.Packet {
		vs = cfg.variants()
	}
	kubeRan := false
	var ceiling float64
	for i, v := range vs {
		if report.IsKubeProxy(v.path) && cfg.KubeBinsErr != nil {
			r.Notes = append(r.Notes, fmt.Sprintf("skipped: %s, %d services: %v", v.path, v.services, cfg.KubeBinsErr))
			cfg.Log.Printf("[%d/%d] %s, %d services: skipped: %v", i+1, len(vs), v.path, v.services, cfg.KubeBinsErr)
			continue
		}
		kubeRan = kubeRan || report.IsKubeProxy(v.path)
		if cfg.Profile && cfg.XDProxyBin == "" && v.path == report.PathXDProxy && v.services == cfg.Services[len(cfg.Services)-1] {
			r.Profile = "xdproxy.cpu.pprof"
			cfg.profileNext = filepath.Join(cfg.OutDir, r.Profile)
		}
		cfg.Log.Printf("[%d/%d] %s, %d services, flows %v", i+1, len(vs), v.path, v.services, v.flows)
		results, gens, err := runPacket(cfg, v, ceiling)
		if v.path == report.PathLimit {
			if err != nil {
				return r, fmt.Errorf("%s: %w", v.path, err) // without the generator's ceiling nothing else can run
			}
			r.Generators = gens
			for _, g := range gens {
				if g.Mode == "afxdp" {
					ceiling = g.Pps
				}
			}
		}
		for _, res := range results {
			cfg.Log.Printf("    %d flows: zero-loss %.0f pps (at generator limit: %v), cost %.0f ns/pkt, setup %v",
				res.Flows, res.ZeroLoss, res.AtGenLimit, res.CostNs, res.Setup.Round(time.Millisecond))
			r.Packet = append(r.Packet, res)
		}
		if err != nil {
			if v.path == report.PathXDProxy && r.Profile != "" && cfg.profileNext == "" && len(results) == 0 {
				r.Profile = "" // the profiled process never ran
			}
			cfg.profileNext = ""
			err = fmt.Errorf("%s, %d services: %w", v.path, v.services, err)
			cfg.Log.Printf("    FAILED: %v", err)
			r.Notes = append(r.Notes, "not measured: "+err.Error())
		}
	}
	if cfg.Profile && cfg.XDProxyBin != "" && cfg.Packet {
		profileEngine(cfg, r, ceiling)
	}
	if cfg.TCP {
		for _, s := range cfg.TCPServices {
			for _, p := range append([]string{report.PathIPTables, report.PathNFTables, report.PathXDProxy}, kubeProxyPaths...) {
				if len(cfg.Only) > 0 && !slices.Contains(cfg.Only, p) {
					continue
				}
				if report.IsKubeProxy(p) {
					if !cfg.runsKubeProxy(p, s) {
						continue
					}
					if cfg.KubeBinsErr != nil {
						r.Notes = append(r.Notes, fmt.Sprintf("skipped: TCP %s, %d services: %v", p, s, cfg.KubeBinsErr))
						continue
					}
					kubeRan = true
				}
				cfg.Log.Printf("TCP: %s, %d services", p, s)
				t, err := runTCP(cfg, p, s)
				if err != nil {
					err = fmt.Errorf("TCP %s, %d services: %w", p, s, err)
					cfg.Log.Printf("    FAILED: %v", err)
					r.Notes = append(r.Notes, "not measured: "+err.Error())
					continue
				}
				cfg.Log.Printf("    %.0f conn/s, p50 %v p99 %v, %.1f us/conn forwarding, %d errors", t.CPS, t.P50, t.P99, t.CostUs, t.Errors)
				r.TCP = append(r.TCP, t)
			}
		}
	}
	if kubeRan {
		r.KubeProxy = fmt.Sprintf("the kube-proxy binary (%s, %s) in the node namespace in iptables or nftables mode with clusterCIDR %v, against its own etcd and kube-apiserver (services and EndpointSlices created through the API before it starts; cluster IPs from %v, because the API server's own Service takes %v and is programmed too, without endpoints); at most %d services; kube-proxy, etcd and kube-apiserver run on the generator CPU %d, off the forwarding CPU, and their CPU time is not part of the forwarding cost, which is the node's NAPI kthreads' as for the kernel paths",
			cfg.KubeBins.KubeProxy, strings.TrimSpace(cmdOut(cfg.KubeBins.KubeProxy, "--version")), topo.PodCIDR, KubeProxyVIPBase, VIPBase, KubeProxyMaxServices, cfg.Plan.GenCPU)
	}
	r.Duration = time.Since(r.Started)
	return r, nil
}

// PathProfiled names the extra measurement of the dataplane engine run by
// the dataplane subcommand under the CPU profiler, when the main xdproxy
// figures come from the binary (which has no profiler).
const PathProfiled = "xdproxy-engine-profiled"

// profileEngine measures xdproxy once more with the engine in the
// dataplane subcommand, which writes a CPU profile, at the most services
// the binary managed and the most flows.
func profileEngine(cfg *Config, r *report.Run, ceiling float64) {
	services := 0
	for _, p := range r.Packet {
		if p.Path == report.PathXDProxy {
			services = max(services, p.Services)
		}
	}
	if services == 0 || ceiling <= 0 {
		return
	}
	bin := cfg.XDProxyBin
	cfg.XDProxyBin = ""
	defer func() { cfg.XDProxyBin = bin }()
	r.Profile = "xdproxy.cpu.pprof"
	cfg.profileNext = filepath.Join(cfg.OutDir, r.Profile)
	v := variant{report.PathXDProxy, services, []int{cfg.Flows[len(cfg.Flows)-1]}}
	cfg.Log.Printf("[profile] the engine under the profiler, %d services, flows %v", v.services, v.flows)
	results, _, err := runPacket(cfg, v, ceiling)
	if err != nil {
		r.Profile = ""
		r.Notes = append(r.Notes, "profiled engine run failed: "+err.Error())
		return
	}
	for _, res := range results {
		res.Path = PathProfiled
		cfg.Log.Printf("    %d flows: zero-loss %.0f pps, cost %.0f ns/pkt", res.Flows, res.ZeroLoss, res.CostNs)
		r.Packet = append(r.Packet, res)
	}
}

func cmdOut(name string, args ...string) string {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	return string(out)
}

func readFile(p string) string {
	b, _ := os.ReadFile(p)
	return string(b) + "  -  -  -"
}

// runPacket sets up one variant and measures each of its flow counts.
// ceiling is the generator's AF_XDP ceiling (0 before the limit variant
// has measured it).
func runPacket(cfg *Config, v variant, ceiling float64) (out []report.Packet, gens []report.Generator, err error) {
	e, err := newEnv(cfg, v.path, v.services, v.flows[0], kernelrules.UDP)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if c := e.stopXDProxy(); c != "" && len(out) > 0 {
			out[len(out)-1].Note = strings.TrimSpace(out[len(out)-1].Note + " " + c + " (whole setup)")
		}
		err = errors.Join(err, e.close())
	}()
	for _, flows := range v.flows {
		e.aim(v.services, flows)
		res, g, err := measure(cfg, e, v.path, v.services, flows, ceiling)
		if err != nil {
			return out, gens, fmt.Errorf("%d flows: %w", flows, err)
		}
		if len(g) > 0 {
			gens = g
			ceiling = g[0].Pps
		}
		out = append(out, res)
	}
	return out, gens, nil
}

// measure runs the warm-up, the cost runs and the zero-loss search of one
// flow count on a live setup.
func measure(cfg *Config, e *env, path string, services, flows int, ceiling float64) (res report.Packet, gens []report.Generator, err error) {
	res = report.Packet{Path: path, Services: services, Flows: flows, Setup: e.setup, Note: e.note}

	if path == report.PathLimit {
		// The generators' own ceilings, straight into the XDP_DROP sink
		// on the forwarding CPU.
		m, err := e.trial("afxdp", 0, cfg.Trial, flows)
		if err != nil {
			return res, nil, err
		}
		gens = append(gens, report.Generator{Mode: "afxdp", Pps: m.point.Sent, Into: "XDP_DROP sink on n0 (forwarding CPU)"})
		ceiling = m.point.Sent
		cfg.Log.Printf("    generator ceiling afxdp %.0f pps (received %.0f)", m.point.Sent, m.point.Received)
		pm, err := e.trial("prog-run", 0, cfg.Trial, flows)
		if err != nil {
			cfg.Log.Printf("    prog-run generator failed: %v", err)
		} else {
			gens = append(gens, report.Generator{Mode: "prog-run (bursty)", Pps: pm.point.Sent, Into: fmt.Sprintf("XDP_DROP sink on n0 (received %.0f pps, loss %.1f%%, %.0f ns/pkt)", pm.point.Received, pm.point.Loss()*100, pm.costNs)})
			cfg.Log.Printf("    generator ceiling prog-run %.0f pps (received %.0f, %.0f ns/pkt)", pm.point.Sent, pm.point.Received, pm.costNs)
			res.Note = fmt.Sprintf("fed with AF_XDP-sent skbs, which a veth must copy into an XDP buffer; fed with XDP frames (prog-run) the same sink dropped %.0f pps at %.0f ns/pkt", pm.point.Received, pm.costNs)
		}
	}
	if ceiling <= 0 {
		return res, gens, errors.New("no generator ceiling measured")
	}
	// Warm up: conntrack and caches see every flow, and a path that
	// delivers nothing fails here rather than after a search. A path
	// whose new flows are slow (iptables' linear chain) gets up to
	// WarmUps trials to establish them; if that is not enough, the cost
	// runs measure mostly new flows, and the note says so.
	warm := max(float64(flows)/(cfg.Trial.Seconds()*0.9), 50_000)
	for i := 1; ; i++ {
		wm, err := e.trial("afxdp", min(warm, 0.5*ceiling), cfg.Trial, flows)
		if err != nil {
			return res, gens, err
		}
		if wm.recvPkt == 0 {
			return res, gens, fmt.Errorf("warm-up: %d sent, nothing arrived at the sink", wm.genRes.Sent)
		}
		if wm.point.Loss() < 0.01 {
			break
		}
		if i >= cfg.WarmUps {
			res.Note = strings.TrimSpace(fmt.Sprintf("%s After %d warm-up trials %.0f%% of packets were still lost: the flows were not all established, so the cost runs measure mostly new flows.", res.Note, i, wm.point.Loss()*100))
			break
		}
	}
	costRate := cfg.CostRate
	if costRate <= 0 {
		costRate = min(200_000, 0.5*ceiling)
	}
	res.CostRate = costRate
	var costs, cpus, losses []float64
	for range cfg.CostRuns {
		m, err := e.trial("afxdp", costRate, cfg.Trial, flows)
		if err != nil {
			return res, gens, err
		}
		costs = append(costs, m.costNs)
		cpus = append(cpus, m.cpuNs)
		losses = append(losses, m.point.Loss())
	}
	res.CostRuns, res.CostNs, res.CPUNs, res.CostLoss = costs, search.Median(costs), search.Median(cpus), search.Median(losses)

	sr, err := search.ZeroLoss(search.Options{
		Max: 0.97 * ceiling, Min: 10_000, LossTolerance: cfg.Tolerance, Resolution: 0.05, MaxTrials: cfg.SearchTrials, Retries: 1,
	}, func(rate float64) (search.Point, error) {
		m, err := e.trial("afxdp", rate, cfg.Trial, flows)
		return m.point, err
	})
	if err != nil {
		return res, gens, err
	}
	res.ZeroLoss, res.AtGenLimit, res.Curve = sr.Throughput, sr.AtMax, sr.Points
	if cfg.CurvePoints > 0 {
		var rates []float64
		for i := 1; i <= cfg.CurvePoints; i++ {
			rates = append(rates, 0.97*ceiling*float64(i)/float64(cfg.CurvePoints))
		}
		pts, err := search.Curve(rates, func(rate float64) (search.Point, error) {
			m, err := e.trial("afxdp", rate, cfg.Trial, flows)
			return m.point, err
		})
		if err != nil {
			return res, gens, err
		}
		res.Curve = append(res.Curve, pts...)
	}
	return res, gens, nil
}
