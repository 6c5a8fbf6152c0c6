// Package topo builds the benchmark's veth topology, the same for every
// variant measured:
//
//	gen ns                node ns (the path under test)            sink ns
//	g0 198.18.0.2/24 ---- n0 198.18.0.1/24   n1 198.18.1.1/24 ---- s0 198.18.1.2/24
//	                                                                  198.18.1.3/24
//
// The generator transmits on g0, or with Options.FeedPair on gx, one end
// of a second veth pair (gx <-> gr) inside the generator namespace, whose
// far end bench/feed makes redirect every frame into g0 (the NIC-shaped
// feed); the node forwards n0 -> n1 (kernel forwarding, kernel NAT rules,
// or xdproxy on AF_XDP); the sink counts on s0 in XDP. The generator's flows come from 198.18.0.16 and up, inside
// the pod CIDR 198.18.0.0/24, so the kube-proxy rules treat them as pods
// (no masquerade). Neighbour entries are static, so no ARP runs during a
// trial.
//
// A CPU plan says which CPU generates and which forwards (Plan). Tuning
// helpers move receive work: SetRPS for the backlog path, SetThreaded and
// Pin for veth NAPI instances (which exist while the veth has an XDP
// program or GRO on).
//
// Namespaces are named "xdpt-<pid>-<hex>-<role>", the testbed's scheme, so
// testbed.CleanupStale removes what a killed run left. Close deletes them
// all and kills processes still inside.
package topo
