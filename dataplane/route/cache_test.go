package route_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/xdproxy/xdproxy/dataplane/route"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/nat/packet"
	"k8s.io/apimachinery/pkg/util/wait"
)

// newCache builds a testbed and a Cache in its node namespace that manages
// n0 and n1, plus extra interface names.
func newCache(t *testing.T, extra ...string) (*testbed.Testbed, *route.Cache, *errLog) {
	t.Helper()
	return newCacheWith(t, testbed.Options{Backends: 2}, extra...)
}

func newCacheWith(t *testing.T, opts testbed.Options, extra ...string) (*testbed.Testbed, *route.Cache, *errLog) {
	t.Helper()
	tb := testbed.NewForTest(t, opts)
	log := &errLog{}
	var c *route.Cache
	err := tb.Do(tb.NodeNS(), func() error {
		var err error
		c, err = route.New(route.Options{
			Interfaces: append([]string{testbed.NodeClientIface, testbed.NodeLANIface}, extra...),
			ErrorLog:   log.add,
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		if err := log.err(); err != nil {
			t.Errorf("background errors: %v", err)
		}
	})
	return tb, c, log
}

type errLog struct {
	mu   sync.Mutex
	errs []error
}

func (l *errLog) add(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

func (l *errLog) err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return errors.Join(l.errs...)
}

func mac6(hw net.HardwareAddr) [6]byte { return [6]byte(hw) }

// waitLookup polls until ok accepts a lookup of dst, and returns the last
// result either way.
func waitLookup(t *testing.T, c *route.Cache, dst string, timeout time.Duration, ok func(route.Hop, route.Status) bool) (route.Hop, route.Status) {
	t.Helper()
	a := packet.MustParseAddr(dst)
	var h route.Hop
	var s route.Status
	_ = wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		h, s = c.Lookup(a)
		return ok(h, s), nil
	})
	return h, s
}

func found(h route.Hop, s route.Status) bool { return s == route.Found }

func ipRoute(t *testing.T, tb *testbed.Testbed, args ...string) {
	t.Helper()
	if _, err := tb.Exec(tb.NodeNS(), append([]string{"ip"}, args...)...); err != nil {
		t.Fatal(err)
	}
}

func neighState(t *testing.T, tb *testbed.Testbed, addr string) string {
	t.Helper()
	out, err := tb.Exec(tb.NodeNS(), "ip", "neigh", "show", addr, "dev", testbed.NodeLANIface)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

func TestConnectedRouteResolves(t *testing.T) {
	tb, c, _ := newCache(t)
	b0, n1 := tb.Backend(0), tb.NodeLANSide()

	h, s := c.Lookup(packet.AddrFromNetip(b0.Addr))
	if s != route.NeedsResolution {
		t.Fatalf("first lookup of a never-contacted backend: %v, want needs-resolution", s)
	}
	if h.IfIndex != int32(n1.IfIndex) || h.SrcMAC != mac6(n1.MAC) || h.NextHop != packet.AddrFromNetip(b0.Addr) {
		t.Errorf("unresolved hop %+v, want n1 (%d, %s) towards %s", h, n1.IfIndex, n1.MAC, b0.Addr)
	}
	// Nothing else talks to the backend: only the Cache's request makes the
	// kernel ARP for it.
	h, s = waitLookup(t, c, b0.Addr.String(), 5*time.Second, found)
	if s != route.Found || h.DstMAC != mac6(b0.MAC) || h.SrcMAC != mac6(n1.MAC) || h.IfIndex != int32(n1.IfIndex) {
		t.Fatalf("after resolution: %v %+v, want found with backend MAC %s", s, h, b0.MAC)
	}
	if st := c.Stats(); st.ResolveRequests == 0 || st.Resolutions == 0 || st.ResolveErrors != 0 {
		t.Errorf("stats %+v: want requests and resolutions, no errors", st)
	}
	if a := testing.AllocsPerRun(1000, func() { c.Lookup(packet.AddrFromNetip(b0.Addr)) }); a != 0 {
		t.Errorf("Lookup on a live cache allocates %.1f times", a)
	}
}

func TestIPv6Resolves(t *testing.T) {
	tb, c, _ := newCacheWith(t, testbed.Options{Backends: 1, IPv6: true})
	b0, n1, client, n0 := tb.Backend(0), tb.NodeLANSide(), tb.Client(), tb.NodeClientSide()
	h, s := waitLookup(t, c, b0.Addr6.String(), 5*time.Second, found)
	if s != route.Found || h.DstMAC != mac6(b0.MAC) || h.IfIndex != int32(n1.IfIndex) {
		t.Fatalf("IPv6 backend: %v %+v, want found with %s on n1", s, h, b0.MAC)
	}
	// A gateway route through the client side, resolved by NDP.
	ipRoute(t, tb, "-6", "route", "add", testbed.ClusterIPRange6.String(), "via", client.Addr6.String(), "dev", testbed.NodeClientIface)
	h, s = waitLookup(t, c, "2001:db8:19::10", 5*time.Second, found)
	if s != route.Found || h.DstMAC != mac6(client.MAC) || h.SrcMAC != mac6(n0.MAC) || h.NextHop != packet.AddrFromNetip(client.Addr6) {
		t.Fatalf("IPv6 gateway route: %v %+v, want found via the client %s", s, h, client.MAC)
	}
}

func TestGatewayRouteAndChanges(t *testing.T) {
	tb, c, _ := newCache(t)
	b0, b1, client := tb.Backend(0), tb.Backend(1), tb.Client()
	n0, n1 := tb.NodeClientSide(), tb.NodeLANSide()
	svc := "198.19.0.5"

	if _, s := c.Lookup(packet.MustParseAddr(svc)); s != route.NoRoute {
		t.Fatalf("ClusterIP before any route: %v, want no-route (the node has no default route)", s)
	}

	ipRoute(t, tb, "route", "add", "198.19.0.0/16", "via", b1.Addr.String(), "dev", testbed.NodeLANIface)
	h, s := waitLookup(t, c, svc, 5*time.Second, found)
	if s != route.Found || h.NextHop != packet.AddrFromNetip(b1.Addr) || h.DstMAC != mac6(b1.MAC) || h.IfIndex != int32(n1.IfIndex) {
		t.Fatalf("via backend 1: %v %+v, want found via %s (%s)", s, h, b1.Addr, b1.MAC)
	}

	ipRoute(t, tb, "route", "replace", "198.19.0.0/16", "via", b0.Addr.String(), "dev", testbed.NodeLANIface)
	h, s = waitLookup(t, c, svc, 5*time.Second, func(h route.Hop, s route.Status) bool {
		return s == route.Found && h.NextHop == packet.AddrFromNetip(b0.Addr)
	})
	if s != route.Found || h.DstMAC != mac6(b0.MAC) {
		t.Fatalf("after replace via backend 0: %v %+v, want found with %s", s, h, b0.MAC)
	}

	// A more specific route wins; deleting it falls back.
	ipRoute(t, tb, "route", "add", svc+"/32", "via", client.Addr.String(), "dev", testbed.NodeClientIface)
	h, s = waitLookup(t, c, svc, 5*time.Second, func(h route.Hop, s route.Status) bool {
		return s == route.Found && h.IfIndex == int32(n0.IfIndex)
	})
	if s != route.Found || h.DstMAC != mac6(client.MAC) || h.SrcMAC != mac6(n0.MAC) {
		t.Fatalf("host route via the client: %v %+v", s, h)
	}
	ipRoute(t, tb, "route", "del", svc+"/32")
	h, s = waitLookup(t, c, svc, 5*time.Second, func(h route.Hop, s route.Status) bool {
		return h.IfIndex == int32(n1.IfIndex)
	})
	if s != route.Found || h.NextHop != packet.AddrFromNetip(b0.Addr) {
		t.Fatalf("after deleting the host route: %v %+v", s, h)
	}

	ipRoute(t, tb, "route", "del", "198.19.0.0/16")
	if _, s = waitLookup(t, c, svc, 5*time.Second, func(h route.Hop, s route.Status) bool { return s == route.NoRoute }); s != route.NoRoute {
		t.Fatalf("after deleting the route: %v, want no-route", s)
	}

	ipRoute(t, tb, "route", "add", "blackhole", "198.19.7.0/24")
	if _, s = waitLookup(t, c, "198.19.7.1", 5*time.Second, func(h route.Hop, s route.Status) bool { return s == route.Unreachable }); s != route.Unreachable {
		t.Errorf("blackhole: %v, want unreachable", s)
	}
}

func TestInterfacesLimitEgress(t *testing.T) {
	// d1 is managed but does not exist yet; d0 exists and is not managed.
	tb, c, _ := newCache(t, "d1")
	node := tb.NodeNS()
	for _, cmd := range [][]string{
		{"ip", "link", "add", "d0", "type", "veth", "peer", "name", "d0p"},
		{"ip", "addr", "add", "198.18.7.1/24", "dev", "d0"},
		{"ip", "link", "set", "d0", "up"},
		{"ip", "link", "set", "d0p", "up"},
	} {
		if _, err := tb.Exec(node, cmd...); err != nil {
			t.Fatal(err)
		}
	}
	if _, s := waitLookup(t, c, "198.18.7.5", 5*time.Second, func(h route.Hop, s route.Status) bool { return s == route.NotManaged }); s != route.NotManaged {
		t.Fatalf("destination behind an unmanaged interface: %v, want not-managed", s)
	}
	for _, cmd := range [][]string{
		{"ip", "link", "add", "d1", "type", "veth", "peer", "name", "d1p"},
		{"ip", "addr", "add", "198.18.8.1/24", "dev", "d1"},
		{"ip", "link", "set", "d1", "up"},
		{"ip", "link", "set", "d1p", "up"},
	} {
		if _, err := tb.Exec(node, cmd...); err != nil {
			t.Fatal(err)
		}
	}
	var d1 int
	if err := tb.Do(node, func() error {
		l, err := netlink.LinkByName("d1")
		if err == nil {
			d1 = l.Attrs().Index
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	h, s := waitLookup(t, c, "198.18.8.5", 5*time.Second, func(h route.Hop, s route.Status) bool {
		return h.IfIndex == int32(d1)
	})
	if h.IfIndex != int32(d1) || (s != route.Found && s != route.NeedsResolution) {
		t.Fatalf("destination behind a managed interface created later: %v %+v, want ifindex %d", s, h, d1)
	}
	// Taking the link down removes its connected route.
	if _, err := tb.Exec(node, "ip", "link", "set", "d1", "down"); err != nil {
		t.Fatal(err)
	}
	if _, s := waitLookup(t, c, "198.18.8.5", 5*time.Second, func(h route.Hop, s route.Status) bool { return s == route.NoRoute }); s != route.NoRoute {
		t.Errorf("after d1 went down: %v, want no-route", s)
	}
}

func TestUnansweredResolutionIsRateLimited(t *testing.T) {
	tb, c, _ := newCache(t)
	nobody := "198.18.1.200"
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if _, s := c.Lookup(packet.MustParseAddr(nobody)); s != route.NeedsResolution {
			t.Fatalf("lookup of an absent host: %v, want needs-resolution", s)
		}
		time.Sleep(time.Millisecond)
	}
	st := c.Stats()
	// One per ResolveInterval (1s) in 1.5s: two, perhaps three on a slow box.
	if st.Resolutions < 1 || st.Resolutions > 3 {
		t.Errorf("%d resolutions in 1.5s, want 1..3 (stats %+v)", st.Resolutions, st)
	}
	if state := neighState(t, tb, nobody); !strings.Contains(state, "INCOMPLETE") && !strings.Contains(state, "FAILED") {
		t.Errorf("kernel neighbour entry %q, want INCOMPLETE or FAILED", state)
	}
}

// TestStaleNeighbourIsReprobed plants a STALE entry with a wrong MAC, as
// left by a backend that was replaced. The kernel never sees our packets, so
// only the Cache's refresh makes it probe, fail, and learn the right MAC.
func TestStaleNeighbourIsReprobed(t *testing.T) {
	tb, c, _ := newCache(t)
	b0 := tb.Backend(0)
	node := tb.NodeNS()
	// Probe soon instead of after the default 5s.
	if _, err := tb.Exec(node, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/neigh/n1/delay_first_probe_time"); err != nil {
		t.Fatal(err)
	}
	wrong := net.HardwareAddr{0x02, 0, 0, 0, 0, 0x99}
	ipRoute(t, tb, "neigh", "replace", b0.Addr.String(), "dev", testbed.NodeLANIface, "lladdr", wrong.String(), "nud", "stale")
	h, s := waitLookup(t, c, b0.Addr.String(), 5*time.Second, func(h route.Hop, s route.Status) bool {
		return s == route.Found && h.DstMAC == mac6(wrong)
	})
	if s != route.Found || h.DstMAC != mac6(wrong) {
		t.Fatalf("stale entry: %v %+v, want found with the planted MAC", s, h)
	}
	h, s = waitLookup(t, c, b0.Addr.String(), 15*time.Second, func(h route.Hop, s route.Status) bool {
		return s == route.Found && h.DstMAC == mac6(b0.MAC)
	})
	if s != route.Found || h.DstMAC != mac6(b0.MAC) {
		t.Fatalf("after re-probing: %v %+v, want found with %s; kernel: %s", s, h, b0.MAC, neighState(t, tb, b0.Addr.String()))
	}
}

func TestNewNeedsInterfaces(t *testing.T) {
	if _, err := route.New(route.Options{}); !errors.Is(err, route.ErrNoInterfaces) {
		t.Errorf("New without interfaces: %v, want ErrNoInterfaces", err)
	}
}

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 {
		if deleted, err := testbed.CleanupStale(); err != nil {
			fmt.Fprintln(os.Stderr, "cleanup of stale testbeds:", err)
		} else if len(deleted) > 0 {
			fmt.Fprintln(os.Stderr, "deleted stale testbeds:", deleted)
		}
	}
	os.Exit(m.Run())
}
