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
package agent
