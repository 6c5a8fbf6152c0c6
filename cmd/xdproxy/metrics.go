package main

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdproxy/xdproxy/dataplane"
)

// dataplaneCollector reads the workers', XDP programs' and conntrack's
// counters at scrape time, so the packet path never touches Prometheus.
type dataplaneCollector struct {
	engine *dataplane.Engine

	rx, fwd, replied, tx, copied, newFlows, wakeups, reasons *prometheus.Desc
	xdpFrames, ctEntries, ctEvents                           *prometheus.Desc
}

func newDataplaneCollector(e *dataplane.Engine) *dataplaneCollector {
	wl := []string{"interface", "queue"}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("xdproxy_"+name, help, labels, nil)
	}
	return &dataplaneCollector{
		engine:    e,
		rx:        d("worker_rx_frames_total", "Frames received by the worker.", wl...),
		fwd:       d("worker_forwarded_frames_total", "Frames translated and forwarded.", wl...),
		replied:   d("worker_replied_frames_total", "Replies generated (TCP resets, ICMP unreachables).", wl...),
		tx:        d("worker_tx_frames_total", "Frames put on TX rings.", wl...),
		copied:    d("worker_copied_frames_total", "Frames copied into another interface's UMEM.", wl...),
		newFlows:  d("worker_new_flows_total", "Connections created.", wl...),
		wakeups:   d("worker_poll_wakeups_total", "Times the worker woke from poll().", wl...),
		reasons:   d("worker_not_forwarded_frames_total", "Frames not forwarded, by reason.", "interface", "queue", "reason"),
		xdpFrames: d("xdp_frames_total", "Frames seen by the XDP programs, by verdict.", "verdict"),
		ctEntries: d("conntrack_entries", "Tracked connections."),
		ctEvents:  d("conntrack_events_total", "Connection-table events.", "event"),
	}
}

func (c *dataplaneCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.rx, c.fwd, c.replied, c.tx, c.copied, c.newFlows, c.wakeups, c.reasons, c.xdpFrames, c.ctEntries, c.ctEvents} {
		ch <- d
	}
}

func (c *dataplaneCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, w := range c.engine.Workers() {
		s := w.Counters.Snapshot()
		l := []string{w.Port().Name, itoa(w.Port().Queue)}
		counter(c.rx, s.RxFrames, l...)
		counter(c.fwd, s.Forwarded, l...)
		counter(c.replied, s.Replied, l...)
		counter(c.tx, s.TxFrames, l...)
		counter(c.copied, s.Copied, l...)
		counter(c.newFlows, s.NewFlows, l...)
		counter(c.wakeups, s.Wakeups, l...)
		for reason, v := range s.ByReason {
			counter(c.reasons, v, l[0], l[1], reason)
		}
	}
	if x, err := c.engine.XDPCounters(); err == nil {
		counter(c.xdpFrames, x.Redirected, "redirected")
		counter(c.xdpFrames, x.Passed, "passed")
		counter(c.xdpFrames, x.NoSocket, "no_socket")
		counter(c.xdpFrames, x.ParseFailed, "parse_failed")
	}
	st := c.engine.Conntrack().Stats()
	ch <- prometheus.MustNewConstMetric(c.ctEntries, prometheus.GaugeValue, float64(st.Live))
	counter(c.ctEvents, st.Inserts, "insert")
	counter(c.ctEvents, st.Expired, "expired")
	counter(c.ctEvents, st.EvictedExpired+st.EvictedUnreplied, "evicted")
	counter(c.ctEvents, st.FullDrops, "full")
	counter(c.ctEvents, st.SNATExhausted, "snat_exhausted")
}

func itoa(i int) string {
	if i >= 0 && i < 10 {
		return string(rune('0' + i))
	}
	var b [20]byte
	n := len(b)
	neg := i < 0
	if neg {
		i = -i
	}
	for i > 0 {
		n--
		b[n] = byte('0' + i%10)
		i /= 10
	}
	if neg {
		n--
		b[n] = '-'
	}
	return string(b[n:])
}
