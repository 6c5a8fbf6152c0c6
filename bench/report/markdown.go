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

// Targets of the benchmark (goals, not timed tests).
const (
	TargetVsNFT       = 3.0  // xdproxy per-core throughput / kernel nftables path
	TargetVsLimit     = 0.30 // xdproxy / XDP_DROP limit
	TargetScaleDrop   = 0.10 // at most this much less throughput at the most services than at 1
	TargetCPSVsKernel = 2.0  // TCP connections per second / kernel path
)

// Verdict is one target's outcome.
type Verdict struct {
	Target string
	Want   string
	Got    string
	Met    bool
	Known  bool // false when the run lacks the measurements
}

func kpps(v float64) string { return fmt.Sprintf("%.0f", v/1000) }

// Targets evaluates the targets on r. Throughput comparisons use the
// per-core capacity from the measured cost (1/cost at a rate both paths
// carry), because the generator cannot saturate xdproxy here; zero-loss
// ratios are printed next to them in the tables.
func Targets(r *Run) []Verdict {
	var out []Verdict
	flowsSet := map[int]bool{}
	svcSet := map[int]bool{}
	for _, p := range r.Packet {
		if p.Path == PathXDProxy {
			flowsSet[p.Flows] = true
			svcSet[p.Services] = true
		}
	}
	flows := sortedKeys(flowsSet)
	svcs := sortedKeys(svcSet)
	for _, f := range flows {
		for _, s := range svcs {
			x, ok1 := r.Find(PathXDProxy, s, f)
			for _, base := range []struct{ path, name string }{{PathNFTables, "kernel nftables"}, {PathKubeProxyNFTables, "the real kube-proxy (nftables)"}} {
				n, ok2 := r.Find(base.path, s, f)
				if !ok2 && base.path == PathKubeProxyNFTables {
					continue // measured at few service counts, and only in full runs
				}
				v := Verdict{Target: fmt.Sprintf("per-core throughput vs %s (%d services, %d flows)", base.name, s, f), Want: fmt.Sprintf(">= %.1fx", TargetVsNFT)}
				if ok1 && ok2 && x.Capacity() > 0 && n.Capacity() > 0 {
					ratio := x.Capacity() / n.Capacity()
					v.Known, v.Met = true, ratio >= TargetVsNFT
					v.Got = fmt.Sprintf("%.2fx (%s vs %s kpps/core; zero-loss %s vs %s kpps)", ratio, kpps(x.Capacity()), kpps(n.Capacity()), kpps(x.ZeroLoss), kpps(n.ZeroLoss))
				}
				out = append(out, v)
			}
		}
	}
	if l, ok := findAny(r, PathLimit); ok {
		for _, f := range flows {
			x, ok := r.Find(PathXDProxy, minInt(svcs), f)
			v := Verdict{Target: fmt.Sprintf("share of the XDP_DROP limit (%d services, %d flows)", minInt(svcs), f), Want: fmt.Sprintf(">= %.0f%%", TargetVsLimit*100)}
			if ok && x.Capacity() > 0 && l.Capacity() > 0 {
				share := x.Capacity() / l.Capacity()
				v.Known, v.Met = true, share >= TargetVsLimit
				v.Got = fmt.Sprintf("%.0f%% (%s of %s kpps/core)", share*100, kpps(x.Capacity()), kpps(l.Capacity()))
			}
			out = append(out, v)
		}
	}
	if len(svcs) > 1 {
		lo, hi := minInt(svcs), svcs[len(svcs)-1]
		for _, f := range flows {
			a, ok1 := r.Find(PathXDProxy, lo, f)
			b, ok2 := r.Find(PathXDProxy, hi, f)
			v := Verdict{Target: fmt.Sprintf("xdproxy throughput at %d vs %d services (%d flows)", hi, lo, f), Want: fmt.Sprintf("<= %.0f%% less", TargetScaleDrop*100)}
			if ok1 && ok2 && a.Capacity() > 0 && b.Capacity() > 0 {
				drop := 1 - b.Capacity()/a.Capacity()
				v.Known, v.Met = true, drop <= TargetScaleDrop
				v.Got = fmt.Sprintf("%+.1f%% (%s vs %s kpps/core)", -drop*100, kpps(b.Capacity()), kpps(a.Capacity()))
			}
			out = append(out, v)
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
			v := Verdict{Target: fmt.Sprintf("TCP connections/s vs %s (%d services)", kp, t.Services), Want: fmt.Sprintf(">= %.1fx", TargetCPSVsKernel)}
			if k.CPS > 0 {
				ratio := t.CPS / k.CPS
				v.Known, v.Met = true, ratio >= TargetCPSVsKernel
				v.Got = fmt.Sprintf("%.2fx (%.0f vs %.0f cps; forwarding cost %.1f vs %.1f us/conn)", ratio, t.CPS, k.CPS, t.CostUs, k.CostUs)
			}
			out = append(out, v)
		}
	}
	return out
}

func findAny(r *Run, path string) (Packet, bool) {
	for _, p := range r.Packet {
		if p.Path == path {
			return p, true
		}
	}
	return Packet{}, false
}

func sortedKeys(m map[int]bool) []int {
	var out []int
	for k := range m {
		out = append(out, k)
	}
	sort.Ints(out)
	return out
}

func minInt(xs []int) int {
	if len(xs) == 0 {
		return 0
	}
	return xs[0]
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
	p("- Topology (identical for every variant, rebuilt for each): gen ns `g0` -> node ns `n0` | `n1` -> sink ns `s0`, veth pairs, static neighbours.\n")
	p("- CPU plan: CPU %d generates (and runs the sink's receive work); CPU %d forwards: the node's NAPI kthreads are threaded and pinned there, and so is xdproxy's worker.\n", r.GenCPU, r.FwdCPU)
	p("- Traffic: %d-byte UDP frames (FCS included), trials of %s, loss tolerance %.1f%%. Clients: %s.\n", r.FrameSize, r.Trial, r.Tolerance*100, r.Clients)
	p("- Kernel paths: `%s`, `%s`; rules in kube-proxy's shapes generated by bench/kernelrules. xdproxy: %s.\n", r.IPTables, r.NFT, r.XDProxy)
	if r.KubeProxy != "" {
		p("- Real kube-proxy paths: %s.\n", r.KubeProxy)
	}
	p("\n")
	if len(r.Generators) > 0 {
		p("Generator ceilings (one core):\n\n| mode | pps | into |\n|---|---:|---|\n")
		for _, g := range r.Generators {
			p("| %s | %.0f | %s |\n", g.Mode, g.Pps, g.Into)
		}
		p("\n")
	}
	p("## Targets\n\n| target | goal | measured | met |\n|---|---|---|---|\n")
	for _, v := range Targets(r) {
		met := "not measured"
		if v.Known {
			met = "no"
			if v.Met {
				met = "yes"
			}
		}
		got := v.Got
		if got == "" {
			got = "-"
		}
		p("| %s | %s | %s | %s |\n", v.Target, v.Want, got, met)
	}
	p("\nThroughput targets compare per-core capacity (1 / forwarding cost per packet, measured at a rate every path carries), because the generator's ceiling is below xdproxy's limit on this machine; the zero-loss rates are in the table below.\n\n")

	p("## Packet forwarding\n\n")
	p("| path | services | flows | zero-loss kpps | cost ns/pkt | capacity kpps/core | loss in cost runs | setup |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, x := range r.Packet {
		zl := kpps(x.ZeroLoss)
		if x.AtGenLimit {
			zl = ">= " + zl + " (generator limit)"
		}
		p("| %s | %d | %d | %s | %.0f | %s | %.2f%% | %v |\n", x.Path, x.Services, x.Flows, zl, x.CostNs, kpps(x.Capacity()), x.CostLoss*100, x.Setup.Round(time.Millisecond))
	}
	p("\nCost runs: each figure is the median of several runs at the cost rate; individual runs (ns/pkt):\n\n")
	for _, x := range r.Packet {
		var runs []string
		for _, c := range x.CostRuns {
			runs = append(runs, fmt.Sprintf("%.0f", c))
		}
		note := ""
		if x.Note != "" {
			note = " — " + x.Note
		}
		p("- %s, %d services, %d flows at %s kpps (loss %.2f%%): %s%s\n", x.Path, x.Services, x.Flows, kpps(x.CostRate), x.CostLoss*100, strings.Join(runs, ", "), note)
	}
	if len(r.TCP) > 0 {
		p("\n## TCP connections through the VIP\n\n| path | services | concurrency | conn/s | p50 us | p90 us | p99 us | forwarding us/conn | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, t := range r.TCP {
			p("| %s | %d | %d | %.0f | %s | %s | %s | %.1f | %d |\n", t.Path, t.Services, t.Concurrency, t.CPS, us(t.P50), us(t.P90), us(t.P99), t.CostUs, t.Errors)
		}
		p("\n")
	}
	if len(plots) > 0 {
		p("## Plots\n\n")
		for _, pl := range plots {
			p("![%s](%s)\n\n", pl, pl)
		}
	}
	if r.Profile != "" {
		p("## Where xdproxy's time goes\n\nCPU profile of the xdproxy process: `%s`.\n\n```\n%s\n```\n\n", r.Profile, strings.TrimSpace(r.ProfileTop))
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
// and where xdproxy's cost sits relative to the limit; it ends with what
// would close the gap when a target is missed.
func closingNote(r *Run) []string {
	var missed, unknown []string
	for _, v := range Targets(r) {
		switch {
		case !v.Known:
			unknown = append(unknown, v.Target)
		case !v.Met:
			missed = append(missed, fmt.Sprintf("%s: %s, goal %s", v.Target, v.Got, v.Want))
		}
	}
	var out []string
	if len(missed) == 0 && len(unknown) == 0 {
		return []string{"Every target was met in this run."}
	}
	if len(missed) > 0 {
		out = append(out, "Targets missed: "+strings.Join(missed, "; ")+".")
	}
	if len(unknown) > 0 {
		out = append(out, "Targets this run could not measure (see the notes for why): "+strings.Join(unknown, "; ")+".")
	}
	limit, okL := findAny(r, PathLimit)
	var x Packet
	okX := false
	for _, p := range r.Packet {
		if p.Path == PathXDProxy && p.CostNs > 0 && (!okX || p.Services < x.Services || p.Services == x.Services && p.Flows < x.Flows) {
			x, okX = p, true
		}
	}
	if okL && okX && limit.CostNs > 0 {
		out = append(out, fmt.Sprintf("Where the cost sits: receiving and dropping the generator's frames costs %.0f ns/pkt on this veth path (the skb-to-XDP copy a veth makes; fed XDP frames instead, the same drop costs %s). xdproxy at %d services and %d flows costs %.0f ns/pkt, %.0f ns above that floor.",
			limit.CostNs, limitFramesCost(r), x.Services, x.Flows, x.CostNs, x.CostNs-limit.CostNs))
	}
	if share, ok := syscallShare(r.ProfileTop); ok {
		out = append(out, fmt.Sprintf("In the profile, %.0f%% of xdproxy's samples are in raw syscalls (sendto to kick copy-mode transmit, poll to sleep), the rest in the per-packet path (conntrack lookup, route lookup, rewrite).", share))
	}
	if len(missed) > 0 {
		out = append(out, "What would close it (suggestions from the measurements, not measured themselves): fewer syscalls per packet (larger transmit batches, kicking the egress socket once per receive batch, busy polling on a dedicated core); and on hardware, zero-copy AF_XDP on a NIC driver, which removes the copies that veth's copy mode adds in both directions.")
	}
	return out
}

func limitFramesCost(r *Run) string {
	for _, g := range r.Generators {
		if strings.HasPrefix(g.Mode, "prog-run") {
			if i := strings.LastIndex(g.Into, ", "); i >= 0 {
				return strings.TrimSuffix(g.Into[i+2:], ")")
			}
		}
	}
	return "not measured"
}
