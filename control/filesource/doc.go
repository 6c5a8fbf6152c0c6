// Package filesource feeds the service model from a file instead of an API
// server: the same kubectl-style YAML that `kubectl apply -f` takes, holding
// v1 Services and discovery.k8s.io/v1 EndpointSlices (documents separated
// by "---", or kind: List), converted exactly as the Kubernetes source
// converts them (package k8sconv). Documents of other kinds are ignored.
//
// Because no API server allocates cluster IPs, every Service must give
// spec.clusterIP (or spec.clusterIPs); one that does not is reported and
// skipped. EndpointSlices need the kubernetes.io/service-name label, as in
// a cluster. Objects without a namespace are in "default".
//
// The file is polled (its inode, size and times, then a hash of its
// content), so an editor that writes a new file and renames it over the old
// one is seen, as is a ConfigMap volume's symlink swap. A change is loaded
// once the file has stayed the same for one poll interval. Failure is never
// a reason to stop forwarding: an unreadable or missing file, or a file in
// which no document is usable, leaves the last published Model in force; an
// invalid document is reported with its position and skipped while the rest
// applies.
//
// Publishing may fail (the callback returns an error). The Model is then
// kept and tried again on a timer of its own, 1 s after the first failure
// and then after 2, 4, 8, 16 and 30 s at most; a file changed meanwhile
// replaces the waiting Model and is published by the retry. The first
// failure is logged, then at most one line every 30 s, and "recovered
// after N failures" once it works; xdproxy_publish_failures_total and
// xdproxy_publish_pending count them, and the sync metrics move only on a
// successful publish.
//
// Config.Health is told Updated when Run starts and after each successful
// publish, and QueuedUpdate when a changed file yields a new Model (not
// for the first load, as kube-proxy does not queue its initial sync).
package filesource
