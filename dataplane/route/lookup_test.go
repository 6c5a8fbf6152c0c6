package route

import (
	"net"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/xdproxy/xdproxy/nat/packet"
	"golang.org/x/sys/unix"
)

// These tests compile snapshots from a hand-made kernel state, so they
// need no privileges; cache_test.go runs the same code against a kernel.

var (
	macN0    = [6]byte{2, 0, 0, 0, 0, 0x10}
	macN1    = [6]byte{2, 0, 0, 0, 0, 0x11}
	macGW    = [6]byte{2, 0, 0, 0, 0, 0xfe}
	macOld   = [6]byte{2, 0, 0, 0, 0, 0x07}
	macGW6   = [6]byte{2, 0, 0, 0, 0, 0x66}
	macNeigh = [6]byte{2, 0, 0, 0, 0, 0x15}
)

func cidr(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}

func v4route(dst string, ifindex int, gw string) netlink.Route {
	r := netlink.Route{Family: netlink.FAMILY_V4, Dst: cidr(dst), LinkIndex: ifindex, Type: unix.RTN_UNICAST, Table: unix.RT_TABLE_MAIN}
	if gw != "" {
		r.Gw = net.ParseIP(gw).To4()
	}
	return r
}

func v6route(dst string, ifindex int, gw string) netlink.Route {
	r := netlink.Route{Family: netlink.FAMILY_V6, Dst: cidr(dst), LinkIndex: ifindex, Type: unix.RTN_UNICAST, Table: unix.RT_TABLE_MAIN}
	if gw != "" {
		r.Gw = net.ParseIP(gw)
	}
	return r
}

func typed(r netlink.Route, typ int) netlink.Route {
	r.Type, r.LinkIndex = typ, 0
	return r
}

func metric(r netlink.Route, prio int) netlink.Route {
	r.Priority = prio
	return r
}

func nk(addr string, ifindex int32) neighKey {
	return neighKey{addr: packet.MustParseAddr(addr), ifindex: ifindex}
}

// testState: n0 (2) and n1 (3) managed and up, eth9 (4) not managed,
// n2 (5) managed but down.
func testState() state {
	mp := v4route("198.18.4.0/24", 0, "")
	mp.MultiPath = []*netlink.NexthopInfo{
		{LinkIndex: 5, Gw: net.ParseIP("198.18.2.7").To4()},
		{LinkIndex: 3, Gw: net.ParseIP("198.18.1.7").To4(), Flags: unix.RTNH_F_DEAD},
		{LinkIndex: 3, Gw: net.ParseIP("198.18.1.8").To4()},
	}
	return state{
		links: map[int]linkInfo{
			1: {name: "lo", up: true},
			2: {name: "n0", mac: macN0, up: true, managed: true},
			3: {name: "n1", mac: macN1, up: true, managed: true},
			4: {name: "eth9", mac: [6]byte{2, 9}, up: true},
			5: {name: "n2", mac: [6]byte{2, 5}, managed: true},
		},
		routes: []netlink.Route{
			v4route("198.18.0.0/24", 2, ""),
			v4route("198.18.1.0/24", 3, ""),
			v4route("0.0.0.0/0", 3, "198.18.1.254"),
			v4route("10.0.0.0/8", 4, ""),
			v4route("10.1.0.0/16", 2, "198.18.0.9"),
			typed(v4route("192.0.2.0/24", 0, ""), unix.RTN_BLACKHOLE),
			typed(v4route("203.0.113.0/24", 0, ""), unix.RTN_UNREACHABLE),
			typed(v4route("198.18.5.0/24", 0, ""), unix.RTN_THROW),
			typed(v4route("198.18.6.1/32", 3, ""), unix.RTN_LOCAL),
			v4route("198.18.2.0/24", 5, ""), // link down: ignored
			metric(v4route("198.18.3.0/24", 2, "198.18.0.5"), 100),
			metric(v4route("198.18.3.0/24", 3, "198.18.1.254"), 50),
			metric(v4route("198.18.3.0/24", 2, "198.18.0.6"), 200),
			mp,
			v4route("198.18.1.77/32", 2, ""),
			v6route("2001:db8:18::/64", 2, ""),
			v6route("::/0", 3, "fe80::1"),
		},
		neighs: map[neighKey]neighInfo{
			nk("198.18.1.254", 3): {mac: macGW, hasMAC: true, state: netlink.NUD_REACHABLE},
			nk("198.18.1.8", 3):   {mac: macNeigh, hasMAC: true, state: netlink.NUD_DELAY},
			nk("198.18.0.7", 2):   {mac: macOld, hasMAC: true, state: netlink.NUD_STALE},
			nk("198.18.0.8", 2):   {state: netlink.NUD_INCOMPLETE},
			nk("198.18.0.9", 2):   {mac: macOld, hasMAC: true, state: netlink.NUD_FAILED},
			nk("fe80::1", 3):      {mac: macGW6, hasMAC: true, state: netlink.NUD_PERMANENT},
			// The same address on another interface must not be confused.
			nk("198.18.1.20", 2): {mac: macOld, hasMAC: true, state: netlink.NUD_REACHABLE},
		},
	}
}

// testCache is a Cache without goroutines or netlink: only its snapshot.
func testCache(st state) *Cache {
	c := &Cache{resolveCh: make(chan neighKey, resolveQueue), st: st}
	c.publish()
	return c
}

func TestLookup(t *testing.T) {
	tests := []struct {
		name    string
		dst     string
		status  Status
		ifindex int32
		nexthop string
		srcMAC  [6]byte
		dstMAC  [6]byte
		asks    int // resolutions asked by this lookup
	}{
		{"gateway via default route", "8.8.8.8", Found, 3, "198.18.1.254", macN1, macGW, 0},
		{"connected, neighbour unknown", "198.18.1.30", NeedsResolution, 3, "198.18.1.30", macN1, [6]byte{}, 1},
		{"same address known only on another link", "198.18.1.20", NeedsResolution, 3, "198.18.1.20", macN1, [6]byte{}, 1},
		{"connected, stale neighbour is used and refreshed", "198.18.0.7", Found, 2, "198.18.0.7", macN0, macOld, 1},
		{"connected, incomplete neighbour", "198.18.0.8", NeedsResolution, 2, "198.18.0.8", macN0, [6]byte{}, 1},
		{"more specific managed route inside an unmanaged one, failed gateway", "10.1.2.3", NeedsResolution, 2, "198.18.0.9", macN0, [6]byte{}, 1},
		{"unmanaged interface", "10.2.0.1", NotManaged, 4, "", [6]byte{}, [6]byte{}, 0},
		{"blackhole", "192.0.2.1", Unreachable, 0, "", [6]byte{}, [6]byte{}, 0},
		{"unreachable", "203.0.113.9", Unreachable, 0, "", [6]byte{}, [6]byte{}, 0},
		{"throw", "198.18.5.1", NoRoute, 0, "", [6]byte{}, [6]byte{}, 0},
		{"local route belongs to the kernel", "198.18.6.1", NotManaged, 0, "", [6]byte{}, [6]byte{}, 0},
		{"route on a down link falls back to the default", "198.18.2.9", Found, 3, "198.18.1.254", macN1, macGW, 0},
		{"lowest metric wins", "198.18.3.3", Found, 3, "198.18.1.254", macN1, macGW, 0},
		{"multipath skips down and dead next hops", "198.18.4.4", Found, 3, "198.18.1.8", macN1, macNeigh, 0},
		{"host route beats its subnet", "198.18.1.77", NeedsResolution, 2, "198.18.1.77", macN0, [6]byte{}, 1},
		{"IPv6 connected", "2001:db8:18::5", NeedsResolution, 2, "2001:db8:18::5", macN0, [6]byte{}, 1},
		{"IPv6 default via link-local gateway", "2001:db8:99::1", Found, 3, "fe80::1", macN1, macGW6, 0},
	}
	c := testCache(testState())
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := len(c.resolveCh)
			hop, status := c.Lookup(packet.MustParseAddr(tt.dst))
			if status != tt.status {
				t.Fatalf("status %v, want %v (hop %+v)", status, tt.status, hop)
			}
			if hop.IfIndex != tt.ifindex || hop.SrcMAC != tt.srcMAC || hop.DstMAC != tt.dstMAC {
				t.Errorf("hop %+v, want ifindex %d src %x dst %x", hop, tt.ifindex, tt.srcMAC, tt.dstMAC)
			}
			if tt.nexthop != "" && hop.NextHop != packet.MustParseAddr(tt.nexthop) {
				t.Errorf("next hop %v, want %v", hop.NextHop, tt.nexthop)
			}
			if got := len(c.resolveCh) - before; got != tt.asks {
				t.Errorf("asked for %d resolutions, want %d", got, tt.asks)
			}
			// Asking again with the same snapshot must not ask again.
			c.Lookup(packet.MustParseAddr(tt.dst))
			if got := len(c.resolveCh) - before; got != tt.asks {
				t.Errorf("second lookup asked again: %d asks, want %d", got, tt.asks)
			}
		})
	}
}

func TestLookupFamiliesStayApart(t *testing.T) {
	// Only an IPv6 default route: IPv4 destinations must not match it,
	// although they are stored IPv4-mapped.
	c := testCache(state{
		links:  map[int]linkInfo{3: {name: "n1", mac: macN1, up: true, managed: true}},
		routes: []netlink.Route{v6route("::/0", 3, "fe80::1")},
		neighs: map[neighKey]neighInfo{},
	})
	if _, s := c.Lookup(packet.MustParseAddr("8.8.8.8")); s != NoRoute {
		t.Errorf("IPv4 destination with only an IPv6 default: %v, want no-route", s)
	}
	if _, s := c.Lookup(packet.MustParseAddr("2001:db8::1")); s != NeedsResolution {
		t.Errorf("IPv6 destination: %v, want needs-resolution", s)
	}
}

func TestNewSnapshotAsksAgain(t *testing.T) {
	c := testCache(testState())
	dst := packet.MustParseAddr("198.18.1.30")
	c.Lookup(dst)
	c.Lookup(dst)
	if n := len(c.resolveCh); n != 1 {
		t.Fatalf("%d asks from one snapshot, want 1", n)
	}
	c.publish()
	c.Lookup(dst)
	if n := len(c.resolveCh); n != 2 {
		t.Fatalf("%d asks after a new snapshot, want 2", n)
	}
	if got := <-c.resolveCh; got != nk("198.18.1.30", 3) {
		t.Errorf("asked for %+v", got)
	}
}

func TestAskNeverBlocks(t *testing.T) {
	c := testCache(testState())
	for i := range resolveQueue + 10 {
		c.Lookup(packet.AddrFrom4([4]byte{198, 18, 1, byte(i)}))
		if i%64 == 63 {
			c.publish() // new pending table, so every address asks again
		}
	}
	st := c.Stats()
	if st.ResolveRequests != resolveQueue || st.ResolveDropped == 0 {
		t.Errorf("requests %d (want %d), dropped %d (want > 0)", st.ResolveRequests, resolveQueue, st.ResolveDropped)
	}
}

func TestLookupAllocs(t *testing.T) {
	c := testCache(testState())
	for _, dst := range []string{"8.8.8.8", "198.18.1.30", "198.18.0.7", "192.0.2.1", "2001:db8:99::1", "10.2.0.1"} {
		a := packet.MustParseAddr(dst)
		if n := testing.AllocsPerRun(1000, func() { c.Lookup(a) }); n != 0 {
			t.Errorf("Lookup(%s) allocates %.1f times", dst, n)
		}
	}
}

func BenchmarkLookup(b *testing.B) {
	c := testCache(testState())
	for _, bc := range []struct{ name, dst string }{
		{"default-gateway", "8.8.8.8"},
		{"connected", "198.18.1.77"},
		{"ipv6", "2001:db8:99::1"},
	} {
		a := packet.MustParseAddr(bc.dst)
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				c.Lookup(a)
			}
		})
	}
	b.Run("parallel", func(b *testing.B) {
		a := packet.MustParseAddr("8.8.8.8")
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				c.Lookup(a)
			}
		})
	})
}
