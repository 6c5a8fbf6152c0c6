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
//
// The credentials need list and watch on services, endpointslices
// (discovery.k8s.io) and nodes, as kube-proxy's system:node-proxier role
// grants. A Source runs once: call Run a single time.
//
// A Source needs only a kubeconfig path (or in-cluster configuration), so an
// integration test against a real API server constructs it exactly as the
// daemon does.
package kubesource
