// Package kubeproxy runs the real kube-proxy as a benchmark baseline: a
// private etcd and kube-apiserver on the root namespace's 127.0.0.1
// (Cluster), the benchmark's services created through the API (Apply), a
// TCP forwarder that makes the API server reachable from inside the node
// namespace (Forward), and kube-proxy itself in that namespace in iptables
// or nftables mode, started from a generated KubeProxyConfiguration and
// waited on until its rules hold every service (Start).
//
// The binaries are the ones `make kube-tools` builds (internal/kubetools);
// without them FindBinaries says so and the benchmark skips these paths.
package kubeproxy
