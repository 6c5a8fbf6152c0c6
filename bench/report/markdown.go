package report

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Targets of the benchmark (goals, not timed tests), from the issue
// "Faster than the kernel it replaces".
const (
	// TargetLongVsNFT bounds xdproxy's CPU per packet as a share of the
	// kernel's in kube-proxy's nftables shape, with long flows.
	TargetLongVsNFT = 0.5
	// TargetNewVsNFT is the same with a new flow per packet.
	TargetNewVsNFT = 0.7
	// TargetLoss bounds the loss at the cost rate.
	TargetLoss = 0.001
	// TargetCPSVsKernel is the least TCP connections per second as a
	// share of the kernel paths'.
	TargetCPSVsKernel = 1.0
	// TargetScaleGrowth bounds how much more CPU per packet xdproxy may
	// spend at the most services than at 1.
	TargetScaleGrowth = 0.10
)

// Verdict is one target's outcome.
type Verdict struct {
	Target string
	Want   string
	Got    string
	// Missed says by how much the target was missed ("" when met or not
	// measured).
	Missed string
	Met    bool
	Known  bool // false when the run lacks the measurements
}

func kpps(v float64) string { return fmt.Sprintf("%.0f", v/1000) }

// traffics lists the traffic patterns of the xdproxy rows, long first.
func (r *Run) traffics() []string {
	var out []string
	for _, t := range []string{TrafficLong, TrafficNew} {
		for _, p := range r.Packet {
			if p.Traffic == t {
				out = append(out, t)
				break
			}
		}
	}
	return out
}

// services lists the service counts measured on path (all feeds).
func (r *Run) services(path string) []int {
	set := map[int]bool{}
	for _, p := range r.Packet {
		if p.Path == path {
			set[p.Services] = true
		}
	}
	return sortedKeys(set)
}

// trafficOf returns the label of traffic as measured in r (the flow count
// of its rows).
func (r *Run) trafficOf(traffic string) string {
	for _, p := range r.Packet {
		if p.Traffic == traffic {
			return p.Label()
		}
	}
	return TrafficLabel(traffic, 0)
}

// ratioMiss says how far a "<= goal" ratio is over its goal.
func ratioMiss(ratio, goal float64) string {
	return fmt.Sprintf("%.2fx over the goal: needs %.0f%% less CPU per packet", ratio/goal, 100*(1-goal/ratio))
}

// Targets evaluates the targets on r, for every feed it measured.
func Targets(r *Run) []Verdict {
	var out []Verdict
	feeds := r.FeedNames()
	for _, feed := range feeds {
		in := ""
		if len(feeds) > 1 {
			in = ", " + feed + " feed"
		}
		for _, tr := range r.traffics() {
			goal := TargetLongVsNFT
			if tr == TrafficNew {
				goal = TargetNewVsNFT
			}
			for _, s := range r.services(PathXDProxy) {
				x, ok1 := r.Find(feed, PathXDProxy, s, tr)
				if !ok1 {
					continue
				}
				v := Verdict{Target: fmt.Sprintf("CPU per packet vs kernel nftables shape (%d services, %s%s)", s, r.trafficOf(tr), in),
					Want: fmt.Sprintf("<= %.1fx", goal)}
				if n, ok2 := r.Find(feed, PathNFTables, s, tr); ok2 && x.CostNs > 0 && n.CostNs > 0 {
					ratio := x.CostNs / n.CostNs
					v.Known, v.Met = true, ratio <= goal
					v.Got = fmt.Sprintf("%.2fx (%.0f vs %.0f ns)", ratio, x.CostNs, n.CostNs)
					if !v.Met {
						v.Missed = ratioMiss(ratio, goal)
						// Say when the goal lies below what the sockets
						// alone cost: no translation can then meet it.
						if _, floor, ok := r.OwnNs(x); ok && floor.CostNs/n.CostNs > goal {
							v.Missed += fmt.Sprintf("; the I/O floor alone (%d services, no translation) is %.2fx: the goal is below it",
								floor.Services, floor.CostNs/n.CostNs)
						}
					}
				}
				out = append(out, v)
			}
			// Loss at the cost rate, the worst service count.
			v := Verdict{Target: fmt.Sprintf("loss at the cost rate (%s%s, every service count)", r.trafficOf(tr), in), Want: fmt.Sprintf("< %.1f%%", TargetLoss*100)}
			worst, worstS := -1.0, 0
			for _, s := range r.services(PathXDProxy) {
				if x, ok := r.Find(feed, PathXDProxy, s, tr); ok && x.CostRate > 0 && x.CostLoss > worst {
					worst, worstS = x.CostLoss, s
				}
			}
			if worst >= 0 {
				v.Known, v.Met = true, worst < TargetLoss
				v.Got = fmt.Sprintf("at most %.3f%% (%d services)", worst*100, worstS)
				if !v.Met {
					v.Missed = fmt.Sprintf("by %.3f percentage points", (worst-TargetLoss)*100)
				}
			}
			out = append(out, v)
			// Scale: the most services against 1.
			if svcs := r.services(PathXDProxy); len(svcs) > 1 {
				lo, hi := svcs[0], svcs[len(svcs)-1]
				v := Verdict{Target: fmt.Sprintf("CPU per packet at %d vs %d services (%s%s)", hi, lo, r.trafficOf(tr), in),
					Want: fmt.Sprintf("<= +%.0f%%", TargetScaleGrowth*100)}
				a, ok1 := r.Find(feed, PathXDProxy, lo, tr)
				b, ok2 := r.Find(feed, PathXDProxy, hi, tr)
				if ok1 && ok2 && a.CostNs > 0 && b.CostNs > 0 {
					growth := b.CostNs/a.CostNs - 1
					v.Known, v.Met = true, growth <= TargetScaleGrowth
					v.Got = fmt.Sprintf("%+.1f%% (%.0f vs %.0f ns)", growth*100, b.CostNs, a.CostNs)
					if !v.Met {
						v.Missed = fmt.Sprintf("by %.1f percentage points", (growth-TargetScaleGrowth)*100)
					}
				}
				out = append(out, v)
			}
		}
	}
	for _, t := range r.TCP {
		if t.Path != PathXDProxy {
			continue
		}
		for _, kp := range []string{PathNFTables, PathIPTables, PathKubeProxyNFTables, PathKubeProxyIPTables} {
			k, ok := r.FindTCP(kp, t.Services)
			if !ok {
				continue
			}
			v := Verdict{Target: fmt.Sprintf("TCP connections/s vs %s (%d services)", PathLabel(kp), t.Services), Want: fmt.Sprintf(">= %.1fx", TargetCPSVsKernel)}
			if k.CPS > 0 {
				ratio := t.CPS / k.CPS
				v.Known, v.Met = true, ratio >= TargetCPSVsKernel
				v.Got = fmt.Sprintf("%.2fx (%.0f vs %.0f conn/s; forwarding %.1f vs %.1f us/conn)", ratio, t.CPS, k.CPS, t.CostUs, k.CostUs)
				if !v.Met && ratio > 0 {
					v.Missed = fmt.Sprintf("by %.0f%%: needs %.2fx the connections/s", 100*(1-ratio/TargetCPSVsKernel), TargetCPSVsKernel/ratio)
				}
			}
			out = append(out, v)
		}
	}
	return out
}

func findAny(r *Run, feed, path string) (Packet, bool) {
	for _, p := range r.Packet {
		if p.Feed == feed && p.Path == path {
			return p, true
		}
	}
	return Packet{}, false
}

// FloorFor returns the I/O floor row that xdproxy's own cost of p is
// measured against: same feed and traffic, the same service count or else
// the nearest one measured.
func (r *Run) FloorFor(p Packet) (Packet, bool) {
	var best Packet
	found := false
	for _, f := range r.Packet {
		if f.Path != PathIOFloor || f.Feed != p.Feed || f.Traffic != p.Traffic || f.CostNs <= 0 {
			continue
		}
		if !found || absInt(f.Services-p.Services) < absInt(best.Services-p.Services) {
			best, found = f, true
		}
	}
	return best, found
}

// OwnNs is xdproxy's own cost per packet on row p: its forwarding cost
// minus the I/O floor's (FloorFor); ok is false without a floor.
func (r *Run) OwnNs(p Packet) (ns float64, floor Packet, ok bool) {
	if p.Path != PathXDProxy && p.Path != PathBusyPoll || p.CostNs <= 0 {
		return 0, Packet{}, false
	}
	f, ok := r.FloorFor(p)
	if !ok {
		return 0, Packet{}, false
	}
	return p.CostNs - f.CostNs, f, true
}

func absInt(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sortedKeys(m map[int]bool) []int {
	var out []int
	for k := range m {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}

// WriteMarkdown writes report.md into dir.
func WriteMarkdown(dir string, r *Run, plots []string) error {
	f, err := os.Create(filepath.Join(dir, ReportMD))
	if err != nil {
		return err
	}
	if err := Markdown(f, r, plots); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Markdown renders the report.
func Markdown(w io.Writer, r *Run, plots []string) error {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	kind := "full"
	if r.Quick {
		kind = "quick"
	}
	p("# xdproxy benchmark (%s run, %s)\n\n", kind, r.Started.UTC().Format("2006-01-02 15:04 UTC"))
	p("Command: `%s` (took %v)\n\n", r.Command, r.Duration.Round(time.Second))
	p("## Setup\n\n")
	p("- Machine: kernel %s, %d CPUs, load average at start %s (the machine is shared; see the notes on noise).\n", r.Kernel, r.CPUs, r.LoadAvg)
	p("- Topology (identical for every variant, rebuilt for each): gen ns -> `g0` ==veth== `n0` node ns `n1` ==veth== `s0` sink ns, static neighbours; the sink counts and drops in XDP on `s0`, its NAPI threaded and pinned to CPU %d.\n", r.GenCPU)
	for _, f := range r.Feeds {
		p("- Feed `%s`: %s.\n", f.Name, f.Description)
	}
	if r.TCPFeed != "" {
		p("- TCP test: %s.\n", r.TCPFeed)
	}
	if r.Scheduling != "" {
		p("- Scheduling: %s.\n", r.Scheduling)
	}
	p("- CPU per packet: the run time of `n0`'s and `n1`'s NAPI kthreads (threaded, pinned to CPU %d, where the kernel paths do all their forwarding work) plus every thread of the xdproxy process (its workers are pinned to CPU %d by its config), divided by the packets the sink counted; median of the cost runs.\n", r.FwdCPU, r.FwdCPU)
	p("- Traffic: %d-byte UDP frames (FCS included), trials of %s, loss tolerance %.1f%%. Clients: %s.\n", r.FrameSize, r.Trial, r.Tolerance*100, r.Clients)
	p("- Kernel paths: `%s`, `%s`; rules in kube-proxy's shapes generated by bench/kernelrules. xdproxy: %s.\n", r.IPTables, r.NFT, r.XDProxy)
	if r.KubeProxy != "" {
		p("- Real kube-proxy paths: %s.\n", r.KubeProxy)
	}
	p("\n")
	if len(r.Generators) > 0 {
		p("Generator ceilings (one core):\n\n| feed | mode | pps | into |\n|---|---|---:|---|\n")
		for _, g := range r.Generators {
			p("| %s | %s | %.0f | %s |\n", g.Feed, g.Mode, g.Pps, g.Into)
		}
		p("\n")
	}
	p("## Targets\n\n| target | goal | measured | met | missed by |\n|---|---|---|---|---|\n")
	for _, v := range Targets(r) {
		met := "not measured"
		if v.Known {
			met = "no"
			if v.Met {
				met = "yes"
			}
		}
		p("| %s | %s | %s | %s | %s |\n", v.Target, v.Want, dash(v.Got), met, dash(v.Missed))
	}
	p("\n")
	for _, feed := range r.FeedNames() {
		for _, tr := range r.traffics() {
			costTable(w, r, feed, tr)
		}
	}

	p("## Every packet-rate measurement\n\n")
	p("| feed | path | services | traffic | CPU ns/pkt | xdproxy's own ns/pkt | zero-loss kpps | loss at cost rate | lost before the node | other work on the CPU | setup |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, x := range r.Packet {
		zl := kpps(x.ZeroLoss)
		if x.AtGenLimit {
			zl = ">= " + zl + " (generator limit)"
		}
		own := "-"
		if ns, f, ok := r.OwnNs(x); ok {
			own = fmt.Sprintf("%.0f", ns)
			if f.Services != x.Services {
				own += fmt.Sprintf(" (floor at %d)", f.Services)
			}
		}
		fl := "-"
		if x.FeedLoss >= 0 && x.CostRate > 0 {
			fl = fmt.Sprintf("%.2f%%", x.FeedLoss*100)
		}
		p("| %s | %s | %d | %s | %.0f | %s | %s | %.2f%% | %s | %.0f%% | %v |\n", x.Feed, x.Path, x.Services, x.Label(), x.CostNs, own, zl, x.CostLoss*100, fl, x.OtherWork*100, x.Setup.Round(time.Millisecond))
	}
	p("\nCost runs: each CPU figure is the median of several runs at the cost rate; individual runs (ns/pkt):\n\n")
	for _, x := range r.Packet {
		var runs []string
		for _, c := range x.CostRuns {
			runs = append(runs, fmt.Sprintf("%.0f", c))
		}
		note := ""
		if x.Note != "" {
			note = " — " + x.Note
		}
		p("- %s feed, %s, %d services, %s at %s kpps (loss %.2f%%): %s%s\n", x.Feed, x.Path, x.Services, x.Label(), kpps(x.CostRate), x.CostLoss*100, strings.Join(runs, ", "), note)
	}
	if len(r.TCP) > 0 {
		p("\n## TCP connections through the VIP\n\n")
		if r.TCPRounds > 1 {
			p("Each path ran up to %d rounds, the paths in turn; each row is the path's median round (errors: all its rounds'), and the last column lists the rate of every round that completed, in order.\n\n", r.TCPRounds)
		}
		p("| path | services | concurrency | conn/s | p50 us | p90 us | p99 us | forwarding us/conn | errors | rounds (conn/s) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		for _, t := range r.TCP {
			var rounds []string
			for _, c := range t.RoundsCPS {
				rounds = append(rounds, fmt.Sprintf("%.0f", c))
			}
			p("| %s | %d | %d | %.0f | %s | %s | %s | %.1f | %d | %s |\n", t.Path, t.Services, t.Concurrency, t.CPS, us(t.P50), us(t.P90), us(t.P99), t.CostUs, t.Errors, strings.Join(rounds, ", "))
		}
		p("\n")
	}
	for _, pr := range r.Profiles {
		p("## Where xdproxy's time goes: %s\n\nCPU profile of the running xdproxy binary, from its admin socket's `/debug/pprof/profile` while the trial ran: `%s`.\n\n```\n%s\n```\n\n", pr.Of, pr.File, strings.Trim(pr.Top, "\n"))
	}
	if len(plots) > 0 {
		p("## Plots\n\n")
		for _, pl := range plots {
			p("![%s](%s)\n\n", pl, pl)
		}
	}
	if lines := closingNote(r); len(lines) > 0 {
		p("## Closing note\n\n")
		for _, l := range lines {
			p("%s\n\n", l)
		}
	}
	if len(r.Notes) > 0 {
		p("## Notes\n\n")
		for _, n := range r.Notes {
			p("- %s\n", n)
		}
	}
	return nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// costTable writes the side-by-side table of one feed and traffic: CPU
// per delivered packet of every path (rows) at every service count
// (columns), then xdproxy's own cost and its ratios to the kernel's.
func costTable(w io.Writer, r *Run, feed, traffic string) {
	var rows []Packet
	set := map[int]bool{}
	for _, x := range r.Packet {
		if x.Feed == feed && x.Traffic == traffic {
			rows = append(rows, x)
			set[x.Services] = true
		}
	}
	if len(rows) == 0 {
		return
	}
	svcs := sortedKeys(set)
	fmt.Fprintf(w, "## CPU per delivered packet on the forwarding core: %s feed, %s\n\n", feed, r.trafficOf(traffic))
	fmt.Fprintf(w, "Nanoseconds per packet (median of the cost runs); loss at the cost rate in brackets where it reached %.1f%%.\n\n| path |", TargetLoss*100)
	for _, s := range svcs {
		if s == 0 {
			fmt.Fprint(w, " no services |")
		} else {
			fmt.Fprintf(w, " %s services |", thousands(s))
		}
	}
	fmt.Fprint(w, "\n|---|")
	for range svcs {
		fmt.Fprint(w, "---:|")
	}
	fmt.Fprint(w, "\n")
	row := func(label string, cell func(s int) string) {
		fmt.Fprintf(w, "| %s |", label)
		for _, s := range svcs {
			fmt.Fprintf(w, " %s |", cell(s))
		}
		fmt.Fprint(w, "\n")
	}
	for _, path := range Paths {
		if _, ok := findAny(&Run{Packet: rows}, feed, path); !ok {
			continue
		}
		row(PathLabel(path), func(s int) string {
			x, ok := r.Find(feed, path, s, traffic)
			if !ok || x.CostNs <= 0 {
				return ""
			}
			c := fmt.Sprintf("%.0f", x.CostNs)
			if x.CostLoss >= TargetLoss {
				c += fmt.Sprintf(" (%.1f%% lost)", x.CostLoss*100)
			}
			return c
		})
	}
	if _, ok := findAny(&Run{Packet: rows}, feed, PathXDProxy); ok {
		row("xdproxy's own (poll mode minus the I/O floor)", func(s int) string {
			x, ok := r.Find(feed, PathXDProxy, s, traffic)
			if !ok {
				return ""
			}
			if ns, f, ok := r.OwnNs(x); ok {
				if f.Services != s {
					return fmt.Sprintf("%.0f (floor at %d)", ns, f.Services)
				}
				return fmt.Sprintf("%.0f", ns)
			}
			return ""
		})
		for _, base := range []string{PathNFTables, PathKubeProxyNFTables} {
			if _, ok := findAny(&Run{Packet: rows}, feed, base); !ok {
				continue
			}
			row("xdproxy / "+PathLabel(base), func(s int) string {
				x, ok1 := r.Find(feed, PathXDProxy, s, traffic)
				b, ok2 := r.Find(feed, base, s, traffic)
				if !ok1 || !ok2 || x.CostNs <= 0 || b.CostNs <= 0 {
					return ""
				}
				return fmt.Sprintf("%.2fx", x.CostNs/b.CostNs)
			})
		}
	}
	fmt.Fprint(w, "\n")
}

// thousands writes n with commas (1,000).
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// syscallShare finds the flat share of the raw syscall function in a
// "go tool pprof -top" listing.
func syscallShare(top string) (float64, bool) {
	for _, l := range strings.Split(top, "\n") {
		f := strings.Fields(l)
		if len(f) >= 6 && strings.HasSuffix(f[5], "syscall/linux.Syscall6") {
			var v float64
			if _, err := fmt.Sscanf(f[1], "%f%%", &v); err == nil {
				return v, true
			}
		}
	}
	return 0, false
}

// closingNote states, from the measured figures, how far the targets are
// and where xdproxy's cost sits between the receive limit, the I/O floor
// and the translation; it ends with what would close the gap when a
// target is missed.
func closingNote(r *Run) []string {
	var missed, unknown []string
	for _, v := range Targets(r) {
		switch {
		case !v.Known:
			unknown = append(unknown, v.Target)
		case !v.Met:
			missed = append(missed, fmt.Sprintf("%s: %s, goal %s (%s)", v.Target, v.Got, v.Want, v.Missed))
		}
	}
	var out []string
	if len(missed) == 0 && len(unknown) == 0 {
		out = append(out, "Every target was met in this run.")
	}
	if len(missed) > 0 {
		out = append(out, "Targets missed: "+strings.Join(missed, "; ")+".")
	}
	if len(unknown) > 0 {
		out = append(out, "Targets this run could not measure (see the notes for why): "+strings.Join(unknown, "; ")+".")
	}
	for _, feed := range r.FeedNames() {
		limit, okL := findAny(r, feed, PathLimit)
		var x Packet
		okX := false
		for _, p := range r.Packet {
			if p.Feed == feed && p.Path == PathXDProxy && p.CostNs > 0 && (!okX || p.Services < x.Services || p.Services == x.Services && p.Traffic < x.Traffic) {
				x, okX = p, true
			}
		}
		if !okX {
			continue
		}
		line := fmt.Sprintf("Where the cost sits (%s feed, %d services, %s): xdproxy spends %.0f ns per packet.", feed, x.Services, x.Label(), x.CostNs)
		if okL && limit.CostNs > 0 {
			line += fmt.Sprintf(" Receiving a frame and dropping it in XDP on n0 costs %.0f ns.", limit.CostNs)
		}
		if own, f, ok := r.OwnNs(x); ok {
			line += fmt.Sprintf(" The I/O floor (the same AF_XDP sockets and worker loop, no translation) costs %.0f ns, so %.0f ns (%.0f%%) is I/O and %.0f ns xdproxy's own work (parsing, conntrack, service lookup, NAT).",
				f.CostNs, f.CostNs, 100*f.CostNs/x.CostNs, own)
		}
		if n, ok := r.Find(feed, PathNFTables, x.Services, x.Traffic); ok && n.CostNs > 0 {
			line += fmt.Sprintf(" The kernel in kube-proxy's nftables shape costs %.0f ns on the same feed.", n.CostNs)
		}
		out = append(out, line)
	}
	for _, pr := range r.Profiles {
		if share, ok := syscallShare(pr.Top); ok {
			out = append(out, fmt.Sprintf("In the profile (%s), %.0f%% of xdproxy's samples are in raw syscalls (sendto to kick copy-mode transmit, poll to sleep), the rest in Go (the per-packet path, the runtime).", pr.Of, share))
			break
		}
	}
	if len(missed) > 0 {
		out = append(out, "What would close it (suggestions from the measurements, not measured themselves): when the I/O floor alone is above the goal, no translation work can meet it on this machine; the I/O then has to get cheaper: zero-copy AF_XDP on a NIC driver (veth can only copy, into the UMEM on receive and into a new skb on transmit), fewer transmit kicks (one sendto per receive batch, or need_wakeup so that a running NAPI needs none), and busy polling on a core of its own rather than one shared with the NAPI thread.")
	}
	return out
}
