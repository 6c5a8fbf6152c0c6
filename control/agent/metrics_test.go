package agent

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestDataplaneMetrics: the collector exposes the dataplane's pressure
// gauges, the XDP flow map's among them, with the map's real size.
func TestDataplaneMetrics(t *testing.T) {
	a, _ := fakeAgent(t)
	reg := prometheus.NewRegistry()
	const slots = 1 << 17
	reg.MustRegister(newDataplaneCollector(a.engine, a.proxy, slots))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			got[f.GetName()] += v
		}
	}
	for _, name := range []string{"xdproxy_xdp_flow_table_entries", "xdproxy_xdp_flow_table_capacity",
		"xdproxy_xdp_flow_table_events_total", "xdproxy_xdp_flow_table_last_pass_seconds", "xdproxy_conntrack_fill_ratio", "xdproxy_conntrack_capacity",
		"xdproxy_syn_guard", "xdproxy_healthy", "xdproxy_worker_rx_frames_total"} {
		if _, ok := got[name]; !ok {
			t.Errorf("%s is not exposed", name)
		}
	}
	if got["xdproxy_xdp_flow_table_capacity"] != slots {
		t.Errorf("xdproxy_xdp_flow_table_capacity %v, want %d", got["xdproxy_xdp_flow_table_capacity"], slots)
	}
}
