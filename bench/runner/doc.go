// Package runner drives a benchmark run: for every group of variants (the
// paths measured side by side at one service count, on one feed) it builds
// a fresh bench/topo topology per variant with its bench/feed, programs the
// path under test (nothing, kernel rules in kube-proxy's shapes, the real
// kube-proxy, or the xdproxy binary in one of its modes), attaches the
// bench/sink counter, and runs the generator (bench/cmd/xdproxy-pktgen, a
// separate process pinned to the generator CPU) for a warm-up, cost runs
// that go round the group one trial at a time, and a bench/search zero-loss
// search per variant; then it runs the TCP connection test, and returns a
// report.Run.
//
// xdproxy is always the real binary (`xdproxy run --config FILE`), in its
// own process in the node namespace, its workers pinned to the forwarding
// CPU by the config the runner writes. The runner learns that it is ready
// from its admin socket (the published table holding every frontend), reads
// its counters there, and takes CPU profiles from the socket's
// /debug/pprof/profile while a trial runs. Nothing in the benchmark links
// the engine in.
//
// Run needs root, iproute2, ethtool, iptables-restore and nft. It deletes
// every namespace it made, also on errors.
package runner
