// Package testbed builds a throw-away network-namespace topology for
// privileged tests, benchmarks and demos of xdproxy:
//
//	client ns            node ns (xdproxy runs here)         lan ns             backend ns (xN)
//	c0 198.18.0.2/24 --- n0 198.18.0.1/24
//	                     n1 198.18.1.1/24 ------------------ ln ] br0 [ lbI --- b0 198.18.1.(11+I)/24
//
// The node forwards between n0 and n1 with the kernel (ip_forward=1,
// rp_filter off), so plain routing works before xdproxy attaches. The
// client's default route points at the node and so covers the ClusterIP
// range ClusterIPRange (198.19.0.0/16) used by tests. With Options.IPv6 the
// same shape is repeated in 2001:db8:18::/48.
//
// Namespaces are named "xdpt-<pid>-<random>-<role>", so parallel runs do not
// collide and CleanupStale can delete what a killed run left behind.
//
// Rules for callers:
//   - Close deletes every namespace; call it (or use NewForTest) even when a
//     test fails. It is idempotent.
//   - Do runs its function on one OS thread inside the namespace. Goroutines
//     the function starts do not inherit the namespace, but sockets it opens
//     stay in it after Do returns.
//   - /sys is per namespace only through "ip netns exec"; the tuning helpers
//     (SetRPS, SetThreadedNAPI) go through it for that reason.
package testbed
