package route

import (
	"encoding/binary"
	"net"
	"sort"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"github.com/xdproxy/xdproxy/nat/packet"
	"golang.org/x/sys/unix"
)

// Status says what Lookup found.
type Status uint8

const (
	// Found: Hop is complete; send the frame out of Hop.IfIndex.
	Found Status = iota
	// NoRoute: the main table has no route for the destination.
	NoRoute
	// NotManaged: the best route leaves through an interface outside
	// Options.Interfaces, or is of a kind the kernel must handle (local,
	// broadcast, ...). Hand the packet to the kernel.
	NotManaged
	// Unreachable: a blackhole, unreachable or prohibit route matched.
	Unreachable
	// NeedsResolution: the route is known (Hop has the interface, its MAC
	// and the next hop address) but the next hop's MAC is not; resolution
	// has been asked for.
	NeedsResolution
)

func (s Status) String() string {
	switch s {
	case Found:
		return "found"
	case NoRoute:
		return "no-route"
	case NotManaged:
		return "not-managed"
	case Unreachable:
		return "unreachable"
	case NeedsResolution:
		return "needs-resolution"
	}
	return "status-?"
}

// Hop is where a packet goes next.
type Hop struct {
	IfIndex int32
	SrcMAC  [6]byte     // MAC of the egress interface
	DstMAC  [6]byte     // MAC of the next hop; zero unless Found
	NextHop packet.Addr // the gateway, or the destination on a connected route
}

type routeKind uint8

const (
	kindForward routeKind = iota
	kindNotManaged
	kindUnreachable
	kindNoRoute // a "throw" route: the lookup ends here without a route
)

type routeEntry struct {
	ifindex  int32
	kind     routeKind
	onLink   bool // no gateway: the destination is its own next hop
	srcMAC   [6]byte
	gw       packet.Addr
	priority uint32
}

// prefixLen holds the routes of one prefix length, keyed by the masked
// address (as two native-order words, so masking is two ANDs).
type prefixLen struct {
	m0, m1 uint64
	bits   int
	routes fixedTable[routeEntry]
}

// prefixTable is a longest-prefix match over the few prefix lengths a node
// has: one hash lookup per length present, longest first.
type prefixTable struct {
	lens []prefixLen
}

func words(a *packet.Addr) (uint64, uint64) {
	return binary.NativeEndian.Uint64(a[:8]), binary.NativeEndian.Uint64(a[8:])
}

func maskWords(bits int) (uint64, uint64) {
	var m packet.Addr
	for i := 0; i < bits; i++ {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return words(&m)
}

func (t *prefixTable) match(a *packet.Addr) (*routeEntry, bool) {
	a0, a1 := words(a)
	for i := range t.lens {
		l := &t.lens[i]
		if r := l.routes.get(wordKey{w0: a0 & l.m0, w1: a1 & l.m1}); r != nil {
			return r, true
		}
	}
	return nil, false
}

// prefixBuilder collects routes per prefix length and keeps, per prefix,
// the one with the lowest priority (metric), as the kernel does.
type prefixBuilder map[int]map[wordKey]routeEntry

func (b prefixBuilder) insert(addr packet.Addr, bits int, r routeEntry) {
	byPrefix := b[bits]
	if byPrefix == nil {
		byPrefix = map[wordKey]routeEntry{}
		b[bits] = byPrefix
	}
	m0, m1 := maskWords(bits)
	a0, a1 := words(&addr)
	k := wordKey{w0: a0 & m0, w1: a1 & m1}
	if old, ok := byPrefix[k]; ok && old.priority <= r.priority {
		return
	}
	byPrefix[k] = r
}

func (b prefixBuilder) build() prefixTable {
	var t prefixTable
	for bits, byPrefix := range b {
		m0, m1 := maskWords(bits)
		l := prefixLen{m0: m0, m1: m1, bits: bits, routes: newFixedTable[routeEntry](len(byPrefix))}
		for k, r := range byPrefix {
			l.routes.put(k, r)
		}
		t.lens = append(t.lens, l)
	}
	sort.Slice(t.lens, func(i, j int) bool { return t.lens[i].bits > t.lens[j].bits })
	return t
}

type neighKey struct {
	addr    packet.Addr
	ifindex int32
}

func (k *neighKey) wordKey() wordKey {
	a0, a1 := words(&k.addr)
	return wordKey{w0: a0, w1: a1, aux: uint32(k.ifindex)}
}

type neighEntry struct {
	mac    [6]byte
	usable bool // has a MAC the kernel would use (REACHABLE, STALE, DELAY, PROBE, PERMANENT, NOARP)
	stale  bool // usable, but the kernel should re-confirm it
	// asked is set once Lookup has asked for resolution of this entry, so
	// each snapshot asks at most once per neighbour.
	asked atomic.Uint32
}

// pendingSlots remembers, per snapshot, next hops that have no neighbour
// entry at all and were already asked for, so an unresolved destination
// does not push into the resolver channel on every packet.
const pendingSlots = 64

type snapshot struct {
	gen     uint64
	v4, v6  prefixTable
	neigh   fixedTable[int32] // neighKey.wordKey() -> index into neighs
	neighs  []neighEntry
	pending [pendingSlots]atomic.Uint64
}

// linkInfo is what the Cache keeps about one interface.
type linkInfo struct {
	name    string
	mac     [6]byte
	up      bool
	managed bool
}

// neighInfo is one kernel neighbour entry.
type neighInfo struct {
	mac    [6]byte
	hasMAC bool
	state  int
}

// state is the updater's view of the kernel, from which snapshots compile.
type state struct {
	links  map[int]linkInfo
	routes []netlink.Route
	neighs map[neighKey]neighInfo
}

const nudUsable = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY |
	netlink.NUD_PROBE | netlink.NUD_PERMANENT | netlink.NUD_NOARP

// addrFromIP converts a 4- or 16-byte net.IP; ok is false for anything else.
func addrFromIP(ip net.IP) (packet.Addr, bool) {
	if v4 := ip.To4(); v4 != nil {
		return packet.AddrFromSlice4(v4), true
	}
	if len(ip) == net.IPv6len {
		return packet.Addr(ip), true
	}
	return packet.Addr{}, false
}

// nexthop picks the interface and gateway of r: the route's own, or the
// first multipath next hop whose link is up and not dead.
func nexthop(r *netlink.Route, links map[int]linkInfo) (ifindex int, gw net.IP, ok bool) {
	usable := func(ifindex, flags int) bool {
		return links[ifindex].up && flags&(unix.RTNH_F_DEAD|unix.RTNH_F_LINKDOWN) == 0
	}
	if len(r.MultiPath) == 0 {
		return r.LinkIndex, r.Gw, usable(r.LinkIndex, r.Flags)
	}
	for _, nh := range r.MultiPath {
		if usable(nh.LinkIndex, nh.Flags) {
			return nh.LinkIndex, nh.Gw, true
		}
	}
	return 0, nil, false
}

// compile builds an immutable snapshot of st.
func compile(st *state, gen uint64) *snapshot {
	s := &snapshot{gen: gen, neigh: newFixedTable[int32](len(st.neighs))}
	v4, v6 := prefixBuilder{}, prefixBuilder{}
	for i := range st.routes {
		r := &st.routes[i]
		if r.Dst == nil {
			continue
		}
		dst, ok := addrFromIP(r.Dst.IP)
		if !ok {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		table := v6
		if r.Family == netlink.FAMILY_V4 {
			if !dst.Is4() {
				continue
			}
			table, ones = v4, ones+96
		} else if r.Family != netlink.FAMILY_V6 {
			continue
		}
		e := routeEntry{priority: uint32(r.Priority)}
		switch r.Type {
		case unix.RTN_UNICAST:
			ifindex, gw, ok := nexthop(r, st.links)
			if !ok {
				continue // the kernel would not use it either
			}
			link := st.links[ifindex]
			e.ifindex, e.srcMAC = int32(ifindex), link.mac
			switch {
			case r.Via != nil || !link.managed:
				e.kind = kindNotManaged
			case gw == nil || gw.IsUnspecified():
				e.onLink = true
			default:
				if e.gw, ok = addrFromIP(gw); !ok {
					e.kind = kindNotManaged
				}
			}
		case unix.RTN_BLACKHOLE, unix.RTN_UNREACHABLE, unix.RTN_PROHIBIT:
			e.kind = kindUnreachable
		case unix.RTN_THROW:
			e.kind = kindNoRoute
		default:
			e.kind = kindNotManaged
		}
		table.insert(dst, ones, e)
	}
	s.v4, s.v6 = v4.build(), v6.build()
	s.neighs = make([]neighEntry, len(st.neighs))
	i := int32(0)
	for k, n := range st.neighs {
		s.neigh.put(k.wordKey(), i)
		e := &s.neighs[i]
		e.mac = n.mac
		e.usable = n.hasMAC && n.state&nudUsable != 0
		e.stale = e.usable && n.state == netlink.NUD_STALE
		i++
	}
	return s
}
