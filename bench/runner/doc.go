// Package runner drives a benchmark run: for every variant it builds a
// fresh bench/topo topology, programs the path under test (nothing, kernel
// rules in kube-proxy's shapes, or xdproxy), attaches the bench/sink
// counter, runs the generator (bench/cmd/xdproxy-pktgen, a separate
// process pinned to the generator CPU) for a warm-up, cost runs and a
// bench/search zero-loss search, then runs the TCP connection test, and
// returns a report.Run.
//
// xdproxy runs as its own process in the node namespace: the hidden
// "dataplane" subcommand of xdproxy-bench (RunDataplane) starts the real
// dataplane engine with the benchmark's services, its workers pinned to the
// forwarding CPU, so that its CPU time can be measured apart from
// everything else.
//
// The real kube-proxy paths (bench/kubeproxy) run kube-proxy against its
// own API server in the node namespace and measure the kernel's forwarding
// threads, as for the kernel-rule paths.
//
// Run needs root, iproute2, ethtool, iptables-restore and nft. It deletes
// every namespace it made, also on errors.
package runner
