package service

import (
	"math/bits"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Local origin. kube-proxy treats traffic from pods (sources inside the
// cluster CIDRs) and from the node itself specially when it goes to an
// external frontend with traffic policy Local: it is not subject to that
// policy and uses the cluster list, as if it had gone out to an external
// load balancer and come back. The dataplane decides per packet whether a
// source is local origin, normally with Table.IsLocalOrigin, and passes
// that to Verdict, Backends and Select. For cluster IPs and for policy
// Cluster the flag changes nothing.

// IsLocalOrigin reports whether src is a pod (inside the cluster CIDRs)
// or one of the node's addresses, kube-proxy's test for short-circuiting
// external traffic policy Local.
func (t *Table) IsLocalOrigin(src packet.Addr) bool {
	return anyContains(t.clusterCIDRs, &src) || t.isNodeAddr(&src)
}

func (t *Table) isNodeAddr(a *packet.Addr) bool {
	for i := range t.nodeAddrs {
		if t.nodeAddrs[i] == *a {
			return true
		}
	}
	return false
}

// Verdict says what to do with a new flow to f.
func (f *Frontend) Verdict(localOrigin bool) Verdict {
	if localOrigin && f.shortCircuit.Len() > 0 {
		return Forward
	}
	return f.verdict
}

// Backends returns the list Select chooses from: the short-circuit
// (cluster) list for local-origin traffic, else the frontend's policy
// list. Empty when Verdict is not Forward. The slice belongs to the table.
func (f *Frontend) Backends(localOrigin bool) []Backend {
	return f.set(localOrigin).Backends
}

func (f *Frontend) set(localOrigin bool) *BackendSet {
	if localOrigin {
		return f.shortCircuit
	}
	return f.backends
}

// Select picks the backend of a new flow, or returns nil when the verdict
// is Reject or Drop. flowHash must be a hash of the flow's tuple (Maglev
// uses it); rnd must come from the calling worker's own random source
// (Random uses it). RoundRobin advances an atomic counter of the frontend,
// shared by all workers. Select does not allocate.
func (f *Frontend) Select(flowHash, rnd uint64, localOrigin bool) *Backend {
	s := f.set(localOrigin)
	n := uint64(len(s.Backends))
	if n == 0 {
		return nil
	}
	var i uint64
	switch f.Port.Scheduler {
	case RoundRobin:
		i = (f.rr.Add(1) - 1) % n
	case Maglev:
		if s.maglev != nil {
			return &s.Backends[s.maglev.Lookup(flowHash)]
		}
		i, _ = bits.Mul64(flowHash, n)
	default:
		// Multiply-shift maps rnd onto [0, n) without a division.
		i, _ = bits.Mul64(rnd, n)
	}
	return &s.Backends[i]
}

// NeedsMasquerade reports whether a flow from src to f, sent to backend,
// must have its source rewritten to the node's address, following
// kube-proxy:
//
//   - hairpin: the client is the chosen backend itself (src ==
//     backend.Addr), which would otherwise answer itself directly;
//   - cluster IPs: with MasqueradeAll always; otherwise when the source is
//     outside the cluster CIDRs (off-cluster traffic routed to a service
//     IP might leave the node); with no cluster CIDRs configured, never;
//   - external frontends with traffic policy Cluster: always, because the
//     backend may be on another node and must answer through this one;
//   - external frontends with traffic policy Local: only when the source
//     is one of the node's own addresses (its replies would otherwise stay
//     on the node); other clients keep their address, which is the point
//     of policy Local.
//
// backend may be nil when no backend was chosen. It does not allocate.
func NeedsMasquerade(f *Frontend, src packet.Addr, backend *Backend) bool {
	if backend != nil && backend.Addr == src {
		return true
	}
	s := f.Port.settings
	if f.Kind == ClusterIP {
		return s.masqueradeAll || (len(s.clusterCIDRs) > 0 && !anyContains(s.clusterCIDRs, &src))
	}
	if !f.Port.ExternalPolicyLocal {
		return true
	}
	return s.isNodeAddr(&src)
}

// AllowsSource reports whether src may use f: false only for a
// load-balancer frontend whose service has loadBalancerSourceRanges of
// f's family, none of which holds src. When a range holds a node address,
// the LB IPs themselves are admitted too (traffic from the node to a VIP
// bound locally arrives with the VIP as source). NodePorts and other kinds
// are never restricted, as in kube-proxy. It does not allocate.
func (f *Frontend) AllowsSource(src packet.Addr) bool {
	if f.Kind != LoadBalancer {
		return true
	}
	fam := familyOf(f.Key.Addr)
	ranges := f.Port.sourceRanges[fam]
	if len(ranges) == 0 || anyContains(ranges, &src) {
		return true
	}
	if f.Port.allowFromNode[fam] {
		for _, ip := range f.Port.lbIPs {
			if ip == src {
				return true
			}
		}
	}
	return false
}
