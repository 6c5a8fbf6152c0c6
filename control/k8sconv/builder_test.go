package k8sconv

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/dataplane/service"
)

// endpointList is a short way to write the endpoints a test expects:
// "ip:port" of ready, serving endpoints.
func endpointList(t *testing.T, eps []service.Endpoint) []string {
	t.Helper()
	var out []string
	for _, e := range eps {
		s := e.Addr.String() + ":" + strconv.Itoa(int(e.Port))
		if !e.Ready {
			s += " notready"
		}
		if e.Terminating {
			s += " terminating"
		}
		out = append(out, s)
	}
	return out
}

func TestBuilderJoinsEndpointsToPorts(t *testing.T) {
	twoPorts := func(s *v1.Service) {
		s.Spec.Ports = []v1.ServicePort{
			{Name: "http", Port: 80, Protocol: v1.ProtocolTCP},
			{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP},
			{Name: "dnstcp", Port: 53, Protocol: v1.ProtocolTCP},
		}
	}
	slicePorts := func(ports ...discovery.EndpointPort) func(*discovery.EndpointSlice) {
		return func(es *discovery.EndpointSlice) { es.Ports = ports }
	}
	port := func(name string, proto v1.Protocol, n int32) discovery.EndpointPort {
		return discovery.EndpointPort{Name: ptr(name), Protocol: ptr(proto), Port: ptr(n)}
	}
	testCases := []struct {
		name   string
		svc    *v1.Service
		slices []*discovery.EndpointSlice
		want   map[string][]string // port name -> endpoints
	}{
		{
			name: "no slices: ports without endpoints are still programmed",
			svc:  makeService("ns1", "a", twoPorts),
			want: map[string][]string{"http": nil, "dns": nil, "dnstcp": nil},
		},
		{
			name: "ports matched by name and protocol across slices, merged and sorted",
			svc:  makeService("ns1", "a", twoPorts),
			slices: []*discovery.EndpointSlice{
				makeSlice("ns1", "a-1", "a", slicePorts(port("http", v1.ProtocolTCP, 8080), port("dns", v1.ProtocolUDP, 5353)),
					withEndpoints(ep("10.0.0.2"), ep("10.0.0.1"))),
				makeSlice("ns1", "a-2", "a", slicePorts(port("http", v1.ProtocolTCP, 8080)),
					withEndpoints(ep("10.0.0.3"))),
				// Same name, other protocol: belongs to dnstcp, not dns.
				makeSlice("ns1", "a-3", "a", slicePorts(port("dns", v1.ProtocolTCP, 5353), port("dnstcp", v1.ProtocolTCP, 5354)),
					withEndpoints(ep("10.0.0.9"))),
			},
			want: map[string][]string{
				"http":   {"10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"},
				"dns":    {"10.0.0.1:5353", "10.0.0.2:5353"},
				"dnstcp": {"10.0.0.9:5354"},
			},
		},
		{
			name: "an endpoint in two slices appears once; the non-terminating copy wins",
			svc:  makeService("ns1", "a"),
			slices: []*discovery.EndpointSlice{
				makeSlice("ns1", "a-1", "a", withEndpoints(ep("10.0.0.1", func(e *discovery.Endpoint) {
					e.Conditions = discovery.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}
				}), ep("10.0.0.2"))),
				makeSlice("ns1", "a-2", "a", withEndpoints(ep("10.0.0.1"), ep("10.0.0.2"))),
			},
			want: map[string][]string{"p80": {"10.0.0.1:8080", "10.0.0.2:8080"}},
		},
		{
			name: "same address on two target ports is two endpoints",
			svc:  makeService("ns1", "a"),
			slices: []*discovery.EndpointSlice{
				makeSlice("ns1", "a-1", "a", withEndpoints(ep("10.0.0.1"))),
				makeSlice("ns1", "a-2", "a", slicePorts(port("p80", v1.ProtocolTCP, 9090)), withEndpoints(ep("10.0.0.1"))),
			},
			want: map[string][]string{"p80": {"10.0.0.1:8080", "10.0.0.1:9090"}},
		},
		{
			name: "dual-stack slices feed the same port",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"172.30.0.1", "fd00:30::1"}
			}),
			slices: []*discovery.EndpointSlice{
				makeSlice("ns1", "a-v4", "a", withEndpoints(ep("10.0.0.1"))),
				makeSlice("ns1", "a-v6", "a", func(es *discovery.EndpointSlice) { es.AddressType = discovery.AddressTypeIPv6 },
					withEndpoints(ep("fd00::1"))),
			},
			want: map[string][]string{"p80": {"10.0.0.1:8080", "fd00::1:8080"}},
		},
		{
			name: "slices of another service or namespace are not used",
			svc:  makeService("ns1", "a"),
			slices: []*discovery.EndpointSlice{
				makeSlice("ns1", "b-1", "b", withEndpoints(ep("10.0.0.1"))),
				makeSlice("ns2", "a-1", "a", withEndpoints(ep("10.0.0.2"))),
			},
			want: map[string][]string{"p80": nil},
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := newTestConverter(t, Options{})
			b := NewBuilder()
			b.SetService(typesName(tc.svc.Namespace, tc.svc.Name), c.Service(tc.svc))
			for _, es := range tc.slices {
				b.SetSlice(SliceKey{es.Namespace, es.Name}, c.EndpointSlice(es))
			}
			m := b.Model(service.Node{Name: "n1"})
			if m.Node.Name != "n1" {
				t.Errorf("node %+v", m.Node)
			}
			got := map[string][]string{}
			for _, sp := range m.Ports {
				if _, dup := got[sp.Name.Port]; dup {
					t.Fatalf("port %v twice", sp.Name)
				}
				got[sp.Name.Port] = endpointList(t, sp.Endpoints)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("\n got %v\nwant %v", got, tc.want)
			}
		})
	}
}

func TestBuilderZoneHintsMakeTopologyAware(t *testing.T) {
	c, _ := newTestConverter(t, Options{})
	b := NewBuilder()
	b.SetService(typesName("ns1", "a"), c.Service(makeService("ns1", "a")))
	b.SetSlice(SliceKey{"ns1", "a-1"}, c.EndpointSlice(makeSlice("ns1", "a-1", "a", withEndpoints(ep("10.0.0.1")))))
	if b.Model(service.Node{}).Ports[0].TopologyAware {
		t.Fatal("topology aware without hints or request")
	}
	b.SetSlice(SliceKey{"ns1", "a-1"}, c.EndpointSlice(makeSlice("ns1", "a-1", "a", withEndpoints(ep("10.0.0.1", func(e *discovery.Endpoint) {
		e.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "z1"}}}
	})))))
	sp := b.Model(service.Node{}).Ports[0]
	if !sp.TopologyAware || !reflect.DeepEqual(sp.Endpoints[0].ZoneHints, []string{"z1"}) {
		t.Fatalf("hints not carried: %+v", sp)
	}
}

func TestBuilderIncremental(t *testing.T) {
	c, _ := newTestConverter(t, Options{})
	b := NewBuilder()
	for _, name := range []string{"c", "a", "b"} {
		b.SetService(typesName("ns1", name), c.Service(makeService("ns1", name)))
		b.SetSlice(SliceKey{"ns1", name + "-1"}, c.EndpointSlice(makeSlice("ns1", name+"-1", name, withEndpoints(ep("10.0.0.1")))))
	}
	m1 := b.Model(service.Node{})
	names := func(m *service.Model) []string {
		var out []string
		for _, sp := range m.Ports {
			out = append(out, sp.Name.String()+"="+strconv.Itoa(len(sp.Endpoints)))
		}
		return out
	}
	if got, want := names(m1), []string{"ns1/a:p80=1", "ns1/b:p80=1", "ns1/c:p80=1"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("model %v, want %v", got, want)
	}

	// One slice changes: only its service is rebuilt, the others' endpoint
	// arrays are shared with the previous model, which stays as it was.
	b.SetSlice(SliceKey{"ns1", "b-1"}, c.EndpointSlice(makeSlice("ns1", "b-1", "b", withEndpoints(ep("10.0.0.1"), ep("10.0.0.2")))))
	m2 := b.Model(service.Node{})
	if got, want := names(m2), []string{"ns1/a:p80=1", "ns1/b:p80=2", "ns1/c:p80=1"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("model %v, want %v", got, want)
	}
	if &m1.Ports[0].Endpoints[0] != &m2.Ports[0].Endpoints[0] || &m1.Ports[2].Endpoints[0] != &m2.Ports[2].Endpoints[0] {
		t.Error("unchanged services were rebuilt")
	}
	if len(m1.Ports[1].Endpoints) != 1 {
		t.Error("previous model changed")
	}

	// A slice relabelled to another service leaves the first one.
	b.SetSlice(SliceKey{"ns1", "b-1"}, c.EndpointSlice(makeSlice("ns1", "b-1", "c", withEndpoints(ep("10.0.0.7")))))
	if got, want := names(b.Model(service.Node{})), []string{"ns1/a:p80=1", "ns1/b:p80=0", "ns1/c:p80=2"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after relabel %v, want %v", got, want)
	}

	// Deleting a service removes its ports; its slices wait for it.
	b.SetService(typesName("ns1", "a"), nil)
	if got, want := names(b.Model(service.Node{})), []string{"ns1/b:p80=0", "ns1/c:p80=2"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after delete %v, want %v", got, want)
	}
	b.SetService(typesName("ns1", "a"), c.Service(makeService("ns1", "a")))
	b.SetSlice(SliceKey{"ns1", "c-1"}, nil)
	if got, want := names(b.Model(service.Node{})), []string{"ns1/a:p80=1", "ns1/b:p80=0", "ns1/c:p80=1"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after re-add %v, want %v", got, want)
	}
	if b.Services() != 3 {
		t.Errorf("Services() = %d", b.Services())
	}
}

// Rebuilt ports get a new revision and the others keep theirs, which is
// what lets service.CompileFrom reuse their compiled form; the table it
// builds that way answers as a table compiled from scratch does.
func TestBuilderRevisions(t *testing.T) {
	c, _ := newTestConverter(t, Options{})
	b := NewBuilder()
	for i := range 20 {
		name := fmt.Sprint("s", i)
		b.SetService(typesName("ns1", name), c.Service(makeService("ns1", name, func(s *v1.Service) {
			ip := fmt.Sprintf("172.30.0.%d", i+1)
			s.Spec.ClusterIP, s.Spec.ClusterIPs = ip, []string{ip}
		})))
		b.SetSlice(SliceKey{"ns1", name + "-1"}, c.EndpointSlice(makeSlice("ns1", name+"-1", name, withEndpoints(ep("10.0.0.1")))))
	}
	m := b.Model(service.Node{Name: "n1"})
	seen := map[uint64]bool{}
	for _, sp := range m.Ports {
		if sp.Revision == 0 || seen[sp.Revision] {
			t.Fatalf("%v: revision %d not fresh", sp.Name, sp.Revision)
		}
		seen[sp.Revision] = true
	}
	tab := service.Compile(m, service.CompileOptions{})
	for step := range 30 {
		changed := fmt.Sprint("s", step%20)
		var eps []discovery.Endpoint
		for e := range step%4 + 1 {
			eps = append(eps, ep(fmt.Sprintf("10.0.%d.%d", step, e+1)))
		}
		b.SetSlice(SliceKey{"ns1", changed + "-1"}, c.EndpointSlice(makeSlice("ns1", changed+"-1", changed, withEndpoints(eps...))))
		next := b.Model(service.Node{Name: "n1"})
		for i, sp := range next.Ports {
			if rebuilt := sp.Revision != m.Ports[i].Revision; rebuilt != (sp.Name.Name == changed) {
				t.Fatalf("step %d: %v rebuilt %v", step, sp.Name, rebuilt)
			}
		}
		tab = service.CompileFrom(tab, next, service.CompileOptions{})
		want := service.Compile(next, service.CompileOptions{})
		for _, k := range want.FrontendKeys() {
			g, w := tab.Lookup(k.Proto, k.Addr, k.Port), want.Lookup(k.Proto, k.Addr, k.Port)
			if g == nil || !reflect.DeepEqual(g.Backends(false), w.Backends(false)) {
				t.Fatalf("step %d: %v backends differ", step, k)
			}
		}
		m = next
	}
}

// Services come, go and change in any order, several per Model: each Model
// is the one a new Builder makes from the same objects, and only the
// services touched since the last Model get new revisions.
func TestBuilderAnyOrder(t *testing.T) {
	c, _ := newTestConverter(t, Options{})
	const keys = 40
	svcs := make([][2]*Service, keys) // with one port and with two
	sls := make([]*Slice, keys)
	for i := range keys {
		name := fmt.Sprintf("s%02d", i)
		ns := fmt.Sprint("ns", i%3) // sorted by namespace first
		ip := fmt.Sprintf("172.30.0.%d", i+1)
		for p := range 2 {
			svcs[i][p] = c.Service(makeService(ns, name, func(s *v1.Service) {
				s.Spec.ClusterIP, s.Spec.ClusterIPs = ip, []string{ip}
				if p == 1 {
					s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "p81", Port: 81, Protocol: v1.ProtocolTCP})
				}
			}))
		}
		sls[i] = c.EndpointSlice(makeSlice(ns, name+"-1", name, withEndpoints(ep(fmt.Sprintf("10.0.0.%d", i+1)))))
	}
	key := func(i int) types.NamespacedName { return svcs[i][0].Key }
	sliceKey := func(i int) SliceKey { return SliceKey{svcs[i][0].Key.Namespace, fmt.Sprintf("s%02d-1", i)} }
	noRevisions := func(m *service.Model) []service.ServicePort {
		ports := slices.Clone(m.Ports)
		for i := range ports {
			ports[i].Revision = 0
		}
		return ports
	}

	rng := rand.New(rand.NewPCG(1, 2))
	b := NewBuilder()
	live := map[int]*Service{}
	withSlice := map[int]bool{}
	var last *service.Model
	for step := range 200 {
		touched := map[types.NamespacedName]bool{}
		// Every other step makes a few changes only, so that many Models
		// also take the path where the layout does not change.
		changes := rng.IntN(2*keys) + 1
		if step%2 == 1 {
			changes = rng.IntN(3) + 1
		}
		for range changes {
			i := rng.IntN(keys)
			touched[key(i)] = true
			switch op := rng.IntN(10); {
			case op < 4:
				live[i] = svcs[i][rng.IntN(2)]
				b.SetService(key(i), live[i])
			case op < 8:
				delete(live, i)
				b.SetService(key(i), nil)
			case withSlice[i]:
				delete(withSlice, i)
				b.SetSlice(sliceKey(i), nil)
			default:
				withSlice[i] = true
				b.SetSlice(sliceKey(i), sls[i])
			}
			if b.Services() != len(live) {
				t.Fatalf("step %d: Services() = %d, want %d", step, b.Services(), len(live))
			}
		}
		m := b.Model(service.Node{})

		fresh := NewBuilder()
		for i := range keys {
			if live[i] != nil {
				fresh.SetService(key(i), live[i])
			}
			if withSlice[i] {
				fresh.SetSlice(sliceKey(i), sls[i])
			}
		}
		if got, want := noRevisions(m), noRevisions(fresh.Model(service.Node{})); !reflect.DeepEqual(got, want) {
			t.Fatalf("step %d:\n got %v\nwant %v", step, got, want)
		}
		if last != nil {
			before := map[service.PortName]uint64{}
			for _, sp := range last.Ports {
				before[sp.Name] = sp.Revision
			}
			for _, sp := range m.Ports {
				rev, ok := before[sp.Name]
				if kept := ok && rev == sp.Revision; kept == touched[typesName(sp.Name.Namespace, sp.Name.Name)] {
					t.Fatalf("step %d: %v touched %v, kept its revision %v", step, sp.Name, !kept, kept)
				}
			}
		}
		last = m
	}
}
