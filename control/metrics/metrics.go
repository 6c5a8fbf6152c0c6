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

	PublishFailures prometheus.Counter
	PublishPending  prometheus.Gauge
	InvalidObjects  *prometheus.CounterVec // label kind: "Service" or "EndpointSlice"
}

// Kinds of InvalidObjects.
const (
	KindService       = "Service"
	KindEndpointSlice = "EndpointSlice"
)

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		SyncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy",
			Name:      "sync_proxy_rules_duration_seconds",
			Help:      "Time to turn pending Service and EndpointSlice changes into a published model (successful syncs only).",
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
			Help:      "Unix time at which the last model was published successfully.",
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
		PublishFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "xdproxy",
			Name:      "publish_failures_total",
			Help:      "Models the publish callback refused (each try counts; the source retries with backoff).",
		}),
		PublishPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "xdproxy",
			Name:      "publish_pending",
			Help:      "1 while a model waits to be published because the last publish failed, else 0.",
		}),
		InvalidObjects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Subsystem: "xdproxy",
			Name:      "invalid_objects_total",
			Help:      "Object revisions skipped as a whole because they cannot be used (malformed cluster IP, port out of range, ...).",
		}, []string{"kind"}),
	}
	// Both kinds are exported from the start, at zero.
	m.InvalidObjects.WithLabelValues(KindService)
	m.InvalidObjects.WithLabelValues(KindEndpointSlice)
	for _, c := range []prometheus.Collector{
		m.SyncDuration, m.NetworkProgrammingDuration, m.LastSyncTimestamp,
		m.ServiceChangesPending, m.EndpointChangesPending, m.ServiceChangesTotal, m.EndpointChangesTotal,
		m.PublishFailures, m.PublishPending, m.InvalidObjects,
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

// ObserveSync records a successful sync: it started at start and its
// Model was published at end, carrying changes triggered at triggers
// (including those of earlier tries that failed). Nothing is waiting any
// more, so it also sets the publish-pending gauge to 0. A sync whose
// publish failed is not a sync here: call PublishFailed.
func (m *Metrics) ObserveSync(start, end time.Time, triggers []time.Time) {
	if m == nil {
		return
	}
	m.SyncDuration.Observe(end.Sub(start).Seconds())
	m.LastSyncTimestamp.Set(float64(end.UnixNano()) / 1e9)
	for _, t := range triggers {
		m.NetworkProgrammingDuration.Observe(end.Sub(t).Seconds())
	}
	m.PublishPending.Set(0)
}

// PublishFailed records a publish that failed: the Model is pending until
// a retry succeeds (ObserveSync).
func (m *Metrics) PublishFailed() {
	if m == nil {
		return
	}
	m.PublishFailures.Inc()
	m.PublishPending.Set(1)
}

// InvalidObject records one revision of an object of kind (KindService or
// KindEndpointSlice) skipped as a whole.
func (m *Metrics) InvalidObject(kind string) {
	if m == nil {
		return
	}
	m.InvalidObjects.WithLabelValues(kind).Inc()
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
