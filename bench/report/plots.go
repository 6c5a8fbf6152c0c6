package report

import (
	"fmt"
	"path/filepath"
	"sort"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/xdproxy/xdproxy/bench/search"
)

// Plot file names.
const (
	CostPNG    = "cpu_per_packet_vs_services.png"
	LossPNG    = "loss_vs_offered_load.png"
	LatencyPNG = "tcp_latency.png"
)

// WritePlots draws the PNGs into dir and returns the names it wrote.
func WritePlots(dir string, r *Run) ([]string, error) {
	var names []string
	for _, pl := range []struct {
		name string
		draw func(*Run) (*plot.Plot, bool, error)
	}{{CostPNG, costPlot}, {LossPNG, lossPlot}, {LatencyPNG, latencyPlot}} {
		p, ok, err := pl.draw(r)
		if err != nil {
			return names, fmt.Errorf("report: %s: %w", pl.name, err)
		}
		if !ok {
			continue
		}
		if err := p.Save(8*vg.Inch, 5*vg.Inch, filepath.Join(dir, pl.name)); err != nil {
			return names, fmt.Errorf("report: %s: %w", pl.name, err)
		}
		names = append(names, pl.name)
	}
	return names, nil
}

type seriesKey struct {
	feed, path, traffic string
}

func (k seriesKey) label(feeds int) string {
	l := k.path + ", " + k.traffic
	if feeds > 1 {
		l = k.feed + ": " + l
	}
	return l
}

// costPlot: CPU per delivered packet (ns) against the number of services,
// one line per feed, path and traffic, log x axis; horizontal lines for
// paths without services (the limit, plain forwarding).
func costPlot(r *Run) (*plot.Plot, bool, error) {
	series := map[seriesKey]plotter.XYs{}
	var maxSvc, minSvc = 1, 1 << 30
	for _, p := range r.Packet {
		if p.Services > 0 {
			maxSvc = max(maxSvc, p.Services)
			minSvc = min(minSvc, p.Services)
		}
	}
	if minSvc >= maxSvc {
		minSvc, maxSvc = 1, max(10, maxSvc)
	}
	for _, p := range r.Packet {
		if p.CostNs <= 0 {
			continue
		}
		k := seriesKey{p.Feed, p.Path, p.Traffic}
		if p.Services == 0 {
			series[k] = plotter.XYs{{X: float64(minSvc), Y: p.CostNs}, {X: float64(maxSvc), Y: p.CostNs}}
			continue
		}
		series[k] = append(series[k], plotter.XY{X: float64(p.Services), Y: p.CostNs})
	}
	if len(series) == 0 {
		return nil, false, nil
	}
	p := plot.New()
	p.Title.Text = "CPU per delivered packet on the forwarding core"
	p.X.Label.Text = "services"
	p.Y.Label.Text = "ns per packet"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top = true
	var args []any
	maxY := 0.0
	feeds := len(r.FeedNames())
	for _, k := range sortedSeries(series) {
		xy := series[k]
		for _, pt := range xy {
			maxY = max(maxY, pt.Y)
		}
		sort.Slice(xy, func(i, j int) bool { return xy[i].X < xy[j].X })
		args = append(args, k.label(feeds), xy)
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return nil, false, err
	}
	// Headroom above the data keeps the legend off the lines.
	p.Y.Min, p.Y.Max = 0, maxY*(1.25+0.07*float64(len(series)))
	p.X.Min, p.X.Max = float64(minSvc)/2, float64(maxSvc)*2
	return p, true, nil
}

func sortedSeries(m map[seriesKey]plotter.XYs) []seriesKey {
	var ks []seriesKey
	for k := range m {
		ks = append(ks, k)
	}
	sort.Slice(ks, func(i, j int) bool {
		a, b := ks[i], ks[j]
		if a.feed != b.feed {
			return a.feed < b.feed
		}
		if a.path != b.path {
			return a.path < b.path
		}
		return a.traffic < b.traffic
	})
	return ks
}

// lossPlot: loss (%) against offered load (kpps) for each variant's trials,
// at the largest service count measured (and the service-less paths).
func lossPlot(r *Run) (*plot.Plot, bool, error) {
	maxSvc := 0
	for _, p := range r.Packet {
		maxSvc = max(maxSvc, p.Services)
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Loss against offered load (paths with services at %d services)", maxSvc)
	p.X.Label.Text = "offered kpps"
	p.Y.Label.Text = "loss %"
	p.Legend.Top, p.Legend.Left = true, true // loss starts low on the left
	var args []any
	for _, x := range r.Packet {
		if x.Services != 0 && x.Services != maxSvc || len(x.Curve) == 0 {
			continue
		}
		var xy plotter.XYs
		for _, pt := range search.Sorted(x.Curve) {
			xy = append(xy, plotter.XY{X: pt.Offered / 1000, Y: pt.Loss() * 100})
		}
		args = append(args, seriesKey{x.Feed, x.Path, x.Traffic}.label(len(r.FeedNames())), xy)
	}
	if len(args) == 0 {
		return nil, false, nil
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return nil, false, err
	}
	p.Y.Min = 0
	return p, true, nil
}

// latencyPlot: the cumulative distribution of TCP connection latency.
func latencyPlot(r *Run) (*plot.Plot, bool, error) {
	p := plot.New()
	p.Title.Text = "TCP connection latency (connect, request, response, close)"
	p.X.Label.Text = "latency (us)"
	p.Y.Label.Text = "share of connections at or below (%)"
	p.Legend.Top, p.Legend.Left = false, false // the lower right is empty
	var args []any
	maxX := 0.0
	for _, t := range r.TCP {
		var total uint64
		for _, c := range t.Histogram {
			total += c
		}
		if total == 0 {
			continue
		}
		var xy plotter.XYs
		var cum uint64
		for i, c := range t.Histogram {
			if c == 0 {
				continue
			}
			cum += c
			x := float64(time.Duration(i+1)*t.Bucket) / float64(time.Microsecond)
			xy = append(xy, plotter.XY{X: x, Y: 100 * float64(cum) / float64(total)})
		}
		maxX = max(maxX, float64(t.P99)/float64(time.Microsecond)*1.5)
		args = append(args, fmt.Sprintf("%s, %d services", t.Path, t.Services), xy)
	}
	if len(args) == 0 {
		return nil, false, nil
	}
	if err := plotutil.AddLines(p, args...); err != nil {
		return nil, false, err
	}
	p.X.Min, p.X.Max = 0, maxX
	p.Y.Min, p.Y.Max = 0, 100
	return p, true, nil
}
