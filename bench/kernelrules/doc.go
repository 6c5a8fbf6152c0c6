// Package kernelrules writes the rules kube-proxy would program for a set of
// Services, so that the kernel baselines of the benchmark carry the same
// work as a real cluster: iptables-restore input in kube-proxy's iptables
// shape (KUBE-SERVICES -> KUBE-SVC-* -> KUBE-SEP-*, probability-based
// endpoint choice, masquerade marks) and nft -f input in its nftables shape
// (one verdict map from cluster IP, protocol and port to a service chain,
// numgen for the endpoint choice).
//
// ServiceSet is the single description of the synthetic services; the
// xdproxy side of the benchmark builds its model from the same value, so
// every path sees identical services. Nothing here touches the kernel: the
// caller feeds the text to iptables-restore or nft inside the node's
// namespace.
package kernelrules
