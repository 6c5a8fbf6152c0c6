package service

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/xdproxy/xdproxy/dataplane/maglev"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// CompileOptions are the node-wide settings that shape a Table.
type CompileOptions struct {
	// ClusterCIDRs are the pod network ranges (kube-proxy's
	// --cluster-cidr / local-traffic detector). Traffic to a cluster IP
	// from outside them is masqueraded; traffic from inside them to an
	// external frontend with policy Local is local-origin. Without any,
	// kube-proxy masquerades no cluster IP traffic (unless MasqueradeAll)
	// and only the node's own addresses count as local origin.
	ClusterCIDRs []netip.Prefix
	// MasqueradeAll masquerades all traffic to cluster IPs.
	MasqueradeAll bool
	// MaglevSize is the slot count of Maglev tables, a prime; 0 means
	// maglev.DefaultSize. Each Maglev backend set costs 4 bytes a slot.
	MaglevSize uint64
	// Generation numbers the table; 0 takes the next value of a
	// process-wide counter.
	Generation uint64
	// Version is a free-form label, such as the source's resource version.
	Version string
}

// Validate reports options that Compile would have to ignore.
func (o *CompileOptions) Validate() error {
	if o.MaglevSize != 0 && (o.MaglevSize > maglev.MaxSize || !maglev.IsPrime(o.MaglevSize)) {
		return fmt.Errorf("service: Maglev table size %d: %w", o.MaglevSize, maglev.ErrSizeNotPrime)
	}
	for _, p := range o.ClusterCIDRs {
		if !p.IsValid() {
			return fmt.Errorf("service: invalid cluster CIDR %v", p)
		}
	}
	return nil
}

var generations atomic.Uint64

// DefaultAffinityTimeout is kube-proxy's default ClientIP affinity
// timeout (sessionAffinityConfig.clientIP.timeoutSeconds), for sources
// that ask for affinity without a timeout.
const DefaultAffinityTimeout = 10800 * time.Second

// Compile builds the immutable Table for m. It does not modify or keep m.
// Options that fail Validate are replaced by their defaults and reported
// in Table.Problems.
func Compile(m *Model, opts CompileOptions) *Table { return CompileFrom(nil, m, opts) }

// CompileFrom is Compile that starts from prev, the table compiled from an
// earlier version of the model: a ServicePort whose Name, Proto and
// non-zero Revision match a port of prev is taken over from prev as it is
// (its backend sets, Maglev tables and source ranges are shared, not
// rebuilt), provided the node and the options are the same as prev's;
// every other port is compiled afresh. The result is the table Compile
// would return for m, except that round-robin positions may carry over
// and BackendKeys may list the keys in another order.
//
// prev is only read, never modified: workers may go on using it while
// CompileFrom runs and after. prev may be nil. The new table shares
// immutable parts of prev but holds no reference to prev itself, so a
// chain of tables compiled one from the other does not stay in memory.
func CompileFrom(prev *Table, m *Model, opts CompileOptions) *Table {
	t := &Table{generation: opts.Generation, version: opts.Version}
	if t.generation == 0 {
		t.generation = generations.Add(1)
	} else {
		// Keep the counter ahead of explicit generations too.
		for {
			g := generations.Load()
			if g >= opts.Generation || generations.CompareAndSwap(g, opts.Generation) {
				break
			}
		}
	}
	maglevSize := opts.MaglevSize
	if maglevSize != 0 && (maglevSize > maglev.MaxSize || !maglev.IsPrime(maglevSize)) {
		t.problems = append(t.problems, fmt.Sprintf("Maglev table size %d is not a prime; using %d", maglevSize, maglev.DefaultSize))
		maglevSize = 0
	}
	if prev != nil && prev.settings != nil && prev.settings.same(&m.Node, &opts, maglevSize) {
		t.settings = prev.settings
	} else {
		prev = nil
		t.settings = newSettings(&m.Node, &opts, maglevSize)
	}
	t.clusterCIDRs, t.nodeAddrs = t.settings.clusterCIDRs, t.settings.nodeAddrs

	// When the model lists the same ports in the same order as prev's,
	// the usual case, port i is prev's port i or its new version, and all
	// per-port work below reads compact arrays instead of the ports.
	inPlace := prev != nil && prev.sameOrder(m.Ports)
	if inPlace {
		t.order, t.names = prev.order, prev.names
	} else {
		t.order = sortedPorts(m.Ports)
		t.names = make([]portName, len(t.order))
		for i, mi := range t.order {
			t.names[i] = portName{m.Ports[mi].Name, m.Ports[mi].Proto}
		}
	}
	c := compiler{t: t, node: &m.Node, maglevSize: maglevSize}

	// Match each port with its compiled form in prev, and size the
	// arenas for the ports that must be compiled.
	from := make([]int32, len(t.order)) // index into prev.ports, or -1
	var compiled []int32                // the ports not taken from prev
	t.revisions = make([]uint64, len(t.order))
	nFrontends, nEndpoints := 0, 0
	j := 0
	for i, mi := range t.order {
		sp := &m.Ports[mi]
		t.revisions[i] = sp.Revision
		nFrontends += len(sp.ClusterIPs) + len(sp.ExternalIPs) + len(sp.LoadBalancerIPs)
		if sp.NodePort != 0 {
			nFrontends += len(m.Node.Addresses)
		}
		from[i] = -1
		switch {
		case inPlace:
			if sp.Revision != 0 && sp.Revision == prev.revisions[i] {
				from[i] = int32(i)
			}
		case prev != nil:
			var k int
			k, j = prev.match(sp, j)
			from[i] = int32(k)
		}
		if from[i] < 0 {
			nEndpoints += len(sp.Endpoints)
			compiled = append(compiled, int32(i))
		}
	}
	// Cluster and local lists together hold each endpoint at most twice.
	c.arena = make([]Backend, 0, 2*nEndpoints)
	c.keys = make([]Key, 0, nEndpoints)

	t.ports = make([]*Port, len(t.order))
	fresh := make([]Port, len(compiled))
	for i, k := range from {
		if k >= 0 {
			t.ports[i] = prev.ports[k]
		}
	}
	for n, i := range compiled {
		c.port(&fresh[n], &m.Ports[t.order[i]])
		t.ports[i] = &fresh[n]
	}
	t.listProblems(prev, inPlace, from, compiled)

	if prev == nil || !c.reuseFrontends(prev, m, from, compiled) {
		c.allFrontends(m, nFrontends)
	}
	if prev == nil || !t.backends.update(&prev.backends, prev.ports, from, t.ports) {
		t.backends = newBackendIndex(t.ports)
	} else if t.backends.same(&prev.backends) {
		t.backendKeys.Store(prev.backendKeys.Load())
	}
	return t
}

// listProblems appends the ports' problems to t's, in port order. In
// place, the ports with problems are prev's that were kept and the new
// ones that have some; otherwise every port is asked.
func (t *Table) listProblems(prev *Table, inPlace bool, from, compiled []int32) {
	if inPlace {
		for _, i := range prev.problemPorts {
			if from[i] >= 0 {
				t.problemPorts = append(t.problemPorts, i)
			}
		}
		for _, i := range compiled {
			if len(t.ports[i].problems) > 0 {
				t.problemPorts = append(t.problemPorts, i)
			}
		}
		slices.Sort(t.problemPorts)
	} else {
		for i, p := range t.ports {
			if len(p.problems) > 0 {
				t.problemPorts = append(t.problemPorts, int32(i))
			}
		}
	}
	for _, i := range t.problemPorts {
		t.problems = append(t.problems, t.ports[i].problems...)
	}
}

// portName is what identifies a port: its name and protocol.
type portName struct {
	name  PortName
	proto packet.Proto
}

// settings are the node and option inputs that every compiled Port
// depends on. Tables compiled with the same settings share one, which is
// what lets CompileFrom take a Port over from an earlier table unchanged.
type settings struct {
	nodeName, nodeZone string
	nodeAddrs          []packet.Addr
	cidrs              []netip.Prefix // as given, for comparison
	clusterCIDRs       []prefix
	masqueradeAll      bool
	maglevSize         uint64 // validated; 0 is the default size
}

func newSettings(node *Node, opts *CompileOptions, maglevSize uint64) *settings {
	s := &settings{
		nodeName:      node.Name,
		nodeZone:      node.Zone,
		nodeAddrs:     slices.Clone(node.Addresses),
		cidrs:         slices.Clone(opts.ClusterCIDRs),
		masqueradeAll: opts.MasqueradeAll,
		maglevSize:    maglevSize,
	}
	for _, p := range opts.ClusterCIDRs {
		if pf, ok := prefixFrom(p); ok {
			s.clusterCIDRs = append(s.clusterCIDRs, pf)
		}
	}
	return s
}

func (s *settings) same(node *Node, opts *CompileOptions, maglevSize uint64) bool {
	return s.nodeName == node.Name && s.nodeZone == node.Zone && slices.Equal(s.nodeAddrs, node.Addresses) &&
		slices.Equal(s.cidrs, opts.ClusterCIDRs) && s.masqueradeAll == opts.MasqueradeAll && s.maglevSize == maglevSize
}

func (s *settings) isNodeAddr(a *packet.Addr) bool {
	for i := range s.nodeAddrs {
		if s.nodeAddrs[i] == *a {
			return true
		}
	}
	return false
}

// sortedPorts returns the indexes of ports sorted by name and protocol, so
// that the outcome, conflicts included, does not depend on the order the
// source listed them in.
func sortedPorts(ports []ServicePort) []int32 {
	order := make([]int32, len(ports))
	for i := range order {
		order[i] = int32(i)
	}
	byName := func(a, b int32) int {
		return comparePorts(&ports[a].Name, ports[a].Proto, &ports[b].Name, ports[b].Proto)
	}
	// Sources usually list ports sorted already.
	if !slices.IsSortedFunc(order, byName) {
		slices.SortFunc(order, byName)
	}
	return order
}

// sameOrder reports whether ports lists the same names as the model t
// was compiled from, in the same order, so that t's sort order applies.
// Sources that keep their list stable make this the usual case, and it
// costs one string comparison per port (often just a pointer comparison,
// as sources share the strings), far less than sorting.
func (t *Table) sameOrder(ports []ServicePort) bool {
	if len(ports) != len(t.order) {
		return false
	}
	for i, mi := range t.order {
		if ports[mi].Name != t.names[i].name || ports[mi].Proto != t.names[i].proto {
			return false
		}
	}
	return true
}

func comparePorts(a *PortName, pa packet.Proto, b *PortName, pb packet.Proto) int {
	return cmp.Or(
		cmp.Compare(a.Namespace, b.Namespace),
		cmp.Compare(a.Name, b.Name),
		cmp.Compare(a.Port, b.Port),
		cmp.Compare(pa, pb),
	)
}

// match finds the compiled port of t that sp may take over: same name,
// protocol and non-zero revision. Ports arrive in t's order, so the search
// starts at from, where the previous one ended; match returns the index
// (-1 when there is none) and where the next search starts. A port of t
// is matched at most once, even when a malformed model lists a name
// twice, so that the backend index counts each port once.
func (t *Table) match(sp *ServicePort, from int) (int, int) {
	names := t.names
	// Skip ports that sort before sp: they are gone from the model.
	for from < len(names) && comparePorts(&names[from].name, names[from].proto, &sp.Name, sp.Proto) < 0 {
		from++
	}
	if sp.Revision == 0 {
		return -1, from
	}
	for k := from; k < len(names) && names[k].name == sp.Name && names[k].proto == sp.Proto; k++ {
		if t.revisions[k] == sp.Revision {
			return k, k + 1
		}
	}
	return -1, from
}

type compiler struct {
	t          *Table
	node       *Node
	maglevSize uint64
	arena      []Backend
	keys       []Key
	names      [][]byte
}

func (c *compiler) port(p *Port, sp *ServicePort) {
	*p = Port{
		Name:                sp.Name,
		Proto:               sp.Proto,
		Port:                sp.Port,
		NodePort:            sp.NodePort,
		HealthCheckNodePort: sp.HealthCheckNodePort,
		Scheduler:           sp.Scheduler,
		ExternalPolicyLocal: sp.ExternalPolicyLocal,
		InternalPolicyLocal: sp.InternalPolicyLocal,
		AffinityTimeout:     sp.AffinityTimeout,
		ID:                  portID(sp),
		Revision:            sp.Revision,
		settings:            c.t.settings,
	}
	if sp.AffinityTimeout > 0 {
		p.affinitySec = uint32(min(max(sp.AffinityTimeout/time.Second, 1), 1<<31))
	}
	// A service has the families of its cluster IPs (kube-proxy runs one
	// proxy per family and gives each only the services of its family);
	// a port without cluster IPs, as a static file may describe, gets both.
	for _, a := range sp.ClusterIPs {
		p.families[familyOf(a)] = true
	}
	if len(sp.ClusterIPs) == 0 {
		p.families = [2]bool{true, true}
	}
	for fam := range 2 {
		if p.families[fam] {
			c.categorize(p, sp, fam)
		}
	}
	start := len(c.keys)
	for _, ep := range sp.Endpoints {
		if ep.Addr.IsZero() {
			continue
		}
		if ep.Ready && c.isLocal(&ep) {
			p.LocalReady++
		}
		c.keys = append(c.keys, Key{Addr: ep.Addr, Port: ep.Port, Proto: sp.Proto})
	}
	p.endpointKeys = c.keys[start:len(c.keys):len(c.keys)]

	// loadBalancerSourceRanges apply per family, as in kube-proxy: a family
	// with no range of its own is not restricted. A range holding a node
	// address also admits the LB IPs as sources, since traffic from the
	// node to a VIP bound locally comes back with the VIP as source.
	if len(sp.SourceRanges) > 0 {
		p.lbIPs = slices.Clone(sp.LoadBalancerIPs)
	}
	for _, r := range sp.SourceRanges {
		pf, ok := prefixFrom(r)
		if !ok {
			continue
		}
		fam := IPv6
		if r.Addr().Is4() {
			fam = IPv4
		}
		p.sourceRanges[fam] = append(p.sourceRanges[fam], pf)
		for i := range c.node.Addresses {
			if pf.contains(&c.node.Addresses[i]) {
				p.allowFromNode[fam] = true
			}
		}
	}
}

// portID names a port across table swaps for session affinity.
func portID(sp *ServicePort) uint64 {
	var d xxhash.Digest
	d.Reset()
	d.WriteString(sp.Name.Namespace)
	d.Write([]byte{'/'})
	d.WriteString(sp.Name.Name)
	d.Write([]byte{':'})
	d.WriteString(sp.Name.Port)
	d.Write([]byte{0, byte(sp.Proto)})
	if id := d.Sum64(); id != 0 {
		return id
	}
	return 1
}

func (c *compiler) isLocal(ep *Endpoint) bool {
	return c.node.Name != "" && ep.NodeName == c.node.Name
}

// categorize fills the cluster and local sets of one family the way
// kube-proxy's CategorizeEndpoints does.
func (c *compiler) categorize(p *Port, sp *ServicePort, fam int) {
	externallyAccessible := sp.NodePort != 0 || len(sp.ExternalIPs) > 0 || len(sp.LoadBalancerIPs) > 0
	usesCluster := !sp.InternalPolicyLocal || externallyAccessible
	usesLocal := sp.InternalPolicyLocal || (sp.ExternalPolicyLocal && externallyAccessible)

	eps := sp.Endpoints
	inFamily := func(ep *Endpoint) bool { return !ep.Addr.IsZero() && familyOf(ep.Addr) == fam }
	servingTerminating := func(ep *Endpoint) bool { return ep.Serving && ep.Terminating }

	for i := range eps {
		if inFamily(&eps[i]) && (eps[i].Ready || servingTerminating(&eps[i])) {
			p.HasEndpoints[fam] = true
			break
		}
	}
	if !p.HasEndpoints[fam] {
		return
	}

	if usesCluster {
		byZone := sp.TopologyAware && c.zoneHintsApply(eps, fam)
		set := c.collect(eps, false, func(ep *Endpoint) bool {
			return inFamily(ep) && ep.Ready && (!byZone || slices.Contains(ep.ZoneHints, c.node.Zone))
		})
		if len(set) == 0 {
			// No endpoint is ready anywhere (topology is only applied
			// when one is ready in this zone), so fall back.
			set = c.collect(eps, true, func(ep *Endpoint) bool {
				return inFamily(ep) && servingTerminating(ep)
			})
		}
		c.finish(p, &p.Cluster[fam], set)
	}
	if usesLocal {
		set := c.collect(eps, false, func(ep *Endpoint) bool {
			return inFamily(ep) && ep.Ready && c.isLocal(ep)
		})
		if len(set) == 0 {
			set = c.collect(eps, true, func(ep *Endpoint) bool {
				return inFamily(ep) && servingTerminating(ep) && c.isLocal(ep)
			})
		}
		c.finish(p, &p.Local[fam], set)
	}
}

// zoneHintsApply is kube-proxy's PreferSameZone test: every ready endpoint
// of the family carries zone hints and at least one is hinted for this
// node's zone.
func (c *compiler) zoneHintsApply(eps []Endpoint, fam int) bool {
	if c.node.Zone == "" {
		return false
	}
	ready, forZone := false, false
	for i := range eps {
		ep := &eps[i]
		if familyOf(ep.Addr) != fam || !ep.Ready {
			continue
		}
		ready = true
		if len(ep.ZoneHints) == 0 {
			return false
		}
		if slices.Contains(ep.ZoneHints, c.node.Zone) {
			forZone = true
		}
	}
	return ready && forZone
}

// collect appends the endpoints that keep passes to the arena and returns
// them, sorted and without duplicates.
func (c *compiler) collect(eps []Endpoint, terminating bool, keep func(*Endpoint) bool) []Backend {
	start := len(c.arena)
	for i := range eps {
		ep := &eps[i]
		if keep(ep) {
			c.arena = append(c.arena, Backend{Addr: ep.Addr, Port: ep.Port, Local: c.isLocal(ep), Terminating: terminating})
		}
	}
	set := c.arena[start:len(c.arena):len(c.arena)]
	slices.SortFunc(set, func(a, b Backend) int { return compareBackend(&a, b.Addr, b.Port) })
	set = slices.CompactFunc(set, func(a, b Backend) bool { return a.Addr == b.Addr && a.Port == b.Port })
	c.arena = c.arena[:start+len(set)]
	return set
}

func (c *compiler) finish(p *Port, s *BackendSet, set []Backend) {
	s.Backends = set
	if p.Scheduler != Maglev || len(set) < 2 {
		return
	}
	// Names are the backend's address and port, so a backend keeps its
	// permutation across rebuilds whatever else changes.
	if cap(c.names) < len(set) {
		c.names = make([][]byte, len(set))
	}
	names := c.names[:len(set)]
	buf := make([]byte, 18*len(set))
	for i := range set {
		b := buf[18*i : 18*i+18]
		copy(b, set[i].Addr[:])
		b[16], b[17] = byte(set[i].Port>>8), byte(set[i].Port)
		names[i] = b
	}
	mt, err := maglev.New(names, maglev.Options{Size: c.maglevSize})
	if err != nil {
		// Too many backends for the table: fall back to random choice.
		p.problems = append(p.problems, fmt.Sprintf("%v: Maglev: %v; choosing at random", p.Name, err))
		return
	}
	s.maglev = mt
}

// allFrontends lists and indexes the frontends of all ports.
func (c *compiler) allFrontends(m *Model, n int) {
	t := c.t
	// One allocation, cut into pages below.
	fs := make([]Frontend, 0, (n+frontendPageSize-1)/frontendPageSize*frontendPageSize)
	t.index = newKeyIndex(n)
	t.firstFrontend = make([]int32, len(t.ports)+1)
	for i, p := range t.ports {
		t.firstFrontend[i] = int32(len(fs))
		c.eachFrontend(p, &m.Ports[t.order[i]], func(kind Kind, k Key) {
			if !t.index.insert(k, len(fs)) {
				other := &fs[t.index.find(&k.Addr, k.Port, k.Proto)]
				t.problems = append(t.problems, fmt.Sprintf("%v %v %v:%d: already taken by %v %v; ignored",
					p.Name, kind, k.Addr, k.Port, other.Port.Name, other.Kind))
				t.conflicts = true
				return
			}
			fs = append(fs, Frontend{Key: k, Kind: kind, Port: p})
			fs[len(fs)-1].pickSets()
		})
	}
	t.firstFrontend[len(t.ports)] = int32(len(fs))
	t.nFrontends = len(fs)
	all := fs[:cap(fs)]
	for len(all) > 0 {
		t.pages = append(t.pages, (*frontendPage)(all[:frontendPageSize]))
		all = all[frontendPageSize:]
	}

	t.frontendKeys = make([]Key, len(fs))
	vips := make([]packet.Addr, 0, len(fs))
	for i := range fs {
		f := &fs[i]
		t.frontendKeys[i] = f.Key
		if f.Kind != NodePort {
			vips = append(vips, f.Key.Addr)
		}
	}
	slices.SortFunc(vips, func(a, b packet.Addr) int { return compareAddr(&a, &b) })
	t.vips = slices.Compact(vips)
}

// reuseFrontends keeps prev's frontend index and key lists when they still
// hold, the rule when only endpoints changed: the ports are prev's, at the
// same places, and each port compiled afresh has exactly the frontends it
// had in prev. prev must have had no conflicting frontends, so that each
// port owns all the frontends it lists (then nothing can win or lose a
// key). The pages holding new ports' frontends are copied, with their
// round-robin positions, and the rest shared. It reports false, having
// done nothing, when the frontends must be built anew.
func (c *compiler) reuseFrontends(prev *Table, m *Model, from, compiled []int32) bool {
	t := c.t
	if prev.conflicts || len(prev.ports) != len(t.ports) {
		return false
	}
	for i, k := range from {
		if k >= 0 && int(k) != i {
			return false
		}
	}
	for _, i := range compiled {
		first, end := int(prev.firstFrontend[i]), int(prev.firstFrontend[i+1])
		n, same := first, true
		c.eachFrontend(t.ports[i], &m.Ports[t.order[i]], func(kind Kind, k Key) {
			same = same && n < end && prev.frontend(n).Key == k && prev.frontend(n).Kind == kind
			n++
		})
		if !same || n != end {
			return false
		}
	}
	t.pages = slices.Clone(prev.pages)
	for _, i := range compiled {
		for j := int(prev.firstFrontend[i]); j < int(prev.firstFrontend[i+1]); j++ {
			pg := j / frontendPageSize
			if t.pages[pg] == prev.pages[pg] {
				t.pages[pg] = prev.pages[pg].clone()
			}
			f := t.frontend(j)
			f.Port = t.ports[i]
			f.pickSets()
		}
	}
	t.index, t.firstFrontend, t.nFrontends = prev.index, prev.firstFrontend, prev.nFrontends
	t.frontendKeys, t.vips = prev.frontendKeys, prev.vips
	return true
}

// frontendPageSize frontends make a page. Tables share the pages whose
// frontends did not change; a page is 16 KiB.
const frontendPageSize = 256

type frontendPage [frontendPageSize]Frontend

// clone copies the page, reading round-robin positions atomically as
// workers may be advancing them.
func (pg *frontendPage) clone() *frontendPage {
	np := new(frontendPage)
	for i := range pg {
		f, pf := &np[i], &pg[i]
		f.Key, f.Kind, f.Port = pf.Key, pf.Kind, pf.Port
		f.verdict, f.backends, f.shortCircuit = pf.verdict, pf.backends, pf.shortCircuit
		f.rr.Store(pf.rr.Load())
	}
	return np
}

// eachFrontend calls fn with every frontend p asks for, in order.
func (c *compiler) eachFrontend(p *Port, sp *ServicePort, fn func(Kind, Key)) {
	try := func(kind Kind, addr packet.Addr, port uint16) {
		if !addr.IsZero() && p.families[familyOf(addr)] {
			fn(kind, Key{Addr: addr, Port: port, Proto: p.Proto})
		}
	}
	for _, a := range sp.ClusterIPs {
		try(ClusterIP, a, sp.Port)
	}
	if sp.NodePort != 0 {
		for _, a := range c.node.Addresses {
			try(NodePort, a, sp.NodePort)
		}
	}
	for _, a := range sp.ExternalIPs {
		try(ExternalIP, a, sp.Port)
	}
	for _, a := range sp.LoadBalancerIPs {
		try(LoadBalancer, a, sp.Port)
	}
}

var emptySet BackendSet

// pickSets sets the verdict and backend sets of f from its port.
func (f *Frontend) pickSets() {
	p, fam := f.Port, familyOf(f.Key.Addr)
	kind := f.Kind
	f.verdict = Forward
	cluster, local := &p.Cluster[fam], &p.Local[fam]
	switch {
	case !p.HasEndpoints[fam]:
		f.verdict, f.backends, f.shortCircuit = Reject, &emptySet, &emptySet
		return
	case kind == ClusterIP && p.InternalPolicyLocal:
		// No short circuit for cluster IPs: local is all there is.
		f.backends, f.shortCircuit = local, local
	case kind == ClusterIP || !p.ExternalPolicyLocal:
		f.backends, f.shortCircuit = cluster, cluster
	default:
		// External traffic policy Local. Pods and the node itself reach
		// the service as if through an external load balancer, which may
		// pick any node, so they use the cluster list (kube-proxy's
		// "short-circuit" rules).
		f.backends, f.shortCircuit = local, cluster
	}
	if f.backends.Len() == 0 {
		f.verdict = Drop
	}
}

func compareAddr(a, b *packet.Addr) int {
	return cmp.Or(
		cmp.Compare(binary.BigEndian.Uint64(a[:8]), binary.BigEndian.Uint64(b[:8])),
		cmp.Compare(binary.BigEndian.Uint64(a[8:]), binary.BigEndian.Uint64(b[8:])),
	)
}

func compareBackend(b *Backend, addr packet.Addr, port uint16) int {
	if c := compareAddr(&b.Addr, &addr); c != 0 {
		return c
	}
	return cmp.Compare(b.Port, port)
}
