// Package service holds the service table that workers consult for every
// new flow: an immutable snapshot compiled from a Model, looked up with an
// open-addressing hash on pointer-free keys, plus backend selection
// (random, round robin, Maglev) and ClientIP session affinity.
//
// A Table is never modified after Compile returns it. Any number of workers
// may read one while the control plane compiles the next; publishing a new
// table is one atomic pointer store (see Current). Workers load the pointer
// once per batch and must not keep it across batches.
//
// CompileFrom compiles the next table from the current one: ports whose
// ServicePort.Revision did not change are shared as they are, and so are
// the frontend index and the unchanged parts of the backend index, so one
// changed EndpointSlice costs one service plus a pass over the port list
// (about 0.3 ms at 10,000 services, against about 30 ms for Compile).
// Shared parts keep the allocations they came from alive: after many
// incremental compiles a table can hold up to about twice the memory of a
// fresh one, which a full Compile returns.
//
// Semantics follow kube-proxy (pkg/proxy/topology.go and the nftables
// proxier), per IP family:
//
//   - Frontends: each cluster IP:port, each node address:NodePort, each
//     external IP:port and each load-balancer IP:port, with its Kind.
//   - Usable endpoints are the ready ones, or the serving-terminating ones
//     when none is ready. The cluster list honours zone hints when every
//     ready endpoint has hints and one is for this node's zone; the local
//     list holds this node's endpoints only.
//   - Cluster IPs use the local list under internalTrafficPolicy Local,
//     else the cluster list. External frontends use the local list under
//     externalTrafficPolicy Local, else the cluster list; but local-origin
//     traffic (pods, the node itself: Table.IsLocalOrigin) to them always
//     uses the cluster list. The dataplane passes that flag to
//     Frontend.Verdict and Frontend.Select.
//   - A frontend whose service has no usable endpoint says Reject (answer
//     ICMP unreachable or TCP RST); one whose policy Local finds no local
//     endpoint says Drop.
//   - NeedsMasquerade, Frontend.AllowsSource (loadBalancerSourceRanges)
//     and SelectWithAffinity are per-packet decisions made from
//     precomputed data; none of them allocates.
//
// Affinity state mutates, so it lives outside the snapshot in an Affinity
// table keyed by Port.ID and addresses, and survives table swaps.
//
// Maglev backend sets (Scheduler Maglev) cost 4 bytes a slot (64 KiB at
// the default 16381 slots) per family and list, and about half a
// millisecond each to build; use Maglev where flows must survive backend
// changes, not for every service.
package service
