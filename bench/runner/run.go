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

	"github.com/xdproxy/xdproxy/bench/feed"
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
	// Feeds are how the generator's frames reach the node; every packet
	// variant runs on each.
	Feeds []feed.Kind
	// Services are the service counts; Traffic the traffic patterns
	// measured on every packet variant.
	Services []int
	Traffic  []Traffic
	// Trial is the length of one trial; CostRuns how many cost runs make
	// the median; SearchTrials caps the zero-loss search; CostRate is the
	// rate of the cost runs (0: half the generator's ceiling, at most
	// 200 kpps).
	Trial        time.Duration
	CostRuns     int
	SearchTrials int
	CostRate     float64
	CurvePoints  int // extra evenly spaced curve points beyond the search's
	WarmUps      int // most warm-up trials of long flows before the cost runs
	FrameSize    int
	Tolerance    float64
	Settle       time.Duration
	// Packet runs the packet-rate variants; TCP the connection test.
	Packet         bool
	TCP            bool
	TCPServices    []int
	TCPDuration    time.Duration
	TCPConcurrency int
	// TCPRounds is how many times each path runs the TCP test, the
	// paths in turn; the report keeps each path's median round.
	TCPRounds int
	// Self is this program (for its tcp-server and tcp-client
	// subcommands), Pktgen the generator, XDProxyBin the xdproxy binary
	// measured (xdproxy run --config with a generated config).
	Self, Pktgen, XDProxyBin string
	IPTablesRestore          string
	// RulesTimeout bounds one ruleset load (nft -f slows down more than
	// linearly with the number of chains).
	RulesTimeout time.Duration
	// Profile takes CPU profiles of the running xdproxy binary (poll
	// mode) at ProfileServices services (0: 1,000 if measured, else the
	// most), one per feed and traffic, each during an extra trial of
	// ProfileTrial at the cost rate.
	Profile         bool
	ProfileServices int
	ProfileTrial    time.Duration
	OutDir          string
	Log             *log.Logger
	// Nice is the nice value of every thread the benchmark runs or
	// pins (generator, NAPI kthreads, xdproxy), so that other work on a
	// shared machine disturbs all paths less and equally.
	Nice int
	// RTPriority, when positive, makes the NAPI kthreads on the
	// forwarding CPU SCHED_FIFO at this priority and xdproxy's poll-mode
	// workers at ten less: work that other processes of a shared machine
	// cannot preempt, for the kernel paths (all of whose forwarding runs
	// in NAPI) and xdproxy alike.
	RTPriority int
	// Only restricts the run to these paths (the limit always runs).
	Only []string
	// Verbose logs every trial.
	Verbose bool
	// QuietWait is the longest a group waits to start for the machine to
	// be quiet (both CPUs together under QuietBusy busy, with nothing of
	// the benchmark running), so that others' work on a shared machine
	// spoils fewer measurements; 0 does not wait.
	QuietWait time.Duration
	QuietBusy float64
	// Redos is how often a cost run is repeated when other work held the
	// forwarding CPU for more than RedoOther of it.
	Redos     int
	RedoOther float64
	// KubeBins are the control plane and kube-proxy binaries of the real
	// kube-proxy paths; KubeBinsErr, when set, says why they are missing
	// and those paths are skipped.
	KubeBins    kubeproxy.Binaries
	KubeBinsErr error
}

// KubeProxyMaxServices is the most services the real kube-proxy paths get:
// creating more through the API server takes too long on this machine.
const KubeProxyMaxServices = 1000

// SmallPathMaxServices is the most services of the paths that full runs
// measure at small service counts only (the iptables shape, whose linear
// chain makes 10,000 services useless, and busy polling), unless Only
// names them.
const SmallPathMaxServices = 1000

// runs says whether path is measured at services in this run.
func (c *Config) runs(path string, services int) bool {
	named := slices.Contains(c.Only, path)
	if len(c.Only) > 0 && !named && path != report.PathLimit {
		return false
	}
	switch path {
	case report.PathLimit:
		return true
	case report.PathNFTables, report.PathXDProxy, report.PathIOFloor:
		return true
	case report.PathKernel:
		return !c.Quick || named
	case report.PathIPTables, report.PathBusyPoll:
		return named || !c.Quick && services <= SmallPathMaxServices
	case report.PathKubeProxyIPTables, report.PathKubeProxyNFTables:
		return (!c.Quick || named) && services >= 1 && services <= KubeProxyMaxServices
	}
	return false
}

// variant is one setup: a path at a service count, on a feed.
type variant struct {
	feed     feed.Kind
	path     string
	services int
}

// group is a set of variants set up together, whose trials interleave:
// every traffic pattern's cost runs go round the group, one trial each, so
// that the paths compared side by side share the same moments of a shared
// machine's noise. Paths that would disturb the others while idle run
// alone: busy polling (its workers spin on the forwarding CPU) and the real
// kube-proxy (its control plane runs on the generator CPU).
type group []variant

// alone says whether path runs in a group of its own.
func alone(path string) bool {
	return path == report.PathLimit || path == report.PathBusyPoll || report.IsKubeProxy(path)
}

// groups lists the setups in the order they run: per feed the limit (the
// generator's ceiling, which every search needs), then per service count
// the paths measured together (plain forwarding joins the first), then
// that count's paths that run alone.
func (c *Config) groups() []group {
	order := []string{report.PathNFTables, report.PathIPTables, report.PathIOFloor, report.PathXDProxy,
		report.PathKubeProxyNFTables, report.PathKubeProxyIPTables, report.PathBusyPoll}
	var gs []group
	for _, f := range c.Feeds {
		gs = append(gs, group{{f, report.PathLimit, 0}})
		var together group
		if c.runs(report.PathKernel, 0) {
			together = append(together, variant{f, report.PathKernel, 0})
		}
		for _, s := range c.Services {
			var singles []group
			for _, p := range order {
				if !c.runs(p, s) {
					continue
				}
				if alone(p) {
					singles = append(singles, group{{f, p, s}})
				} else {
					together = append(together, variant{f, p, s})
				}
			}
			if len(together) > 0 {
				gs = append(gs, together)
			}
			gs = append(gs, singles...)
			together = nil
		}
		if len(together) > 0 {
			gs = append(gs, together)
		}
	}
	return gs
}

// profileServices is the service count profiled.
func (c *Config) profileServices() int {
	if c.ProfileServices > 0 {
		return c.ProfileServices
	}
	if slices.Contains(c.Services, 1000) {
		return 1000
	}
	return slices.Max(c.Services)
}

// tcpPaths are the paths of the TCP test at services.
func (c *Config) tcpPaths(services int) []string {
	var out []string
	for _, p := range []string{report.PathNFTables, report.PathIPTables, report.PathXDProxy, report.PathKubeProxyNFTables, report.PathKubeProxyIPTables} {
		if p == report.PathIPTables && c.Quick && !slices.Contains(c.Only, p) {
			continue
		}
		if c.runs(p, services) {
			out = append(out, p)
		}
	}
	return out
}

// TCPFeed describes how the TCP test's traffic reaches the node.
const TCPFeed = "real sockets: the client in the generator namespace connects through g0, so n0 receives the skbs a veth carries from a pod (the pod feed), and the server answers from the sink namespace; client and server run on the generator CPU"

// Run measures everything and returns the results; the caller writes them.
func Run(cfg *Config) (*report.Run, error) {
	if cfg.Log == nil {
		cfg.Log = log.New(os.Stderr, "", log.Ltime)
	}
	if len(cfg.Services) == 0 || len(cfg.Traffic) == 0 || len(cfg.Feeds) == 0 {
		return nil, errors.New("runner: need service counts, traffic and feeds")
	}
	if cfg.XDProxyBin == "" {
		return nil, errors.New("runner: no xdproxy binary (make build)")
	}
	r := &report.Run{
		Started: time.Now(), Quick: cfg.Quick, CPUs: runtime.NumCPU(), GenCPU: cfg.Plan.GenCPU, FwdCPU: cfg.Plan.ForwardCPU,
		FrameSize: cfg.FrameSize, Trial: cfg.Trial.String(), Tolerance: cfg.Tolerance,
		XDProxy: "the xdproxy binary (" + cfg.XDProxyBin + " run --config, services from a kubectl-style file, ready once its admin socket shows the table with every frontend) in the node namespace, workers pinned to the forwarding CPU by its config, AF_XDP copy mode, 64-frame batches, conntrack capacity 1M; poll mode (default), busy poll (busyPoll: true), or the I/O floor (benchmark.ioFloor: every frame forwarded untranslated to the sink's next hop)",
		Clients: fmt.Sprintf("pods: every source is inside the cluster CIDR %v, so neither kube-proxy's rules nor xdproxy masquerade", topo.PodCIDR),
		TCPFeed: TCPFeed, TCPRounds: max(cfg.TCPRounds, 1),
	}
	r.XDProxy = strings.TrimSpace(cmdOut(cfg.XDProxyBin, "version")) + ": " + r.XDProxy
	r.Scheduling = fmt.Sprintf("every NAPI kthread of the topology at nice %d, xdproxy and the generator at nice %d", cfg.Nice, cfg.Nice)
	if cfg.RTPriority > 0 {
		r.Scheduling = fmt.Sprintf("the NAPI kthreads on the forwarding CPU SCHED_FIFO %d (as a NIC's softirqs run before any thread) and xdproxy's poll-mode workers SCHED_FIFO %d, so that other work on this shared machine cannot preempt the forwarding of either; busy-polling workers, which never sleep, stay ordinary threads, as do xdproxy's other threads, the generator and the NAPI kthreads on the generator's CPU (nice %d: a real-time one there would preempt the generator at every frame and feed n0 one frame at a time)",
			cfg.RTPriority, cfg.workerPriority(), cfg.Nice)
	}
	for _, f := range cfg.Feeds {
		r.Feeds = append(r.Feeds, report.Feed{Name: string(f), Description: f.Describe(cfg.Plan)})
	}
	r.Kernel = strings.TrimSpace(cmdOut("uname", "-r"))
	r.LoadAvg = strings.Join(strings.Fields(readFile("/proc/loadavg"))[:3], " ")
	r.IPTables = strings.TrimSpace(cmdOut(cfg.IPTablesRestore, "--version"))
	r.NFT = strings.TrimSpace(cmdOut("nft", "--version"))

	var gs []group
	if cfg.Packet {
		gs = cfg.groups()
	}
	kubeRan := false
	ceilings := map[feed.Kind]float64{}
	for i, g := range gs {
		var run group
		for _, v := range g {
			if report.IsKubeProxy(v.path) && cfg.KubeBinsErr != nil {
				r.Notes = append(r.Notes, fmt.Sprintf("skipped: %s feed, %s, %d services: %v", v.feed, v.path, v.services, cfg.KubeBinsErr))
				cfg.Log.Printf("[%d/%d] %s feed, %s, %d services: skipped: %v", i+1, len(gs), v.feed, v.path, v.services, cfg.KubeBinsErr)
				continue
			}
			kubeRan = kubeRan || report.IsKubeProxy(v.path)
			run = append(run, v)
		}
		if len(run) == 0 {
			continue
		}
		cfg.Log.Printf("[%d/%d] %s", i+1, len(gs), run)
		if n := waitQuiet(cfg); n != "" {
			r.Notes = append(r.Notes, fmt.Sprintf("%v: %s", run, n))
		}
		out := runGroup(cfg, run, ceilings[run[0].feed])
		if run[0].path == report.PathLimit {
			if len(out.gens) == 0 {
				return r, fmt.Errorf("%s feed, %s: %w", run[0].feed, run[0].path, errors.Join(out.errs...)) // without the generator's ceiling nothing else can run
			}
			r.Generators = append(r.Generators, out.gens...)
			ceilings[run[0].feed] = out.gens[len(out.gens)-1].Pps
		}
		for _, res := range out.results {
			cfg.Log.Printf("    %s, %d services, %s: %.0f ns/pkt (loss %.2f%%), zero-loss %.0f pps (at generator limit: %v), setup %v",
				res.Path, res.Services, res.Label(), res.CostNs, res.CostLoss*100, res.ZeroLoss, res.AtGenLimit, res.Setup.Round(time.Millisecond))
			r.Packet = append(r.Packet, res)
		}
		r.Profiles = append(r.Profiles, out.profiles...)
		for _, err := range out.errs {
			cfg.Log.Printf("    FAILED: %v", err)
			r.Notes = append(r.Notes, "not measured: "+err.Error())
		}
	}
	if cfg.TCP {
		for _, s := range cfg.TCPServices {
			var paths []string
			for _, p := range cfg.tcpPaths(s) {
				if report.IsKubeProxy(p) {
					if cfg.KubeBinsErr != nil {
						r.Notes = append(r.Notes, fmt.Sprintf("skipped: TCP %s, %d services: %v", p, s, cfg.KubeBinsErr))
						continue
					}
					kubeRan = true
				}
				paths = append(paths, p)
			}
			// Rounds go through the paths in turn, so that a slow spell of
			// this shared machine falls on all of them alike; each path
			// reports its median round.
			rounds := map[string][]report.TCP{}
			for round := 1; round <= max(cfg.TCPRounds, 1); round++ {
				for _, p := range paths {
					cfg.Log.Printf("TCP: %s, %d services, round %d", p, s, round)
					t, err := runTCP(cfg, p, s)
					if err != nil {
						err = fmt.Errorf("TCP %s, %d services, round %d: %w", p, s, round, err)
						cfg.Log.Printf("    FAILED: %v", err)
						r.Notes = append(r.Notes, "round failed (the path's other rounds still count): "+err.Error())
						continue
					}
					cfg.Log.Printf("    %.0f conn/s, p50 %v p99 %v, %.1f us/conn forwarding, %d errors", t.CPS, t.P50, t.P99, t.CostUs, t.Errors)
					rounds[p] = append(rounds[p], t)
				}
			}
			for _, p := range paths {
				if len(rounds[p]) > 0 {
					r.TCP = append(r.TCP, report.MedianTCP(rounds[p]))
				}
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

func (v variant) String() string {
	return fmt.Sprintf("%s feed, %s, %d services", v.feed, v.path, v.services)
}

func (g group) String() string {
	var ps []string
	for _, v := range g {
		ps = append(ps, fmt.Sprintf("%s at %d", v.path, v.services))
	}
	return fmt.Sprintf("%s feed: %s", g[0].feed, strings.Join(ps, ", "))
}

// packetOut is what one group measured.
type packetOut struct {
	results  []report.Packet
	gens     []report.Generator
	profiles []report.Profile
	errs     []error
}

// member is one variant of a group while it is measured.
type member struct {
	variant
	e   *env
	res report.Packet
	// The cost runs of the current traffic, how many were done again
	// because other work held the forwarding CPU, and how many were still
	// disturbed after the last try.
	costs, cpus, losses, feedLosses, others []float64
	redone, disturbed                       int
}

// runGroup sets up a group's variants and measures each traffic pattern
// on them, interleaving their cost runs. ceiling is the generator's
// ceiling on the group's feed (0 before the limit has measured it). A
// variant that fails is reported in errs and leaves the group; the others
// go on.
func runGroup(cfg *Config, g group, ceiling float64) (out packetOut) {
	var ms []*member
	fail := func(m *member, tr *Traffic, err error) {
		if tr != nil {
			err = fmt.Errorf("%v: %w", *tr, err)
		}
		out.errs = append(out.errs, fmt.Errorf("%v: %w", m.variant, err))
		if c := m.e.stopXDProxy(); c != "" {
			out.errs[len(out.errs)-1] = fmt.Errorf("%w (%s)", out.errs[len(out.errs)-1], c)
		}
		if err := m.e.close(); err != nil {
			out.errs = append(out.errs, fmt.Errorf("%v: %w", m.variant, err))
		}
		m.e = nil
	}
	for _, v := range g {
		e, err := newEnv(cfg, v.feed, v.path, v.services, kernelrules.UDP)
		if err != nil {
			out.errs = append(out.errs, fmt.Errorf("%v: %w", v, err))
			continue
		}
		ms = append(ms, &member{variant: v, e: e})
	}
	live := func() []*member {
		var l []*member
		for _, m := range ms {
			if m.e != nil {
				l = append(l, m)
			}
		}
		return l
	}
	defer func() {
		for _, m := range live() {
			if c := m.e.stopXDProxy(); c != "" {
				for i := len(out.results) - 1; i >= 0; i-- {
					if r := &out.results[i]; r.Path == m.path && r.Services == m.services {
						r.Note = strings.TrimSpace(r.Note + " " + c + " (whole setup)")
						break
					}
				}
			}
			if err := m.e.close(); err != nil {
				out.errs = append(out.errs, fmt.Errorf("%v: %w", m.variant, err))
			}
		}
	}()
	traffic := cfg.Traffic
	if len(g) == 1 && g[0].path == report.PathLimit {
		traffic = traffic[:1] // the sink drops every frame alike
	}
	for _, tr := range traffic {
		for _, m := range live() {
			m.e.aim(m.services, tr)
			m.res = report.Packet{Feed: string(m.feed), Path: m.path, Services: m.services, Traffic: tr.Name(), Flows: tr.Flows,
				Setup: m.e.setup, Note: m.e.note, FeedLoss: -1}
			m.costs, m.cpus, m.losses, m.feedLosses, m.others, m.redone, m.disturbed = nil, nil, nil, nil, nil, 0, 0
			if m.path == report.PathLimit && ceiling <= 0 {
				// The generator's ceiling, straight into the XDP_DROP
				// sink on n0.
				t, err := m.e.trial(0, cfg.Trial, tr)
				if err != nil {
					fail(m, &tr, err)
					continue
				}
				ceiling = t.point.Sent
				out.gens = append(out.gens, report.Generator{Feed: string(m.feed), Mode: "afxdp", Pps: ceiling,
					Into: fmt.Sprintf("XDP_DROP sink on n0 (forwarding CPU), %v; received %.0f pps", tr, t.point.Received)})
				cfg.Log.Printf("    generator ceiling %.0f pps (received %.0f)", t.point.Sent, t.point.Received)
			}
		}
		if ceiling <= 0 {
			for _, m := range live() {
				fail(m, &tr, errors.New("no generator ceiling measured"))
			}
			return out
		}
		costRate := cfg.CostRate
		if costRate <= 0 {
			costRate = min(200_000, 0.5*ceiling)
		}
		for _, m := range live() {
			err := warmUp(cfg, m, tr, costRate, ceiling)
			if err == nil && m.e.xdproxy != nil {
				err = m.e.xdproxy.checkMode(m.path)
			}
			if err != nil {
				fail(m, &tr, err)
			}
		}
		// The cost runs, round the group. A run during which other work
		// held the forwarding CPU is done again, up to Redos times.
		for range cfg.CostRuns {
			for _, m := range live() {
				var t measurement
				var err error
				for try := 0; ; try++ {
					if t, err = m.e.trial(costRate, cfg.Trial, tr); err != nil || t.otherShare <= cfg.RedoOther || try >= cfg.Redos {
						break
					}
					m.redone++
				}
				if err != nil {
					fail(m, &tr, err)
					continue
				}
				if t.otherShare > cfg.RedoOther {
					m.disturbed++
				}
				m.costs, m.cpus, m.losses = append(m.costs, t.costNs), append(m.cpus, t.cpuNs), append(m.losses, t.point.Loss())
				m.others = append(m.others, t.otherShare)
				if t.feedLoss >= 0 {
					m.feedLosses = append(m.feedLosses, t.feedLoss)
				}
			}
		}
		for _, m := range live() {
			res := &m.res
			res.CostRate = costRate
			res.CostRuns, res.CostNs, res.CPUNs, res.CostLoss = m.costs, search.Median(m.costs), search.Median(m.cpus), search.Median(m.losses)
			res.OtherWork = search.Median(m.others)
			if len(m.feedLosses) == len(m.costs) {
				res.FeedLoss = search.Median(m.feedLosses)
			}
			if m.redone > 0 {
				res.Note = strings.TrimSpace(fmt.Sprintf("%s %d cost runs were done again because other work held the forwarding CPU for more than %.0f%% of them; %d of the %d kept were still disturbed.",
					res.Note, m.redone, cfg.RedoOther*100, m.disturbed, len(m.costs)))
			}
			if cfg.Profile && m.path == report.PathXDProxy && m.services == cfg.profileServices() {
				pr, err := m.e.profileTrial(costRate, tr)
				if err != nil {
					res.Note = strings.TrimSpace(res.Note + " No profile: " + err.Error())
				} else {
					pr.Of = fmt.Sprintf("%s feed, %s, %d services, %v at %.0f kpps", m.feed, m.path, m.services, tr, costRate/1000)
					out.profiles = append(out.profiles, pr)
				}
			}
			if err := zeroLoss(cfg, m, tr, ceiling); err != nil {
				fail(m, &tr, err)
				continue
			}
			out.results = append(out.results, *res)
		}
	}
	return out
}

// waitQuiet waits up to cfg.QuietWait for the machine to be quiet and
// says how that went when it had to wait ("" otherwise).
func waitQuiet(cfg *Config) string {
	if cfg.QuietWait <= 0 {
		return ""
	}
	cpus := []int{cfg.Plan.GenCPU, cfg.Plan.ForwardCPU}
	start := time.Now()
	busy := 0.0
	for {
		b, err := MachineBusy(cpus, time.Second)
		if err != nil {
			return ""
		}
		busy = b
		if busy <= cfg.QuietBusy {
			break
		}
		if time.Since(start) >= cfg.QuietWait {
			cfg.Log.Printf("    the machine is still %.0f%% busy with other work after %v; measuring anyway", busy*100, cfg.QuietWait)
			return fmt.Sprintf("started while other work kept the machine %.0f%% busy (waited %v for it to calm down)", busy*100, cfg.QuietWait)
		}
	}
	if waited := time.Since(start); waited > 2*time.Second {
		cfg.Log.Printf("    waited %v for other work to calm down", waited.Round(time.Second))
	}
	return ""
}

// warmUp sends before the cost runs. Long flows: conntrack and caches see
// every flow, and a path that delivers nothing fails here rather than
// after a search; a path whose new flows are slow (iptables' linear chain)
// gets up to WarmUps trials to establish them, and if that is not enough
// the note says the cost runs measure mostly new flows. New flows: one
// trial at the cost rate.
func warmUp(cfg *Config, m *member, tr Traffic, costRate, ceiling float64) error {
	for i := 1; ; i++ {
		rate := min(max(float64(tr.Flows)/(cfg.Trial.Seconds()*0.9), 50_000), 0.5*ceiling)
		if tr.New {
			rate = costRate
		}
		t, err := m.e.trial(rate, cfg.Trial, tr)
		if err != nil {
			return err
		}
		if t.recvPkt == 0 {
			return fmt.Errorf("warm-up: %d sent, nothing arrived at the sink", t.genRes.Sent)
		}
		if tr.New || t.point.Loss() < 0.01 {
			return nil
		}
		if i >= cfg.WarmUps {
			m.res.Note = strings.TrimSpace(fmt.Sprintf("%s After %d warm-up trials %.0f%% of packets were still lost: the flows were not all established, so the cost runs measure mostly new flows.", m.res.Note, i, t.point.Loss()*100))
			return nil
		}
	}
}

// zeroLoss runs the zero-loss search and the extra curve points of one
// member.
func zeroLoss(cfg *Config, m *member, tr Traffic, ceiling float64) error {
	sr, err := search.ZeroLoss(search.Options{
		Max: 0.97 * ceiling, Min: 10_000, LossTolerance: cfg.Tolerance, Resolution: 0.05, MaxTrials: cfg.SearchTrials, Retries: 1,
	}, func(rate float64) (search.Point, error) {
		t, err := m.e.trial(rate, cfg.Trial, tr)
		return t.point, err
	})
	if err != nil {
		return err
	}
	m.res.ZeroLoss, m.res.AtGenLimit, m.res.Curve = sr.Throughput, sr.AtMax, sr.Points
	if cfg.CurvePoints > 0 {
		var rates []float64
		for i := 1; i <= cfg.CurvePoints; i++ {
			rates = append(rates, 0.97*ceiling*float64(i)/float64(cfg.CurvePoints))
		}
		pts, err := search.Curve(rates, func(rate float64) (search.Point, error) {
			t, err := m.e.trial(rate, cfg.Trial, tr)
			return t.point, err
		})
		if err != nil {
			return err
		}
		m.res.Curve = append(m.res.Curve, pts...)
	}
	return nil
}

// profileName is the file name of the profile of a feed and traffic.
func profileName(f feed.Kind, tr Traffic) string {
	return filepath.Base(fmt.Sprintf("xdproxy.%s.%s.cpu.pprof", f, tr.Name()))
}
