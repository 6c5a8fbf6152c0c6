package report

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// File names inside a results directory.
const (
	ThroughputCSV = "throughput.csv"
	CurveCSV      = "loss_curve.csv"
	TCPCSV        = "tcp.csv"
	LatencyCSV    = "tcp_latency_histogram.csv"
	RunJSON       = "run.json"
	ReportMD      = "report.md"
)

func f64(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
func us(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 1, 64)
}

func writeCSV(path string, rows [][]string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	if err := w.WriteAll(rows); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// WriteCSV writes the four CSV files and run.json into dir.
func WriteCSV(dir string, r *Run) error {
	tp := [][]string{{"feed", "path", "services", "traffic", "flows", "zero_loss_pps", "at_generator_limit", "cost_ns_per_pkt",
		"own_ns_per_pkt", "cpu_ns_per_pkt", "capacity_pps_per_core", "cost_rate_pps", "cost_run_loss", "feed_loss", "other_work", "setup_ms", "note"}}
	curve := [][]string{{"feed", "path", "services", "traffic", "flows", "offered_pps", "sent_pps", "received_pps", "loss"}}
	for _, p := range r.Packet {
		own := ""
		if ns, _, ok := r.OwnNs(p); ok {
			own = f64(ns)
		}
		tp = append(tp, []string{p.Feed, p.Path, strconv.Itoa(p.Services), p.Traffic, strconv.Itoa(p.Flows), f64(p.ZeroLoss),
			strconv.FormatBool(p.AtGenLimit), f64(p.CostNs), own, f64(p.CPUNs), f64(p.Capacity()), f64(p.CostRate),
			f64(p.CostLoss), f64(p.FeedLoss), f64(p.OtherWork), strconv.FormatInt(p.Setup.Milliseconds(), 10), p.Note})
		for _, pt := range p.Curve {
			curve = append(curve, []string{p.Feed, p.Path, strconv.Itoa(p.Services), p.Traffic, strconv.Itoa(p.Flows),
				f64(pt.Offered), f64(pt.Sent), f64(pt.Received), f64(pt.Loss())})
		}
	}
	tcp := [][]string{{"path", "services", "concurrency", "cps", "connections", "errors", "p50_us", "p90_us", "p99_us", "cost_us_per_conn", "note"}}
	hist := [][]string{{"path", "services", "bucket_start_us", "count"}}
	for _, t := range r.TCP {
		tcp = append(tcp, []string{t.Path, strconv.Itoa(t.Services), strconv.Itoa(t.Concurrency), f64(t.CPS),
			strconv.FormatUint(t.Connections, 10), strconv.FormatUint(t.Errors, 10), us(t.P50), us(t.P90), us(t.P99), f64(t.CostUs), t.Note})
		for i, c := range t.Histogram {
			if c > 0 {
				hist = append(hist, []string{t.Path, strconv.Itoa(t.Services), us(time.Duration(i) * t.Bucket), strconv.FormatUint(c, 10)})
			}
		}
	}
	for name, rows := range map[string][][]string{ThroughputCSV: tp, CurveCSV: curve, TCPCSV: tcp, LatencyCSV: hist} {
		if err := writeCSV(filepath.Join(dir, name), rows); err != nil {
			return fmt.Errorf("report: %s: %w", name, err)
		}
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, RunJSON), b, 0o644)
}
