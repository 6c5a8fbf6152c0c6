// Package health answers the questions a node's health checkers ask an
// xdproxy, with kube-proxy's semantics so that kubelet probes, cloud load
// balancers and existing tooling need no change:
//
//   - /healthz (Proxy): 200 while the dataplane is up to date with the
//     services, meaning no update has been waiting longer than the timeout
//     since it was queued (kube-proxy's QueuedUpdate/Updated rule), the
//     Node is not being deleted (nodeEligible), and every readiness Check
//     passes (xdproxy adds "every configured interface is served").
//   - /livez (Proxy): the same without node eligibility, and with the
//     liveness Checks instead (xdproxy adds "every worker goes round").
//   - healthCheckNodePort servers (Services): one HTTP server per Service
//     with externalTrafficPolicy Local, answering 200 with the number of
//     local endpoints when there are some and the proxy is healthy, 503
//     otherwise, in kube-proxy's JSON.
//
// Proxy and Services are safe for concurrent use. Time comes from a
// k8s.io/utils/clock so tests control it.
package health
