package service

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// refCategorize restates kube-proxy's CategorizeEndpoints (topology.go)
// step by step, for one family, as an independent oracle.
func refCategorize(eps []Endpoint, sp *ServicePort, node, zone string) (cluster, local []Endpoint, hasAny bool) {
	external := sp.NodePort != 0 || len(sp.ExternalIPs) > 0 || len(sp.LoadBalancerIPs) > 0
	usesCluster := !sp.InternalPolicyLocal || external
	usesLocal := sp.InternalPolicyLocal || (sp.ExternalPolicyLocal && external)
	isLocal := func(e Endpoint) bool { return e.NodeName == node }
	if len(eps) == 0 {
		return
	}
	if usesCluster {
		mode := ""
		if sp.TopologyAware {
			hasReady, forZone, allHints := false, false, true
			for _, e := range eps {
				if !e.Ready {
					continue
				}
				hasReady = true
				if len(e.ZoneHints) == 0 {
					allHints = false
				} else if slices.Contains(e.ZoneHints, zone) {
					forZone = true
				}
			}
			if hasReady && allHints && forZone {
				mode = "PreferSameZone"
			}
		}
		for _, e := range eps {
			if e.Ready && (mode == "" || slices.Contains(e.ZoneHints, zone)) {
				cluster = append(cluster, e)
			}
		}
		if len(cluster) == 0 {
			for _, e := range eps {
				if e.Serving && e.Terminating {
					cluster = append(cluster, e)
				}
			}
		}
		if len(cluster) > 0 {
			hasAny = true
		}
	}
	if !usesLocal {
		return
	}
	var localReady, localST bool
	for _, e := range eps {
		if e.Ready {
			hasAny = true
			localReady = localReady || isLocal(e)
		} else if e.Serving && e.Terminating {
			hasAny = true
			localST = localST || isLocal(e)
		}
	}
	for _, e := range eps {
		if (localReady && isLocal(e) && e.Ready) || (!localReady && localST && isLocal(e) && e.Serving && e.Terminating) {
			local = append(local, e)
		}
	}
	return
}

func epString(es []Endpoint) string {
	bs := make([]Backend, len(es))
	for i, e := range es {
		bs[i] = Backend{Addr: e.Addr, Port: e.Port}
	}
	return setString(bs)
}

// Random services, compiled, must route every frontend exactly as the
// nftables proxier would with the oracle's lists: cluster IPs go to the
// internal policy's chain or are dropped/rejected; external frontends go
// to the external policy's chain, and local-origin traffic to them is
// short-circuited to the cluster chain under policy Local.
func TestAgainstKubeProxyReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	nodes := []string{"node-a", "node-b", "node-c"}
	zones := []string{"zone-a", "zone-b"}
	m := &Model{Node: Node{Name: "node-a", Zone: "zone-a", Addresses: []packet.Addr{nodeV4}}}
	for s := 0; s < 500; s++ {
		sp := ServicePort{
			Name:                name("ns", fmt.Sprint("svc", s), ""),
			Proto:               packet.ProtoTCP,
			ClusterIPs:          []packet.Addr{packet.AddrFrom4([4]byte{198, 19, byte(s >> 8), byte(s)})},
			Port:                80,
			ExternalPolicyLocal: r.IntN(2) == 0,
			InternalPolicyLocal: r.IntN(3) == 0,
			TopologyAware:       r.IntN(2) == 0,
		}
		switch r.IntN(3) {
		case 0:
			sp.NodePort = uint16(30000 + s)
		case 1:
			sp.LoadBalancerIPs = []packet.Addr{packet.AddrFrom4([4]byte{198, 19, 100 + byte(s>>8), byte(s)})}
		}
		hinted := r.IntN(2) == 0
		for e := range r.IntN(6) {
			ready := r.IntN(3) != 0
			ep := Endpoint{
				Addr:     packet.AddrFrom4([4]byte{198, 18, byte(s >> 8), byte(s)}),
				Port:     uint16(8000 + e),
				Ready:    ready,
				Serving:  ready || r.IntN(2) == 0,
				NodeName: nodes[r.IntN(3)],
			}
			ep.Terminating = !ready && (ep.Serving || r.IntN(2) == 0)
			if hinted && r.IntN(8) != 0 {
				ep.ZoneHints = []string{zones[r.IntN(2)]}
			}
			sp.Endpoints = append(sp.Endpoints, ep)
		}
		m.Ports = append(m.Ports, sp)
	}
	tab := Compile(m, CompileOptions{})
	seen := map[string]int{}
	defer func() { t.Logf("verdicts (and whether the list was a strict subset): %v", seen) }()
	for i := range m.Ports {
		sp := &m.Ports[i]
		cluster, local, hasAny := refCategorize(sp.Endpoints, sp, m.Node.Name, m.Node.Zone)

		check := func(f *Frontend, localOrigin bool, want Verdict, list []Endpoint) {
			t.Helper()
			seen[fmt.Sprint(want, " ", len(list) > 0 && len(list) < len(sp.Endpoints))]++
			if f == nil {
				t.Fatalf("%v: frontend missing", sp.Name)
			}
			if v := f.Verdict(localOrigin); v != want {
				t.Errorf("%v %v localOrigin=%v: verdict %v, want %v (endpoints %+v)", sp.Name, f.Kind, localOrigin, v, want, sp.Endpoints)
			}
			if want != Forward {
				list = nil
			}
			if got, exp := setString(f.Backends(localOrigin)), epString(list); got != exp {
				t.Errorf("%v %v localOrigin=%v: backends %q, want %q (endpoints %+v)", sp.Name, f.Kind, localOrigin, got, exp, sp.Endpoints)
			}
		}
		verdictFor := func(list []Endpoint) Verdict {
			switch {
			case !hasAny:
				return Reject
			case len(list) == 0:
				return Drop
			}
			return Forward
		}

		internal := cluster
		if sp.InternalPolicyLocal {
			internal = local
		}
		f := tab.Lookup(sp.Proto, sp.ClusterIPs[0], sp.Port)
		check(f, false, verdictFor(internal), internal)
		check(f, true, verdictFor(internal), internal)

		var ext *Frontend
		if sp.NodePort != 0 {
			ext = tab.Lookup(sp.Proto, nodeV4, sp.NodePort)
		} else if len(sp.LoadBalancerIPs) > 0 {
			ext = tab.Lookup(sp.Proto, sp.LoadBalancerIPs[0], sp.Port)
		} else {
			continue
		}
		external := cluster
		if sp.ExternalPolicyLocal {
			external = local
		}
		check(ext, false, verdictFor(external), external)
		// Short circuit: local origin uses the cluster chain whenever the
		// service has endpoints at all.
		check(ext, true, verdictFor(cluster), cluster)
	}
}
