// Package agent is xdproxy on one node, wired once: it starts the dataplane
// engine on the real kernel, the configured service source (a file or the
// API server), the health endpoints with kube-proxy's rules and the
// healthCheckNodePort servers, the Prometheus metrics and the admin socket,
// and publishes every model the source produces to the engine.
//
// The daemon (cmd/xdproxy) is flags plus Run; the demo and the benchmark
// run that binary and wait for it through its /healthz or admin socket, so
// there is exactly one place where the parts are put together.
//
// Stopping. Run returns when its context ends (SIGTERM). It then keeps what
// a restart needs (pinned XDP programs and tables, the connection-tracking
// and affinity state files, the exception link): the next process adopts
// them and established connections go on. Cleanup removes all of it.
//
// Fault injection, a testing aid. The publisher hands every table to the
// engine through a faulty decorator that is idle until armed on the admin
// socket (root's, like the rest of it): POST /debug/faults?publish=N makes
// the next N publishes fail with ErrInjected before the engine sees them,
// as a dataplane that cannot be programmed would; 0 disarms, and GET
// /debug/faults says how many are left and how many were injected. The
// source then retries with its backoff, xdproxy_publish_failures_total and
// xdproxy_publish_pending move, and /healthz fails once the change has
// waited longer than its timeout, so the end-to-end tests can watch the
// real binary fail and recover. Nothing else changes while it is not armed.
package agent
