// Package kubesource feeds the service model from a Kubernetes API server,
// as kube-proxy does: client-go shared informers watch v1 Services,
// discovery.k8s.io/v1 EndpointSlices and this node's v1 Node; each event
// becomes one (previous, current) change in a change tracker; a
// bounded-frequency runner turns the pending changes into a new Model and
// hands it to the publish callback.
//
// Guarantees:
//
//   - Nothing is published before the Service, EndpointSlice and Node
//     informers have all synced (the Node object itself may be missing; the
//     node then has no zone and no API-given addresses).
//   - Only services whose objects changed are converted and rebuilt
//     (k8sconv.Builder caches the rest).
//   - A Model is published only when something changed (the first sync
//     always publishes, even an empty cluster, because that is the truth).
//   - When the API server is unreachable or restarts, the last published
//     Model stays in force: list and watch errors never reach the model, the
//     informers retry and relist on their own, and a relist only changes
//     objects that really changed.
//   - Publishing may fail (the callback returns an error); nothing is lost.
//     The Model is kept and tried again 1 s after the first failure, then
//     after 2, 4, 8, 16 and 30 s (at most; runner.Retry), and never sooner
//     than MinSyncPeriod after the last try. Changes that arrive meanwhile
//     wait in the change trackers and are built into the retry, so what is
//     published is always the latest Model. The first failure is logged,
//     then at most one line every 30 s, and "recovered after N failures"
//     once it works. Metrics: xdproxy_publish_failures_total counts the
//     failed tries, xdproxy_publish_pending is 1 while a Model waits; the
//     kube-proxy sync metrics (duration, last timestamp, network
//     programming latency) move only on a successful publish.
//   - Config.Health hears what kube-proxy's proxier tells its health
//     server: Updated when Run starts and after each successful publish,
//     QueuedUpdate, once the initial lists are in, for every Service event
//     while a Service change is pending, every EndpointSlice event that
//     changed its slice, and every change of the Node that the model sees.
//     A failed publish calls neither, so /healthz fails once a change has
//     waited longer than its timeout. (As in kube-proxy, a failing first
//     publish is not queued and so not seen there; the pending gauge and
//     the log show it.)
//   - NodeState reports this node's Node for node eligibility: Known once
//     it has been seen, Deleting while it carries a deletion timestamp or
//     the ToBeDeletedByClusterAutoscaler taint. It does not publish
//     anything by itself.
//
// The credentials need list and watch on services, endpointslices
// (discovery.k8s.io) and nodes, as kube-proxy's system:node-proxier role
// grants. A Source runs once: call Run a single time.
//
// A Source needs only a kubeconfig path (or in-cluster configuration), so an
// integration test against a real API server constructs it exactly as the
// daemon does.
package kubesource
