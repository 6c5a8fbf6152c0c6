package k8sconv

import (
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// SliceKey names an EndpointSlice object.
type SliceKey struct {
	Namespace, Name string
}

// Builder holds the current converted Services and Slices and builds the
// Model from them. It caches the ServicePorts of each service and rebuilds
// only the services whose Service or Slices changed since the last Model,
// so one changed EndpointSlice costs one service, not the whole cluster.
//
// A Builder is not safe for concurrent use; one goroutine (the sync loop)
// owns it.
type Builder struct {
	// entries holds one entry per service, sorted by key. Between Models
	// it may hold removed services (nil svc), and the added ones wait in
	// added: Model merges them in at once, as placing each on its own
	// moves O(N) entries and a first sync comes in random order.
	entries []entry
	added   map[types.NamespacedName]*Service
	removed int // entries with a nil svc
	slices  map[types.NamespacedName]map[string]*Slice
	owner   map[SliceKey]types.NamespacedName // slice -> the service it was filed under

	dirty map[types.NamespacedName]struct{}
	// last is the previous Model's Ports. While no service comes, goes or
	// changes its number of ports, the next Model is a copy of it with the
	// rebuilt services written over their old places.
	last          []service.ServicePort
	layoutChanged bool

	seen map[endpointKey]int // scratch for de-duplication
}

type entry struct {
	key    types.NamespacedName
	svc    *Service
	ports  []service.ServicePort
	offset int // of ports in last
}

type endpointKey struct {
	addr packet.Addr
	port uint16
}

// NewBuilder returns an empty Builder.
func NewBuilder() *Builder {
	return &Builder{
		added:  make(map[types.NamespacedName]*Service),
		slices: make(map[types.NamespacedName]map[string]*Slice),
		owner:  make(map[SliceKey]types.NamespacedName),
		dirty:  make(map[types.NamespacedName]struct{}),
		seen:   make(map[endpointKey]int),
	}
}

func (b *Builder) find(key types.NamespacedName) (int, bool) {
	return slices.BinarySearchFunc(b.entries, key, func(e entry, k types.NamespacedName) int { return compareKey(e.key, k) })
}

// SetService records svc under key; a nil svc removes the service (deleted,
// or not programmed).
func (b *Builder) SetService(key types.NamespacedName, svc *Service) {
	i, found := b.find(key)
	switch {
	case found && svc == nil:
		if b.entries[i].svc == nil {
			return
		}
		b.entries[i] = entry{key: key} // dropped by the next Model
		b.removed++
		b.layoutChanged = true
	case found:
		if b.entries[i].svc == nil {
			b.removed-- // back before the Model that would drop it
		}
		b.entries[i].svc = svc
	case svc == nil:
		if _, ok := b.added[key]; !ok {
			return
		}
		delete(b.added, key)
	default:
		b.added[key] = svc
		b.layoutChanged = true
	}
	b.dirty[key] = struct{}{}
}

// merge brings entries up to date: it sorts the added services and merges
// them in, and drops the removed ones. That is O(N + k log k) for k
// changes, once per Model.
func (b *Builder) merge() {
	if len(b.added) == 0 && b.removed == 0 {
		return
	}
	add := make([]entry, 0, len(b.added))
	for key, svc := range b.added {
		add = append(add, entry{key: key, svc: svc})
	}
	slices.SortFunc(add, func(x, y entry) int { return compareKey(x.key, y.key) })
	// A key is never in both: SetService finds it in entries first.
	merged := make([]entry, 0, len(b.entries)-b.removed+len(add))
	old := b.entries
	for len(old) > 0 || len(add) > 0 {
		if len(add) == 0 || len(old) > 0 && compareKey(old[0].key, add[0].key) < 0 {
			if old[0].svc != nil {
				merged = append(merged, old[0])
			}
			old = old[1:]
		} else {
			merged = append(merged, add[0])
			add = add[1:]
		}
	}
	b.entries = merged
	clear(b.added)
	b.removed = 0
}

// SetSlice records the EndpointSlice named key; a nil sl removes it.
func (b *Builder) SetSlice(key SliceKey, sl *Slice) {
	if prev, ok := b.owner[key]; ok {
		delete(b.slices[prev], key.Name)
		if len(b.slices[prev]) == 0 {
			delete(b.slices, prev)
		}
		delete(b.owner, key)
		b.dirty[prev] = struct{}{}
	}
	if sl == nil {
		return
	}
	byName := b.slices[sl.Service]
	if byName == nil {
		byName = make(map[string]*Slice)
		b.slices[sl.Service] = byName
	}
	byName[key.Name] = sl
	b.owner[key] = sl.Service
	b.dirty[sl.Service] = struct{}{}
}

// Services reports how many services the Builder holds.
func (b *Builder) Services() int { return len(b.entries) - b.removed + len(b.added) }

// Model rebuilds the services that changed and returns a new Model for
// node. The Model shares unchanged ServicePorts' contents with earlier
// Models; none of them is modified again. Each rebuilt ServicePort gets a
// new Revision and the others keep theirs, so service.CompileFrom can
// compile only what changed.
func (b *Builder) Model(node service.Node) *service.Model {
	b.merge()
	var rebuilt []int
	for key := range b.dirty {
		i, found := b.find(key)
		if !found {
			continue // removed; layoutChanged is set
		}
		e := &b.entries[i]
		ports := b.build(e.svc)
		if len(ports) != len(e.ports) {
			b.layoutChanged = true
		}
		e.ports = ports
		rebuilt = append(rebuilt, i)
	}
	clear(b.dirty)

	var ports []service.ServicePort
	if b.layoutChanged || b.last == nil {
		total := 0
		for i := range b.entries {
			total += len(b.entries[i].ports)
		}
		ports = make([]service.ServicePort, 0, total)
		for i := range b.entries {
			b.entries[i].offset = len(ports)
			ports = append(ports, b.entries[i].ports...)
		}
		b.layoutChanged = false
	} else {
		ports = slices.Clone(b.last)
		for _, i := range rebuilt {
			copy(ports[b.entries[i].offset:], b.entries[i].ports)
		}
	}
	b.last = ports
	return &service.Model{Node: node, Ports: ports}
}

// build joins svc's ports with the endpoints of all its slices.
func (b *Builder) build(svc *Service) []service.ServicePort {
	var sliceList []*Slice
	names := make([]string, 0, len(b.slices[svc.Key]))
	for name := range b.slices[svc.Key] {
		names = append(names, name)
	}
	// Slice order decides which duplicate entry wins; keep it stable.
	slices.Sort(names)
	for _, name := range names {
		sliceList = append(sliceList, b.slices[svc.Key][name])
	}

	out := make([]service.ServicePort, len(svc.Ports))
	for i := range svc.Ports {
		sp := svc.Ports[i]
		// A rebuilt port is a new version for service.CompileFrom, even
		// when it comes out the same; a port not rebuilt keeps its
		// revision, which lets CompileFrom reuse its compiled form.
		sp.Revision = service.NewRevision()
		sp.Endpoints = b.endpointsFor(sp.Name.Port, sp.Proto, sliceList)
		if !sp.TopologyAware {
			sp.TopologyAware = slices.ContainsFunc(sp.Endpoints, func(e service.Endpoint) bool { return len(e.ZoneHints) > 0 })
		}
		out[i] = sp
	}
	return out
}

func (b *Builder) endpointsFor(portName string, proto packet.Proto, sliceList []*Slice) []service.Endpoint {
	clear(b.seen)
	var eps []service.Endpoint
	for _, sl := range sliceList {
		for _, p := range sl.Ports {
			if p.Name != portName || p.Proto != proto {
				continue
			}
			for _, e := range sl.Endpoints {
				k := endpointKey{e.Addr, p.Port}
				if j, dup := b.seen[k]; dup {
					// An endpoint moving between slices shows up in both for
					// a moment, and a pod IP may be reused while the old pod
					// terminates: prefer the entry that is not terminating.
					if eps[j].Terminating && !e.Terminating {
						e.Port = p.Port
						eps[j] = e
					}
					continue
				}
				e.Port = p.Port
				b.seen[k] = len(eps)
				eps = append(eps, e)
			}
		}
	}
	slices.SortFunc(eps, func(x, y service.Endpoint) int {
		if c := compareAddr(x.Addr, y.Addr); c != 0 {
			return c
		}
		return int(x.Port) - int(y.Port)
	})
	return eps
}

func compareKey(a, b types.NamespacedName) int {
	if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
		return c
	}
	return strings.Compare(a.Name, b.Name)
}
