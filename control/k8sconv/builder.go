package k8sconv

import (
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/dataplane/packet"
	"github.com/xdproxy/xdproxy/dataplane/service"
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
	services map[types.NamespacedName]*Service
	slices   map[types.NamespacedName]map[string]*Slice
	owner    map[SliceKey]types.NamespacedName // slice -> the service it was filed under

	built map[types.NamespacedName][]service.ServicePort
	order []types.NamespacedName // keys of services, sorted
	total int                    // ServicePorts across built
	dirty map[types.NamespacedName]struct{}

	seen map[endpointKey]int // scratch for de-duplication
}

type endpointKey struct {
	addr packet.Addr
	port uint16
}

// NewBuilder returns an empty Builder.
func NewBuilder() *Builder {
	return &Builder{
		services: make(map[types.NamespacedName]*Service),
		slices:   make(map[types.NamespacedName]map[string]*Slice),
		owner:    make(map[SliceKey]types.NamespacedName),
		built:    make(map[types.NamespacedName][]service.ServicePort),
		dirty:    make(map[types.NamespacedName]struct{}),
		seen:     make(map[endpointKey]int),
	}
}

// SetService records svc under key; a nil svc removes the service (deleted,
// or not programmed).
func (b *Builder) SetService(key types.NamespacedName, svc *Service) {
	_, had := b.services[key]
	i, found := slices.BinarySearchFunc(b.order, key, compareKey)
	switch {
	case svc == nil && had:
		delete(b.services, key)
		if found {
			b.order = slices.Delete(b.order, i, i+1)
		}
	case svc != nil:
		b.services[key] = svc
		if !found {
			b.order = slices.Insert(b.order, i, key)
		}
	default:
		return
	}
	b.dirty[key] = struct{}{}
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
func (b *Builder) Services() int { return len(b.services) }

// Model rebuilds the services that changed and returns a new Model for
// node. The Model shares unchanged ServicePorts with earlier Models; none
// of them is modified again.
func (b *Builder) Model(node service.Node) *service.Model {
	for key := range b.dirty {
		b.total -= len(b.built[key])
		if svc := b.services[key]; svc != nil {
			ports := b.build(svc)
			b.built[key] = ports
			b.total += len(ports)
		} else {
			delete(b.built, key)
		}
	}
	clear(b.dirty)

	ports := make([]service.ServicePort, 0, b.total)
	for _, key := range b.order {
		ports = append(ports, b.built[key]...)
	}
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
