// Package metrics defines the control plane's Prometheus metrics. Where a
// metric means what one of kube-proxy's means, it has kube-proxy's name, so
// existing dashboards and alerts keep working:
//
//	kubeproxy_sync_proxy_rules_duration_seconds          histogram: one successful sync (convert, build, publish)
//	kubeproxy_network_programming_duration_seconds       histogram: EndpointSlice last-change-trigger-time to successful publish
//	kubeproxy_sync_proxy_rules_last_timestamp_seconds    gauge: when the last successful sync finished
//	kubeproxy_sync_proxy_rules_service_changes_pending   gauge
//	kubeproxy_sync_proxy_rules_endpoint_changes_pending  gauge
//	kubeproxy_sync_proxy_rules_service_changes_total     counter: Service events
//	kubeproxy_sync_proxy_rules_endpoint_changes_total    counter: EndpointSlice events
//
// As in kube-proxy, a sync whose publish fails is not a sync: it moves
// neither the duration histograms nor the last timestamp, so an alert on a
// stale last timestamp fires while publishing fails. xdproxy's own:
//
//	xdproxy_publish_failures_total                       counter: publishes the callback refused (each try)
//	xdproxy_publish_pending                              gauge: 1 while a Model waits for a retry after a failed publish
//	xdproxy_invalid_objects_total{kind}                  counter: Service or EndpointSlice revisions skipped as unusable
//
// The metrics are registered on the registry the caller passes; the caller
// serves it. A nil *Metrics is valid and records nothing.
package metrics
