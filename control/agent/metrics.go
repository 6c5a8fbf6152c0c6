package agent

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/nat/conntrack"
)

// dataplaneCollector reads the workers', XDP programs' and conntrack's
// counters at scrape time, so the packet path never touches Prometheus.
type dataplaneCollector struct {
	engine *dataplane.Engine
	proxy  *health.Proxy
	// flowSlots is the XDP flow map's size (flowTableSize).
	flowSlots int

	rx, fwd, replied, tx, copied, newFlows, wakeups, toKernel, reasons, publishErrs *prometheus.Desc
	unresolved                                                                      *prometheus.Desc
	xdpFrames, xdpMatches                                                           *prometheus.Desc
	ctEntries, ctState, ctCapacity, ctFill, ctEvents                                *prometheus.Desc
	ifaceQueues, ifaceServed, healthy, synGuard                                     *prometheus.Desc
	flowEntries, flowCapacity, flowEvents, flowPass, localClients                   *prometheus.Desc
}

func newDataplaneCollector(e *dataplane.Engine, p *health.Proxy, flowSlots int) *dataplaneCollector {
	wl := []string{"interface", "queue"}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("xdproxy_"+name, help, labels, nil)
	}
	return &dataplaneCollector{
		engine: e, proxy: p, flowSlots: flowSlots,
		rx:           d("worker_rx_frames_total", "Frames received by the worker.", wl...),
		fwd:          d("worker_forwarded_frames_total", "Frames translated and forwarded.", wl...),
		replied:      d("worker_replied_frames_total", "Replies generated (TCP resets, ICMP unreachables).", wl...),
		tx:           d("worker_tx_frames_total", "Frames put on TX rings.", wl...),
		copied:       d("worker_copied_frames_total", "Frames copied into another interface's UMEM.", wl...),
		newFlows:     d("worker_new_flows_total", "Connections created.", wl...),
		wakeups:      d("worker_poll_wakeups_total", "Times the worker woke from poll().", wl...),
		toKernel:     d("worker_to_kernel_frames_total", "Frames handed to the kernel's stack through the exception link.", wl...),
		unresolved:   d("worker_unresolved_neighbor_frames_total", "Translated frames sent through the kernel because their next hop's neighbour was not resolved yet (the kernel holds them while it resolves it).", wl...),
		reasons:      d("worker_not_forwarded_frames_total", "Frames not forwarded as they came, by reason (pass_* went to the kernel).", "interface", "queue", "reason"),
		publishErrs:  d("worker_flow_publish_errors_total", "Batches whose reply tuples the XDP flow table refused.", wl...),
		xdpFrames:    d("xdp_frames_total", "Frames seen by the XDP programs, by verdict.", "verdict"),
		xdpMatches:   d("xdp_matches_total", "Frames the XDP programs claimed, by the rule that claimed them.", "rule"),
		ctEntries:    d("conntrack_entries", "Tracked connections, by assurance.", "assured"),
		ctState:      d("conntrack_state_entries", "Tracked connections by state.", "state"),
		ctCapacity:   d("conntrack_capacity", "Connections the table holds."),
		ctFill:       d("conntrack_fill_ratio", "Tracked connections over capacity: table pressure."),
		ctEvents:     d("conntrack_events_total", "Connection-table events.", "event"),
		ifaceQueues:  d("interface_queues", "Receive queues each configured interface has.", "interface"),
		ifaceServed:  d("interface_served_queues", "Receive queues with a socket and a worker.", "interface"),
		healthy:      d("healthy", "1 when the check passes: healthz, livez.", "check"),
		synGuard:     d("syn_guard", "1 while the XDP program admits only retransmitted SYNs (a flood of new connections overruns the table)."),
		flowEntries:  d("xdp_flow_table_entries", "Reply tuples in the XDP flow map at the reconciler's last pass (every 10 s, or 100 times the last pass's duration when longer, at most 5 min; and soon after a refused write or a lost deletion)."),
		flowPass:     d("xdp_flow_table_last_pass_seconds", "How long the reconciler's last pass over the XDP flow map took (0 before the first)."),
		flowCapacity: d("xdp_flow_table_capacity", "Reply tuples the XDP flow map holds (its hash map; the reply slots in front of it hold at least as many more)."),
		flowEvents:   d("xdp_flow_table_events_total", "Reconciler repairs of the XDP flow map: stale tuples removed, live ones restored, deletions the janitor's queue lost.", "event"),
		localClients: d("local_clients_total", "Service connections of clients on the node, as the socket programs handled them (translated, rejected, dropped, ...).", "event"),
	}
}

func (c *dataplaneCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.rx, c.fwd, c.replied, c.tx, c.copied, c.newFlows, c.wakeups, c.toKernel,
		c.unresolved, c.reasons, c.publishErrs, c.xdpFrames, c.xdpMatches, c.ctEntries, c.ctState, c.ctCapacity, c.ctFill, c.ctEvents,
		c.ifaceQueues, c.ifaceServed, c.healthy, c.synGuard, c.flowEntries, c.flowCapacity, c.flowEvents, c.flowPass, c.localClients} {
		ch <- d
	}
}

func (c *dataplaneCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, w := range c.engine.Workers() {
		s := w.Counters.Snapshot()
		l := []string{w.Port().Name, strconv.Itoa(w.Port().Queue)}
		counter(c.rx, s.RxFrames, l...)
		counter(c.fwd, s.Forwarded, l...)
		counter(c.replied, s.Replied, l...)
		counter(c.tx, s.TxFrames, l...)
		counter(c.copied, s.Copied, l...)
		counter(c.newFlows, s.NewFlows, l...)
		counter(c.wakeups, s.Wakeups, l...)
		counter(c.toKernel, s.ToKernel, l...)
		counter(c.unresolved, s.Unresolved, l...)
		counter(c.publishErrs, s.FlowPublishErrors, l...)
		for reason, v := range s.ByReason {
			counter(c.reasons, v, l[0], l[1], reason)
		}
	}
	if x, err := c.engine.XDPCounters(); err == nil {
		counter(c.xdpFrames, x.Redirected, "redirected")
		counter(c.xdpFrames, x.Passed, "passed")
		counter(c.xdpFrames, x.NoSocket, "no_socket")
		counter(c.xdpFrames, x.ParseFailed, "parse_failed")
		counter(c.xdpFrames, x.SYNGuardDropped, "syn_guard_dropped")
		counter(c.xdpMatches, x.MatchFrontend, "frontend")
		counter(c.xdpMatches, x.MatchFlow, "flow")
		counter(c.xdpMatches, x.MatchFragment, "fragment")
		counter(c.xdpMatches, x.MatchICMPError, "icmp_error")
		counter(c.xdpMatches, x.EgressRedirected, "egress_reply")
	}
	st := c.engine.Conntrack().Stats()
	gauge(c.ctEntries, float64(st.Assured), "true")
	gauge(c.ctEntries, float64(st.Unassured), "false")
	for s := conntrack.State(1); s < conntrack.NumStates; s++ {
		gauge(c.ctState, float64(st.ByState[s]), s.String())
	}
	gauge(c.ctCapacity, float64(st.Capacity))
	gauge(c.ctFill, st.FillRatio)
	for _, e := range []struct {
		name string
		v    uint64
	}{
		{"insert", st.Inserts}, {"expired", st.Expired + st.ExpiredOnInsert}, {"deleted", st.Deleted},
		{"evicted_expired", st.EvictedExpired}, {"early_drop", st.EvictedUnassured}, {"full", st.FullDrops},
		{"snat_exhausted", st.SNATExhausted}, {"out_of_window_rst", st.OutOfWindowRST},
		{"out_of_window_fin", st.OutOfWindowFIN},
	} {
		counter(c.ctEvents, e.v, e.name)
	}
	for _, s := range c.engine.Interfaces() {
		gauge(c.ifaceQueues, float64(s.Queues), s.Name)
		gauge(c.ifaceServed, float64(len(s.Served)), s.Name)
	}
	b := func(ok bool) float64 {
		if ok {
			return 1
		}
		return 0
	}
	gauge(c.healthy, b(c.proxy.Healthz().Healthy), "healthz")
	gauge(c.healthy, b(c.proxy.Livez().Healthy), "livez")
	gauge(c.synGuard, b(c.engine.SYNGuardOn()))
	ft := c.engine.FlowTableStats()
	gauge(c.flowEntries, float64(ft.Entries))
	gauge(c.flowCapacity, float64(c.flowSlots))
	gauge(c.flowPass, ft.LastPass.Seconds())
	counter(c.flowEvents, ft.Removed, "removed_stale")
	counter(c.flowEvents, ft.Restored, "restored")
	counter(c.flowEvents, ft.LostDeletions, "deletion_lost")
	if lc, ok, _ := c.engine.LocalClientCounters(); ok {
		for _, e := range []struct {
			name string
			v    uint64
		}{
			{"translated", lc.Translated}, {"rejected", lc.Rejected}, {"dropped", lc.Dropped},
			{"not_node", lc.NotNode}, {"no_backend", lc.NoBackend}, {"affinity_hit", lc.AffinityHits},
			{"pin_hit", lc.PinHits}, {"reversed", lc.Reversed}, {"reverse_failed", lc.ReverseFailed},
		} {
			counter(c.localClients, e.v, e.name)
		}
	}
}
