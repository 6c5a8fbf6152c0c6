package service

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"
	"weak"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// randomPort is service port s of a random model: dual-stack or not, with
// any mix of frontends, policies, schedulers and endpoint conditions. Some
// ports share endpoints (one key listed by two ports); with share, some
// also share external IPs (frontend conflicts).
func randomPort(r *rand.Rand, s int, share bool) ServicePort {
	nodes := []string{"node-a", "node-b", "node-c"}
	zones := []string{"zone-a", "zone-b"}
	sp := ServicePort{
		Name:                name(fmt.Sprint("ns", s%3), fmt.Sprint("svc", s), []string{"", "http", "dns"}[r.IntN(3)]),
		Proto:               []packet.Proto{packet.ProtoTCP, packet.ProtoUDP}[r.IntN(2)],
		ClusterIPs:          []packet.Addr{packet.AddrFrom4([4]byte{198, 19, byte(s >> 8), byte(s)})},
		Port:                uint16(80 + r.IntN(2)),
		ExternalPolicyLocal: r.IntN(2) == 0,
		InternalPolicyLocal: r.IntN(4) == 0,
		TopologyAware:       r.IntN(2) == 0,
		Scheduler:           Scheduler(r.IntN(3)),
		Revision:            NewRevision(),
	}
	if r.IntN(4) == 0 {
		sp.ClusterIPs = append(sp.ClusterIPs, a(fmt.Sprintf("fd00:96::%x", s)))
	}
	if r.IntN(10) == 0 {
		sp.ClusterIPs = nil
	}
	if r.IntN(3) == 0 {
		sp.NodePort = uint16(30000 + s)
		sp.HealthCheckNodePort = uint16(32000 + s)
	}
	if r.IntN(4) == 0 {
		sp.ExternalIPs = []packet.Addr{packet.AddrFrom4([4]byte{198, 19, 50 + byte(s>>8), byte(s)})}
		if share && r.IntN(4) == 0 {
			sp.ExternalIPs[0] = packet.AddrFrom4([4]byte{198, 19, 49, byte(r.IntN(8))})
		}
	}
	if r.IntN(3) == 0 {
		sp.LoadBalancerIPs = []packet.Addr{packet.AddrFrom4([4]byte{198, 19, 100 + byte(s>>8), byte(s)})}
		if r.IntN(2) == 0 {
			sp.SourceRanges = []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}
			if r.IntN(2) == 0 {
				sp.SourceRanges = append(sp.SourceRanges, netip.MustParsePrefix("198.18.0.0/24"))
			}
		}
	}
	if r.IntN(5) == 0 {
		sp.AffinityTimeout = DefaultAffinityTimeout
	}
	sp.Endpoints = randomEndpoints(r, s, nodes, zones)
	return sp
}

func randomEndpoints(r *rand.Rand, s int, nodes, zones []string) []Endpoint {
	var eps []Endpoint
	hinted := r.IntN(2) == 0
	for e := range r.IntN(7) {
		ready := r.IntN(3) != 0
		ep := Endpoint{
			Addr:     packet.AddrFrom4([4]byte{198, 18, 128 + byte(r.IntN(2)), byte(s)}),
			Port:     uint16(8000 + e),
			Ready:    ready,
			Serving:  ready || r.IntN(2) == 0,
			NodeName: nodes[r.IntN(len(nodes))],
		}
		switch r.IntN(12) {
		case 0:
			ep.Addr = a(fmt.Sprintf("fd00:10::%x:%x", s, e))
		case 1:
			ep.Addr = packet.Addr{} // skipped
		case 2:
			ep.Addr = packet.AddrFrom4([4]byte{198, 18, 130, 1}) // shared with other ports
		}
		ep.Terminating = !ready && (ep.Serving || r.IntN(2) == 0)
		if hinted && r.IntN(8) != 0 {
			ep.ZoneHints = []string{zones[r.IntN(len(zones))]}
		}
		eps = append(eps, ep)
	}
	return eps
}

// mutate returns the next version of m as a source would publish it: a
// fresh Ports slice in which some ports changed (with a new revision) or
// lost their revision. Half the steps keep the list's layout, a quarter
// change only endpoints, as EndpointSlice updates do; the others also
// rename, or remove, add and reorder ports, or change the node. It never
// modifies m.
func mutate(r *rand.Rand, m *Model, next *int, share bool) *Model {
	out := &Model{Node: m.Node}
	mode := r.IntN(4)
	layout, renames, endpointsOnly := mode == 0, mode == 1, mode == 3
	for _, sp := range m.Ports {
		switch r.IntN(20) {
		case 0: // removed
			if layout {
				continue
			}
		case 1, 2: // endpoints changed
			sp.Endpoints = randomEndpoints(r, portNumber(&sp), []string{"node-a", "node-b"}, []string{"zone-a", "zone-b"})
			sp.Revision = NewRevision()
		case 3: // replaced by a new version of the whole port, frontends too
			if endpointsOnly {
				break
			}
			n, proto := sp.Name, sp.Proto
			sp = randomPort(r, portNumber(&sp), share)
			sp.Name, sp.Proto = n, proto
		case 4: // rebuilt by a source that does not track revisions
			sp.Revision = 0
		case 5: // rebuilt, same contents, new revision
			sp.Revision = NewRevision()
		case 6: // changed by a source that does not track revisions
			if sp.Revision == 0 {
				sp.Endpoints = randomEndpoints(r, portNumber(&sp), []string{"node-a"}, []string{"zone-a"})
			}
		case 7: // renamed, which may move it in the sorted order
			if renames {
				sp.Name.Name += "x"
				sp.Revision = NewRevision()
			}
		}
		out.Ports = append(out.Ports, sp)
	}
	if layout {
		for range r.IntN(3) {
			out.Ports = append(out.Ports, randomPort(r, *next, share))
			*next++
		}
		r.Shuffle(len(out.Ports), func(i, j int) { out.Ports[i], out.Ports[j] = out.Ports[j], out.Ports[i] })
		if r.IntN(5) == 0 {
			out.Node.Name = []string{"node-a", "node-b"}[r.IntN(2)]
			out.Node.Zone = []string{"zone-a", "zone-b"}[r.IntN(2)]
		}
	}
	return out
}

// portNumber recovers the number randomPort was given from the name.
func portNumber(sp *ServicePort) int {
	var s int
	if _, err := fmt.Sscanf(sp.Name.Name, "svc%d", &s); err != nil {
		panic(err)
	}
	return s
}

// sameTable fails t unless got answers every question exactly as want
// does: ports, frontends, lookups, verdicts, backend sets, selection,
// masquerading, source ranges, backend keys and problems.
func sameTable(t *testing.T, step int, got, want *Table, m *Model) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("step %d: "+format, append([]any{step}, args...)...)
	}
	if !slices.Equal(got.Problems(), want.Problems()) {
		fail("problems %q, want %q", got.Problems(), want.Problems())
	}
	if !reflect.DeepEqual(got.settings, want.settings) {
		fail("settings differ")
	}
	if len(got.ports) != len(want.ports) {
		fail("%d ports, want %d", len(got.ports), len(want.ports))
	}
	for i := range got.ports {
		gp, wp := got.ports[i], want.ports[i]
		if gp.settings != got.settings {
			fail("port %v points at another table's settings", gp.Name)
		}
		if !reflect.DeepEqual(*gp, *wp) {
			fail("port %v differs:\n got %+v\nwant %+v", gp.Name, *gp, *wp)
		}
	}
	if !slices.Equal(got.FrontendKeys(), want.FrontendKeys()) || !slices.Equal(got.VIPs(), want.VIPs()) {
		fail("frontend keys or VIPs differ")
	}
	if got.Frontends() != want.Frontends() {
		fail("%d frontends, want %d", got.Frontends(), want.Frontends())
	}
	srcs := []packet.Addr{externalC, allowedC, localPod, remotePod, localPodV6, nodeV4, otherNode,
		packet.AddrFrom4([4]byte{198, 19, 100, 3}), packet.AddrFrom4([4]byte{198, 18, 128, 3})}
	for i := range want.nFrontends {
		wf := want.frontend(i)
		gf := got.Lookup(wf.Key.Proto, wf.Key.Addr, wf.Key.Port)
		if gf == nil || gf.Key != wf.Key || gf.Kind != wf.Kind || gf.Port.Name != wf.Port.Name {
			fail("lookup %v: %+v, want %+v", wf.Key, gf, wf)
		}
		if !ownPort(got, gf.Port) {
			fail("frontend %v points at a port outside its table", gf.Key)
		}
		own := func(s *BackendSet) bool {
			p := gf.Port
			return s == &emptySet || s == &p.Cluster[0] || s == &p.Cluster[1] || s == &p.Local[0] || s == &p.Local[1]
		}
		if !own(gf.backends) || !own(gf.shortCircuit) {
			fail("frontend %v uses a backend set of another port", gf.Key)
		}
		for _, lo := range []bool{false, true} {
			if gf.Verdict(lo) != wf.Verdict(lo) || !slices.Equal(gf.Backends(lo), wf.Backends(lo)) {
				fail("%v local origin %v: verdict %v %v, want %v %v", wf.Key, lo,
					gf.Verdict(lo), gf.Backends(lo), wf.Verdict(lo), wf.Backends(lo))
			}
			if wf.Port.Scheduler == RoundRobin {
				continue
			}
			for h := uint64(1); h < 1<<60; h *= 977 {
				gb, wb := gf.Select(h, h*31, lo), wf.Select(h, h*31, lo)
				if (gb == nil) != (wb == nil) || gb != nil && *gb != *wb {
					fail("%v select %d: %+v, want %+v", wf.Key, h, gb, wb)
				}
			}
		}
		for _, src := range srcs {
			var b *Backend
			if bs := wf.Backends(false); len(bs) > 0 {
				b = &bs[0]
			}
			if NeedsMasquerade(gf, src, b) != NeedsMasquerade(wf, src, b) {
				fail("%v from %v: masquerade differs", wf.Key, src)
			}
			if gf.AllowsSource(src) != wf.AllowsSource(src) {
				fail("%v from %v: AllowsSource differs", wf.Key, src)
			}
		}
	}
	for _, src := range srcs {
		if got.IsLocalOrigin(src) != want.IsLocalOrigin(src) {
			fail("IsLocalOrigin(%v) differs", src)
		}
		for _, proto := range []packet.Proto{packet.ProtoTCP, packet.ProtoUDP} {
			for _, port := range []uint16{80, 81, 82} {
				if (got.Lookup(proto, src, port) == nil) != (want.Lookup(proto, src, port) == nil) {
					fail("lookup of %v:%d differs", src, port)
				}
			}
		}
	}
	sortKeys := func(ks []Key) []Key {
		ks = slices.Clone(ks)
		slices.SortFunc(ks, func(x, y Key) int {
			if c := compareAddr(&x.Addr, &y.Addr); c != 0 {
				return c
			}
			return int(x.Port)<<8 + int(x.Proto) - int(y.Port)<<8 - int(y.Proto)
		})
		return ks
	}
	gk, wk := sortKeys(got.BackendKeys()), sortKeys(want.BackendKeys())
	if !slices.Equal(gk, wk) {
		extra := slices.DeleteFunc(slices.Clone(gk), func(k Key) bool { return slices.Contains(wk, k) })
		missing := slices.DeleteFunc(slices.Clone(wk), func(k Key) bool { return slices.Contains(gk, k) })
		fail("backend keys: %v extra, %v missing", extra, missing)
	}
	if len(slices.Compact(gk)) != len(got.BackendKeys()) {
		fail("backend keys listed twice")
	}
	for _, sp := range m.Ports {
		for _, e := range sp.Endpoints {
			for _, port := range []uint16{e.Port, e.Port + 1000} {
				if got.IsBackend(sp.Proto, e.Addr, port) != want.IsBackend(sp.Proto, e.Addr, port) {
					fail("IsBackend %v %v:%d differs", sp.Proto, e.Addr, port)
				}
			}
		}
	}
}

// A chain of tables, each compiled from the one before, answers exactly
// like tables compiled from scratch, whatever changes between versions.
func TestCompileFromMatchesCompile(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 7))
			// Half the seeds have frontend conflicts, which make CompileFrom
			// rebuild the frontends.
			share := seed > 2
			opts := CompileOptions{ClusterCIDRs: testOptions.ClusterCIDRs, MaglevSize: 251}
			if seed%2 == 0 {
				// Too small for some backend sets: those ports have problems.
				opts.MaglevSize = 5
			}
			m := &Model{Node: Node{Name: "node-a", Zone: "zone-a", Addresses: []packet.Addr{nodeV4, nodeV6}}}
			next := 0
			for range 150 {
				m.Ports = append(m.Ports, randomPort(r, next, share))
				next++
			}
			prev := Compile(m, opts)
			kept := 0
			for step := range 60 {
				m = mutate(r, m, &next, share)
				if step%20 == 19 {
					opts.MasqueradeAll = !opts.MasqueradeAll
				}
				got := CompileFrom(prev, m, opts)
				sameTable(t, step, got, Compile(m, opts), m)
				if dataPtr(got.index.slots) == dataPtr(prev.index.slots) {
					kept++
				}
				prev = got
			}
			// Without conflicts, endpoint-only steps keep the frontends.
			if kept == 0 && !share {
				t.Error("no step kept the frontend index")
			}
			t.Logf("%d of 60 steps kept the frontend index", kept)
		})
	}
}

func ownPort(t *Table, p *Port) bool { return slices.Contains(t.ports, p) }

func dataPtr[T any](s []T) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(s)) }

// When one port's endpoints change, CompileFrom takes every other port
// over as it is, keeps the frontend index, and copies only the backend
// shards the change touches.
func TestCompileFromReuses(t *testing.T) {
	m := bigModel(2000, 4, Maglev)
	for i := range m.Ports {
		m.Ports[i].Revision = NewRevision()
	}
	opts := CompileOptions{MaglevSize: 251}
	prev := Compile(m, opts)

	m2 := &Model{Node: m.Node, Ports: slices.Clone(m.Ports)}
	sp := &m2.Ports[700]
	sp.Endpoints = slices.Clone(sp.Endpoints)
	sp.Endpoints[0].Ready = false
	sp.Endpoints[1].Port = 9999 // a new backend key
	sp.Revision = NewRevision()
	got := CompileFrom(prev, m2, opts)
	sameTable(t, 0, got, Compile(m2, opts), m2)

	for i := range got.ports {
		shared := got.ports[i].Cluster[0].maglev == prev.ports[i].Cluster[0].maglev &&
			dataPtr(got.ports[i].Cluster[0].Backends) == dataPtr(prev.ports[i].Cluster[0].Backends)
		if changed := got.ports[i].Name == sp.Name; shared == changed {
			t.Errorf("port %v: shared %v", got.ports[i].Name, shared)
		}
	}
	if dataPtr(got.index.slots) != dataPtr(prev.index.slots) || dataPtr(got.vips) != dataPtr(prev.vips) {
		t.Error("frontend index rebuilt though no frontend changed")
	}
	pages := 0
	for pg := range got.pages {
		if got.pages[pg] != prev.pages[pg] {
			pages++
		}
	}
	if pages == 0 || pages > 2 {
		t.Errorf("%d of %d frontend pages copied, want 1 or 2", pages, len(got.pages))
	}
	copied := 0
	for s := range got.backends.shards {
		if dataPtr(got.backends.shards[s].slots) != dataPtr(prev.backends.shards[s].slots) {
			copied++
		}
	}
	if copied == 0 || copied > 2 {
		t.Errorf("%d of %d backend shards copied, want 1 or 2", copied, len(got.backends.shards))
	}
	if got.IsBackend(packet.ProtoTCP, sp.Endpoints[1].Addr, 8001) || !got.IsBackend(packet.ProtoTCP, sp.Endpoints[1].Addr, 9999) ||
		!prev.IsBackend(packet.ProtoTCP, sp.Endpoints[1].Addr, 8001) || prev.IsBackend(packet.ProtoTCP, sp.Endpoints[1].Addr, 9999) {
		t.Error("backend key change not reflected in the new table, or leaked into the old one")
	}

	// A readiness change alone keeps the set of backend keys, and so the
	// list of them.
	keys := got.BackendKeys()
	m5 := &Model{Node: m.Node, Ports: slices.Clone(m2.Ports)}
	m5.Ports[700].Endpoints = slices.Clone(m5.Ports[700].Endpoints)
	m5.Ports[700].Endpoints[0].Ready = true
	m5.Ports[700].Revision = NewRevision()
	t5 := CompileFrom(got, m5, opts)
	if !t5.backends.same(&got.backends) || dataPtr(t5.BackendKeys()) != dataPtr(keys) {
		t.Error("backend keys listed again though none changed")
	}
	sameTable(t, 1, t5, Compile(m5, opts), m5)

	// Revision 0 and a changed node both mean compiling everything.
	maglevOf := func(tab *Table, n PortName) *BackendSet {
		for i := range tab.ports {
			if tab.ports[i].Name == n {
				return &tab.ports[i].Cluster[0]
			}
		}
		t.Fatalf("%v missing", n)
		return nil
	}
	m3 := &Model{Node: m.Node, Ports: slices.Clone(m.Ports)}
	m3.Ports[5].Revision = 0
	n5 := m3.Ports[5].Name
	if t3 := CompileFrom(prev, m3, opts); maglevOf(t3, n5).maglev == maglevOf(prev, n5).maglev {
		t.Error("port without a revision was reused")
	}
	m4 := &Model{Node: Node{Name: "node-1", Addresses: m.Node.Addresses}, Ports: m.Ports}
	if t4 := CompileFrom(prev, m4, opts); maglevOf(t4, n5).maglev == maglevOf(prev, n5).maglev {
		t.Error("port reused across a node change")
	}
}

// A table compiled from prev holds no reference to prev, so replaced
// tables are collected even though their parts live on.
func TestCompileFromDropsPrev(t *testing.T) {
	m := genModel(1)
	for i := range m.Ports {
		m.Ports[i].Revision = NewRevision()
	}
	prev := Compile(m, CompileOptions{})
	wp := weak.Make(prev)
	m.Ports[3].Revision = NewRevision()
	next := CompileFrom(prev, m, CompileOptions{})
	prev = nil
	for range 5 {
		runtime.GC()
	}
	if wp.Value() != nil {
		t.Error("the previous table is still reachable from the new one")
	}
	runtime.KeepAlive(next)
}

// Workers reading a table keep getting the same answers while tables are
// compiled from it. Run with -race: CompileFrom must only read prev.
func TestCompileFromLeavesPrevAlone(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 9))
	opts := CompileOptions{ClusterCIDRs: testOptions.ClusterCIDRs, MaglevSize: 251}
	m := &Model{Node: Node{Name: "node-a", Zone: "zone-a", Addresses: []packet.Addr{nodeV4}}}
	next := 0
	for range 200 {
		m.Ports = append(m.Ports, randomPort(r, next, false))
		next++
	}
	base := Compile(m, opts)
	type answer struct {
		verdict  Verdict
		backends string
		masq     bool
		allowed  bool
	}
	ask := func(f *Frontend) answer {
		var b *Backend
		if f.Port.Scheduler != RoundRobin {
			b = f.Select(12345, 678, false)
		}
		return answer{f.Verdict(false), setString(f.Backends(true)), NeedsMasquerade(f, externalC, b), f.AllowsSource(allowedC)}
	}
	keys := slices.Clone(base.FrontendKeys())
	want := make([]answer, len(keys))
	for i, k := range keys {
		want[i] = ask(base.Lookup(k.Proto, k.Addr, k.Port))
	}
	backendKeys := slices.Clone(base.BackendKeys())

	var stop atomic.Bool
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Go(func() {
			for n := w; !stop.Load(); n++ {
				k := keys[n%len(keys)]
				f := base.Lookup(k.Proto, k.Addr, k.Port)
				if f == nil {
					t.Errorf("%v vanished", k)
					return
				}
				if f.Port.Scheduler == RoundRobin {
					_ = f.Select(0, 0, false) // advances the counter CompileFrom copies
				}
				if got := ask(f); got != want[n%len(keys)] {
					t.Errorf("%v: %+v, want %+v", k, got, want[n%len(keys)])
					return
				}
				bk := backendKeys[n%len(backendKeys)]
				if !base.IsBackend(bk.Proto, bk.Addr, bk.Port) {
					t.Errorf("backend %v vanished", bk)
					return
				}
			}
		})
	}
	// Half the tables are compiled from base itself, half from a chain.
	baseModel, prev := m, base
	kept := 0
	for i := range 40 {
		if i%2 == 0 {
			tab := CompileFrom(base, mutate(r, baseModel, &next, false), opts)
			_ = tab.BackendKeys()
			if dataPtr(tab.index.slots) == dataPtr(base.index.slots) {
				kept++
			}
			continue
		}
		m = mutate(r, m, &next, false)
		prev = CompileFrom(prev, m, opts)
		_ = prev.BackendKeys()
	}
	stop.Store(true)
	wg.Wait()
	if kept == 0 {
		t.Error("no table shared base's frontends")
	}
}

// Frontend conflicts stay reported when a table is compiled from one that
// had them, and go away with the port that caused them.
func TestCompileFromConflicts(t *testing.T) {
	port := func(n string, extIP string, ep4 byte) ServicePort {
		sp := ServicePort{Name: name("ns", n, ""), Proto: packet.ProtoTCP, Port: 80, Revision: NewRevision(),
			ClusterIPs: addrs(fmt.Sprintf("198.19.0.%d", ep4)),
			Endpoints:  []Endpoint{ep(fmt.Sprintf("198.18.129.%d", ep4), 80, "n", "ready")}}
		if extIP != "" {
			sp.ExternalIPs = addrs(extIP)
		}
		return sp
	}
	m := &Model{Ports: []ServicePort{port("a", "198.19.50.1", 1), port("b", "198.19.50.1", 2), port("c", "", 3)}}
	prev := Compile(m, CompileOptions{})
	if len(prev.Problems()) != 1 {
		t.Fatalf("problems %q, want one conflict", prev.Problems())
	}

	// Another port's endpoints change: the conflict is still there.
	m2 := &Model{Ports: slices.Clone(m.Ports)}
	m2.Ports[2].Endpoints = []Endpoint{ep("198.18.129.9", 80, "n", "ready")}
	m2.Ports[2].Revision = NewRevision()
	sameTable(t, 0, CompileFrom(prev, m2, CompileOptions{}), Compile(m2, CompileOptions{}), m2)

	// The losing port drops the address: no conflict any more.
	m3 := &Model{Ports: slices.Clone(m.Ports)}
	m3.Ports[1] = port("b", "", 2)
	got := CompileFrom(prev, m3, CompileOptions{})
	sameTable(t, 1, got, Compile(m3, CompileOptions{}), m3)
	if len(got.Problems()) != 0 {
		t.Errorf("problems %q, want none", got.Problems())
	}
}
