package service

import (
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/maglev"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// Key identifies a frontend (destination address, port and protocol) or a
// backend (its address, port and the service's protocol). It is comparable
// and pointer-free, so hash tables of Keys are invisible to the garbage
// collector and can be copied into BPF maps as they are.
type Key struct {
	Addr  packet.Addr
	Port  uint16
	Proto packet.Proto
}

// Kind says how a frontend was reached, which decides its traffic policy
// and masquerading.
type Kind uint8

// Frontend kinds. All but ClusterIP are "external" in kube-proxy's terms.
const (
	ClusterIP Kind = iota
	NodePort
	ExternalIP
	LoadBalancer
)

func (k Kind) String() string {
	switch k {
	case ClusterIP:
		return "ClusterIP"
	case NodePort:
		return "NodePort"
	case ExternalIP:
		return "ExternalIP"
	case LoadBalancer:
		return "LoadBalancer"
	}
	return "unknown"
}

// External reports whether externalTrafficPolicy governs the kind.
func (k Kind) External() bool { return k != ClusterIP }

// Verdict is what the dataplane does with a new flow to a frontend.
type Verdict uint8

const (
	// Forward: pick a backend with Select and translate.
	Forward Verdict = iota
	// Reject: the service has no usable endpoint anywhere; answer with
	// ICMP port unreachable (or a TCP RST), as kube-proxy's REJECT does.
	Reject
	// Drop: endpoints exist, but none this traffic may use (traffic
	// policy Local with no endpoint on this node); drop silently, as
	// kube-proxy does, so clients and load balancers time out or retry
	// elsewhere instead of failing fast.
	Drop
)

func (v Verdict) String() string {
	switch v {
	case Forward:
		return "forward"
	case Reject:
		return "reject"
	case Drop:
		return "drop"
	}
	return "unknown"
}

// Backend is one usable endpoint of a backend set. Pointer-free.
type Backend struct {
	Addr packet.Addr
	Port uint16
	// Local is set when the endpoint runs on this node.
	Local bool
	// Terminating is set when the set fell back to serving, terminating
	// endpoints because none was ready.
	Terminating bool
}

// Key returns the backend's key for the service protocol proto.
func (b *Backend) Key(proto packet.Proto) Key { return Key{Addr: b.Addr, Port: b.Port, Proto: proto} }

// BackendSet is one list of usable endpoints, sorted by address and port,
// with the Maglev table built for it when the port uses Maglev.
type BackendSet struct {
	Backends []Backend
	maglev   *maglev.Table
}

// Len returns the number of backends.
func (s *BackendSet) Len() int { return len(s.Backends) }

// find returns the backend with addr and port, or nil: by linear scan for
// small sets, else by binary search.
func (s *BackendSet) find(addr packet.Addr, port uint16) *Backend {
	if len(s.Backends) <= 16 {
		for i := range s.Backends {
			if b := &s.Backends[i]; b.Port == port && b.Addr == addr {
				return b
			}
		}
		return nil
	}
	lo, hi := 0, len(s.Backends)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if compareBackend(&s.Backends[m], addr, port) < 0 {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(s.Backends) && s.Backends[lo].Addr == addr && s.Backends[lo].Port == port {
		return &s.Backends[lo]
	}
	return nil
}

// Family indexes per-family data: kube-proxy handles IPv4 and IPv6 as two
// separate proxies, so a service's IPv4 frontends use only its IPv4
// endpoints, and fallbacks are decided per family.
const (
	IPv4 = 0
	IPv6 = 1
)

func familyOf(a packet.Addr) int {
	if a.Is4() {
		return IPv4
	}
	return IPv6
}

// Port is one compiled ServicePort. It is shared by all its frontends.
type Port struct {
	Name  PortName
	Proto packet.Proto
	Port  uint16
	// NodePort and HealthCheckNodePort are 0 when absent.
	NodePort            uint16
	HealthCheckNodePort uint16
	Scheduler           Scheduler
	ExternalPolicyLocal bool
	InternalPolicyLocal bool
	AffinityTimeout     time.Duration
	// ID identifies the port across table swaps (a hash of its name and
	// protocol, never 0); session affinity is keyed by it.
	ID uint64
	// Revision is the ServicePort's Revision (see CompileFrom).
	Revision uint64

	// Cluster is, per family, the endpoints used under traffic policy
	// Cluster: ready ones (narrowed to this zone when zone hints apply),
	// or serving-terminating ones when none is ready.
	Cluster [2]BackendSet
	// Local is, per family, this node's ready endpoints, or its
	// serving-terminating ones when none is ready. Empty unless a
	// traffic policy of the port is Local.
	Local [2]BackendSet
	// HasEndpoints is, per family, whether any usable endpoint exists
	// anywhere in the cluster; without one every frontend rejects.
	HasEndpoints [2]bool
	// LocalReady counts this node's ready endpoints (both families), the
	// number a HealthCheckNodePort reports.
	LocalReady int

	families      [2]bool
	affinitySec   uint32
	sourceRanges  [2][]prefix
	allowFromNode [2]bool
	lbIPs         []packet.Addr
	settings      *settings
	endpointKeys  []Key    // of all endpoints, usable or not, for IsBackend
	problems      []string // what compiling the port had to skip
}

// Frontend is one address:port:protocol that a service answers on.
type Frontend struct {
	Key  Key
	Kind Kind
	Port *Port

	verdict      Verdict
	backends     *BackendSet // traffic in general
	shortCircuit *BackendSet // local-origin traffic
	rr           atomic.Uint64
}

// Table is an immutable snapshot of all frontends. Build it with Compile
// or CompileFrom; publish it with Current.
type Table struct {
	generation uint64
	version    string
	settings   *settings

	ports     []*Port    // shared with the tables compiled from this one
	order     []int32    // ports[i] was compiled from the model's Ports[order[i]]
	names     []portName // ports[i]'s name, to match ports without reading them
	revisions []uint64   // ports[i].Revision, likewise
	// problemPorts are the indexes of the ports with problems.
	problemPorts []int32

	// Frontend i is pages[i/frontendPageSize][i%frontendPageSize]; the
	// index holds these positions. The frontends of ports[i] are those
	// from firstFrontend[i] to firstFrontend[i+1].
	pages         []*frontendPage
	nFrontends    int
	index         keyIndex // frontend keys -> frontends
	firstFrontend []int32
	conflicts     bool // some frontend was claimed twice
	backends      backendIndex

	frontendKeys []Key
	vips         []packet.Addr
	problems     []string

	// backendKeys is listed from backends on first use (the dataplane
	// wants it after the table is published, not before), or shared with
	// the previous table when the set did not change.
	backendKeys atomic.Pointer[[]Key]

	// Copies of settings' fields, one pointer closer to IsLocalOrigin.
	clusterCIDRs []prefix
	nodeAddrs    []packet.Addr
}

// Lookup returns the frontend for a packet to dst:port over proto, or nil
// when dst:port is no service. It does not allocate and may be called by
// any number of goroutines at once. A nil Table has no frontends.
func (t *Table) Lookup(proto packet.Proto, dst packet.Addr, port uint16) *Frontend {
	if t == nil {
		return nil
	}
	i := t.index.find(&dst, port, proto)
	if i < 0 {
		return nil
	}
	return t.frontend(i)
}

// IsBackend reports whether addr:port over proto is an endpoint of any
// service in the model, usable or not: replies from an endpoint that has
// just stopped being ready still belong to live flows.
func (t *Table) IsBackend(proto packet.Proto, addr packet.Addr, port uint16) bool {
	if t == nil {
		return false
	}
	return t.backends.contains(&addr, port, proto)
}

// Generation is the number Compile was given, or a process-wide counter
// value when it was given none; a later Compile has a larger one.
func (t *Table) Generation() uint64 { return t.generation }

// Version is the free-form label Compile was given (for logs and metrics).
func (t *Table) Version() string { return t.version }

// FrontendKeys lists every frontend key, for the XDP program's map of
// addresses to steer to user space. The slice belongs to the table; do not
// modify it.
func (t *Table) FrontendKeys() []Key { return t.frontendKeys }

// BackendKeys lists every endpoint key (see IsBackend) once, in no
// particular order, so the XDP program can steer replies from backends.
// The first call lists them; the slice belongs to the table.
func (t *Table) BackendKeys() []Key {
	if ks := t.backendKeys.Load(); ks != nil {
		return *ks
	}
	ks := t.backends.keys()
	t.backendKeys.CompareAndSwap(nil, &ks)
	return *t.backendKeys.Load()
}

// VIPs lists the distinct service addresses: cluster IPs, external IPs
// and load-balancer IPs, sorted. Node addresses, which carry NodePorts,
// are not VIPs; their NodePort keys are in FrontendKeys. The slice belongs
// to the table.
func (t *Table) VIPs() []packet.Addr { return t.vips }

// Ports lists the compiled service ports, sorted by name and protocol.
// The ports belong to the table (and to the tables compiled from it); do
// not modify them.
func (t *Table) Ports() []*Port { return t.ports }

// Frontends returns the number of frontends.
func (t *Table) Frontends() int { return t.nFrontends }

func (t *Table) frontend(i int) *Frontend {
	return &t.pages[uint(i)/frontendPageSize][uint(i)%frontendPageSize]
}

// Problems lists what Compile had to skip: frontend keys claimed by two
// service ports (the first by name wins, as the list is sorted) and Maglev
// tables that could not be built.
func (t *Table) Problems() []string { return t.problems }

// Current holds the table the workers use. Workers Load it once per batch;
// the control plane Stores each newly compiled table. The zero value holds
// no table, and Load then returns nil, which looks up nothing.
type Current struct {
	p atomic.Pointer[Table]
}

// Load returns the current table.
func (c *Current) Load() *Table { return c.p.Load() }

// Store publishes t; workers pick it up at their next Load.
func (c *Current) Store(t *Table) { c.p.Store(t) }
