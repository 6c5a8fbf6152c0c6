package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the control plane's metrics.
type Metrics struct {
	SyncDuration               prometheus.Histogram
	NetworkProgrammingDuration prometheus.Histogram
	LastSyncTimestamp          prometheus.Gauge
	ServiceChangesPending      prometheus.Gauge
	EndpointChangesPending     prometheus.Gauge
	ServiceChangesTotal        prometheus.Counter
	EndpointChangesTotal       prometheus.Counter
}

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		SyncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_duration_seconds",
			Help:      "Time to turn pending Service and EndpointSlice changes into a published model.",
			Buckets:   prometheus.ExponentialBuckets(0.001, 2, 15),
		}),
		NetworkProgrammingDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "network_programming_duration_seconds",
			Help:      "Time from an EndpointSlice's last-change-trigger-time to the publish that carries it.",
			Buckets:   programmingBuckets(),
		}),
		LastSyncTimestamp: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_last_timestamp_seconds",
			Help:      "Unix time at which the last model was published.",
		}),
		ServiceChangesPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_service_changes_pending",
			Help:      "Services with changes not yet published.",
		}),
		EndpointChangesPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_endpoint_changes_pending",
			Help:      "EndpointSlices with changes not yet published.",
		}),
		ServiceChangesTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_service_changes_total",
			Help:      "Service add, update and delete events seen.",
		}),
		EndpointChangesTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_endpoint_changes_total",
			Help:      "EndpointSlice add, update and delete events seen.",
		}),
	}
	for _, c := range []prometheus.Collector{
		m.SyncDuration, m.NetworkProgrammingDuration, m.LastSyncTimestamp,
		m.ServiceChangesPending, m.EndpointChangesPending, m.ServiceChangesTotal, m.EndpointChangesTotal,
	} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// programmingBuckets are kube-proxy's: 0.25 s steps to 0.5 s, then 1 s to
// 59 s, 5 s to 115 s and 30 s to 5 min.
func programmingBuckets() []float64 {
	b := []float64{0.25, 0.5}
	b = append(b, prometheus.LinearBuckets(1, 1, 59)...)
	b = append(b, prometheus.LinearBuckets(60, 5, 12)...)
	return append(b, prometheus.LinearBuckets(120, 30, 7)...)
}

// ObserveSync records a sync that started at start and published at end,
// carrying changes triggered at triggers.
func (m *Metrics) ObserveSync(start, end time.Time, triggers []time.Time) {
	if m == nil {
		return
	}
	m.SyncDuration.Observe(end.Sub(start).Seconds())
	m.LastSyncTimestamp.Set(float64(end.UnixNano()) / 1e9)
	for _, t := range triggers {
		m.NetworkProgrammingDuration.Observe(end.Sub(t).Seconds())
	}
}

// ServiceEvent records one Service event that left pending services pending.
func (m *Metrics) ServiceEvent(pending int) {
	if m == nil {
		return
	}
	m.ServiceChangesTotal.Inc()
	m.ServiceChangesPending.Set(float64(pending))
}

// EndpointEvent records one EndpointSlice event that left pending slices
// pending.
func (m *Metrics) EndpointEvent(pending int) {
	if m == nil {
		return
	}
	m.EndpointChangesTotal.Inc()
	m.EndpointChangesPending.Set(float64(pending))
}

// SetPending sets both pending gauges (after a checkout).
func (m *Metrics) SetPending(services, endpoints int) {
	if m == nil {
		return
	}
	m.ServiceChangesPending.Set(float64(services))
	m.EndpointChangesPending.Set(float64(endpoints))
}
