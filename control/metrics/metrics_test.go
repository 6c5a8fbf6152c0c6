package metrics

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestNamesAndRecording(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := New(reg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Unix(1000, 0)
	end := start.Add(30 * time.Millisecond)
	m.ObserveSync(start, end, []time.Time{end.Add(-2 * time.Second)})
	m.ServiceEvent(3)
	m.EndpointEvent(2)
	m.EndpointEvent(1)

	want := `
# HELP kubeproxy_sync_proxy_rules_endpoint_changes_total EndpointSlice add, update and delete events seen.
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter
kubeproxy_sync_proxy_rules_endpoint_changes_total 2
# HELP kubeproxy_sync_proxy_rules_endpoint_changes_pending EndpointSlices with changes not yet published.
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_pending gauge
kubeproxy_sync_proxy_rules_endpoint_changes_pending 1
# HELP kubeproxy_sync_proxy_rules_service_changes_pending Services with changes not yet published.
# TYPE kubeproxy_sync_proxy_rules_service_changes_pending gauge
kubeproxy_sync_proxy_rules_service_changes_pending 3
# HELP kubeproxy_sync_proxy_rules_last_timestamp_seconds Unix time at which the last model was published successfully.
# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1000.03
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"kubeproxy_sync_proxy_rules_endpoint_changes_total",
		"kubeproxy_sync_proxy_rules_endpoint_changes_pending",
		"kubeproxy_sync_proxy_rules_service_changes_pending",
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.NetworkProgrammingDuration); n != 1 {
		t.Errorf("programming histogram count series %d", n)
	}
	if got := histogramSum(t, reg, "kubeproxy_network_programming_duration_seconds"); got != 2 {
		t.Errorf("programming duration sum %v, want 2", got)
	}
	if got := histogramSum(t, reg, "kubeproxy_sync_proxy_rules_duration_seconds"); got < 0.0299 || got > 0.0301 {
		t.Errorf("sync duration sum %v, want 0.03", got)
	}
}

func histogramSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	t.Fatalf("%s not gathered", name)
	return 0
}

func TestPublishFailuresAndInvalidObjects(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := New(reg)
	if err != nil {
		t.Fatal(err)
	}
	const names = `
# HELP xdproxy_invalid_objects_total Object revisions skipped as a whole because they cannot be used (malformed cluster IP, port out of range, ...).
# TYPE xdproxy_invalid_objects_total counter
xdproxy_invalid_objects_total{kind="EndpointSlice"} %d
xdproxy_invalid_objects_total{kind="Service"} %d
# HELP xdproxy_publish_failures_total Models the publish callback refused (each try counts; the source retries with backoff).
# TYPE xdproxy_publish_failures_total counter
xdproxy_publish_failures_total %d
# HELP xdproxy_publish_pending 1 while a model waits to be published because the last publish failed, else 0.
# TYPE xdproxy_publish_pending gauge
xdproxy_publish_pending %d
`
	check := func(what string, slices, services, failures, pending int) {
		t.Helper()
		want := fmt.Sprintf(names, slices, services, failures, pending)
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "xdproxy_invalid_objects_total",
			"xdproxy_publish_failures_total", "xdproxy_publish_pending"); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	check("new: both kinds exported at zero", 0, 0, 0, 0)
	m.PublishFailed()
	m.PublishFailed()
	m.InvalidObject(KindService)
	check("two failures", 0, 1, 2, 1)
	if n := testutil.CollectAndCount(m.SyncDuration); n != 1 {
		t.Fatalf("sync duration series %d", n)
	}
	if got := testutil.ToFloat64(m.LastSyncTimestamp); got != 0 {
		t.Errorf("last timestamp %v after failures only", got)
	}
	m.ObserveSync(time.Unix(2000, 0), time.Unix(2001, 0), nil)
	m.InvalidObject(KindEndpointSlice)
	check("success", 1, 1, 2, 0)
	if got := testutil.ToFloat64(m.LastSyncTimestamp); got != 2001 {
		t.Errorf("last timestamp %v after the success, want 2001", got)
	}
}

func TestNilMetricsRecordNothing(t *testing.T) {
	var m *Metrics
	m.PublishFailed()
	m.InvalidObject(KindService)
	m.ObserveSync(time.Now(), time.Now(), nil)
	m.ServiceEvent(1)
	m.EndpointEvent(1)
	m.SetPending(0, 0)
}

func TestDoubleRegistrationFails(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := New(reg); err != nil {
		t.Fatal(err)
	}
	if _, err := New(reg); err == nil {
		t.Fatal("second registration on one registry succeeded")
	}
}
