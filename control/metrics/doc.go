// Package metrics defines the control plane's Prometheus metrics. Where a
// metric means what one of kube-proxy's means, it has kube-proxy's name, so
// existing dashboards and alerts keep working:
//
//	kubeproxy_sync_proxy_rules_duration_seconds          histogram: one sync (convert, build, publish)
//	kubeproxy_network_programming_duration_seconds       histogram: EndpointSlice last-change-trigger-time to publish
//	kubeproxy_sync_proxy_rules_last_timestamp_seconds    gauge: when the last sync finished
//	kubeproxy_sync_proxy_rules_service_changes_pending   gauge
//	kubeproxy_sync_proxy_rules_endpoint_changes_pending  gauge
//	kubeproxy_sync_proxy_rules_service_changes_total     counter: Service events
//	kubeproxy_sync_proxy_rules_endpoint_changes_total    counter: EndpointSlice events
//
// The metrics are registered on the registry the caller passes; the caller
// serves it. A nil *Metrics is valid and records nothing.
package metrics
