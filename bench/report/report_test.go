package report

import (
	"bytes"
	"encoding/csv"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/bench/search"
)

func sampleRun() *Run {
	curve := []search.Point{{Offered: 1e5, Sent: 1e5, Received: 1e5}, {Offered: 4e5, Sent: 4e5, Received: 3e5}}
	return &Run{
		Started: time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC), Command: "xdproxy-bench --quick", Quick: true,
		Kernel: "6.18", CPUs: 2, GenCPU: 0, FwdCPU: 1, FrameSize: 64, Trial: "1s", Tolerance: 0.001,
		Packet: []Packet{
			{Path: PathLimit, Flows: 1, CostNs: 200, ZeroLoss: 6e5, AtGenLimit: true, Curve: curve},
			{Path: PathNFTables, Services: 1, Flows: 1000, CostNs: 2000, ZeroLoss: 3e5, Curve: curve, CostRuns: []float64{1900, 2000, 2100}},
			{Path: PathNFTables, Services: 10000, Flows: 1000, CostNs: 2100, ZeroLoss: 2.9e5, Curve: curve},
			{Path: PathXDProxy, Services: 1, Flows: 1000, CostNs: 500, ZeroLoss: 6e5, AtGenLimit: true, Curve: curve},
			{Path: PathXDProxy, Services: 10000, Flows: 1000, CostNs: 600, ZeroLoss: 6e5, AtGenLimit: true, Curve: curve},
		},
		TCP: []TCP{
			{Path: PathNFTables, Services: 1, CPS: 5000, P50: 100 * time.Microsecond, P99: 300 * time.Microsecond, Histogram: []uint64{0, 0, 0, 0, 0, 10, 5}, Bucket: 20 * time.Microsecond},
			{Path: PathXDProxy, Services: 1, CPS: 8000, P50: 80 * time.Microsecond, P99: 200 * time.Microsecond, Histogram: []uint64{0, 0, 0, 0, 10, 5}, Bucket: 20 * time.Microsecond},
		},
	}
}

func TestTargets(t *testing.T) {
	vs := Targets(sampleRun())
	got := map[string]Verdict{}
	for _, v := range vs {
		got[v.Target] = v
	}
	check := func(name string, met bool) {
		t.Helper()
		v, ok := got[name]
		if !ok {
			t.Fatalf("no verdict %q in %v", name, vs)
		}
		if !v.Known || v.Met != met {
			t.Fatalf("%s: known %v met %v (%s), want met %v", name, v.Known, v.Met, v.Got, met)
		}
	}
	check("per-core throughput vs kernel nftables (1 services, 1000 flows)", true)     // 4x
	check("per-core throughput vs kernel nftables (10000 services, 1000 flows)", true) // 3.5x
	check("share of the XDP_DROP limit (1 services, 1000 flows)", true)                // 40%
	check("xdproxy throughput at 10000 vs 1 services (1000 flows)", false)             // -16.7%
	check("TCP connections/s vs kernel-nftables (1 services)", false)                  // 1.6x
	// The real kube-proxy's verdicts appear only where it was measured.
	for name := range got {
		if strings.Contains(name, "kube-proxy") {
			t.Fatalf("verdict %q without kube-proxy rows", name)
		}
	}
	r := sampleRun()
	r.Packet = append(r.Packet, Packet{Path: PathKubeProxyNFTables, Services: 1, Flows: 1000, CostNs: 1000}) // 2x
	kp := 0
	for _, v := range Targets(r) {
		if strings.Contains(v.Target, "kube-proxy") {
			kp++
			if v.Target != "per-core throughput vs the real kube-proxy (nftables) (1 services, 1000 flows)" || !v.Known || v.Met {
				t.Fatalf("kube-proxy verdict %+v, want known and not met", v)
			}
		}
	}
	if kp != 1 {
		t.Fatalf("%d kube-proxy verdicts, want 1", kp)
	}
	if !strings.Contains(got["xdproxy throughput at 10000 vs 1 services (1000 flows)"].Got, "-16.7%") {
		t.Fatalf("scale verdict %q", got["xdproxy throughput at 10000 vs 1 services (1000 flows)"].Got)
	}
}

func TestWriteAll(t *testing.T) {
	dir := t.TempDir()
	r := sampleRun()
	if err := WriteCSV(dir, r); err != nil {
		t.Fatal(err)
	}
	plots, err := WritePlots(dir, r)
	if err != nil {
		t.Fatal(err)
	}
	if len(plots) != 3 {
		t.Fatalf("plots %v, want 3", plots)
	}
	for _, p := range plots {
		b, err := os.ReadFile(filepath.Join(dir, p))
		if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
			t.Fatalf("%s is not a PNG (%v)", p, err)
		}
	}
	if err := WriteMarkdown(dir, r, plots); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(dir, ThroughputCSV))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1+len(r.Packet) || rows[0][0] != "path" || rows[2][0] != PathNFTables || rows[2][7] != "500000" {
		t.Fatalf("throughput.csv rows %v", rows)
	}
	curve, _ := os.ReadFile(filepath.Join(dir, CurveCSV))
	if n := strings.Count(string(curve), "\n"); n != 1+2*len(r.Packet) {
		t.Fatalf("loss_curve.csv has %d lines", n)
	}
	md, _ := os.ReadFile(filepath.Join(dir, ReportMD))
	for _, want := range []string{"## Targets", "| kernel-nftables | 10000 | 1000 |", ">= 600 (generator limit)", "![" + ThroughputPNG} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report.md lacks %q", want)
		}
	}
}

func TestClosingNote(t *testing.T) {
	r := sampleRun()
	r.Generators = []Generator{{Mode: "prog-run (bursty)", Into: "XDP_DROP sink on n0 (received 7000000 pps, loss 1.0%, 97 ns/pkt)"}}
	r.ProfileTop = "      flat  flat%   sum%        cum   cum%\n     0.71s 39.66% 39.66%      0.71s 39.66%  internal/runtime/syscall/linux.Syscall6\n"
	note := strings.Join(closingNote(r), "\n")
	for _, want := range []string{"Targets missed: xdproxy throughput at 10000 vs 1 services", "costs 200 ns/pkt", "97 ns/pkt", "costs 500 ns/pkt, 300 ns above", "40% of xdproxy's samples", "What would close it"} {
		if !strings.Contains(note, want) {
			t.Errorf("closing note lacks %q:\n%s", want, note)
		}
	}
}
