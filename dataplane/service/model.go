package service

import (
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Model is the plain description of what to load balance, as every service
// source (the static file, the Kubernetes API) produces it. It holds no
// Kubernetes types: control/ translates API objects into it, and Compile
// turns it into the immutable Table that the workers read.
type Model struct {
	Node  Node
	Ports []ServicePort
}

// Node describes the node xdproxy runs on, for traffic policy Local,
// topology-aware routing and NodePorts.
type Node struct {
	Name string
	Zone string
	// Addresses are the node's addresses on which NodePorts listen
	// (nodePortAddresses applied).
	Addresses []packet.Addr
}

// PortName names one port of a service, the unit kube-proxy programs
// (its ServicePortName): "namespace/name:port", or "namespace/name" for an
// unnamed port.
type PortName struct {
	Namespace, Name, Port string
}

func (n PortName) String() string {
	if n.Port == "" {
		return n.Namespace + "/" + n.Name
	}
	return n.Namespace + "/" + n.Name + ":" + n.Port
}

// Scheduler chooses the backend of a new flow.
type Scheduler uint8

const (
	// Random picks uniformly among usable endpoints, as kube-proxy does.
	Random Scheduler = iota
	// RoundRobin cycles through usable endpoints.
	RoundRobin
	// Maglev hashes the flow onto a Maglev lookup table, so that a flow
	// keeps its backend when other backends come and go.
	Maglev
)

func (s Scheduler) String() string {
	switch s {
	case Random:
		return "random"
	case RoundRobin:
		return "roundrobin"
	case Maglev:
		return "maglev"
	}
	return "unknown"
}

// ServicePort is one port of one Service with its endpoints.
type ServicePort struct {
	Name  PortName
	Proto packet.Proto
	// Revision identifies this version of the port for CompileFrom, which
	// reuses the compiled port of the previous table when Name, Proto and
	// Revision match. 0 means unknown: the port is always compiled. A
	// source that sets it must give a port a new revision (NewRevision)
	// whenever anything in it, endpoints included, may have changed.
	Revision uint64
	// ClusterIPs are the service's cluster IPs (one per family).
	ClusterIPs []packet.Addr
	Port       uint16
	// NodePort is 0 when the service has none.
	NodePort        uint16
	ExternalIPs     []packet.Addr
	LoadBalancerIPs []packet.Addr
	// SourceRanges restricts load-balancer traffic
	// (spec.loadBalancerSourceRanges); empty means no restriction.
	SourceRanges []netip.Prefix

	// AffinityTimeout > 0 turns on ClientIP session affinity.
	AffinityTimeout time.Duration

	// ExternalPolicyLocal is externalTrafficPolicy: Local; it applies to
	// NodePort, load-balancer and external IP frontends.
	ExternalPolicyLocal bool
	// InternalPolicyLocal is internalTrafficPolicy: Local; it applies to
	// cluster IPs.
	InternalPolicyLocal bool
	// HealthCheckNodePort serves LocalReady, the local endpoint count,
	// for a LoadBalancer Service with externalTrafficPolicy Local (the
	// API server allocates it for those only); 0 otherwise, a NodePort
	// Service with Local included.
	HealthCheckNodePort uint16
	// TopologyAware is set when endpoints' zone hints should be honoured
	// (trafficDistribution: PreferClose or the topology-mode annotation).
	TopologyAware bool

	Scheduler Scheduler
	Endpoints []Endpoint
}

// Endpoint is one backend of a ServicePort, with the conditions of its
// EndpointSlice entry.
type Endpoint struct {
	Addr packet.Addr
	Port uint16
	// Ready, Serving and Terminating are the EndpointSlice conditions.
	// kube-proxy uses ready endpoints, and falls back to serving
	// terminating ones only when no endpoint is ready.
	Ready, Serving, Terminating bool
	NodeName                    string
	Zone                        string
	// ZoneHints are the zones this endpoint should serve
	// (hints.forZones); empty when the slice carries no hints.
	ZoneHints []string
}

var revisions atomic.Uint64

// NewRevision returns a ServicePort revision no earlier call returned, from
// a process-wide counter, so that sources never hand out one twice.
func NewRevision() uint64 { return revisions.Add(1) }
