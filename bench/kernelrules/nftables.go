package kernelrules

import (
	"bufio"
	"fmt"
	"io"
)

// NFTTable is the table kube-proxy's nftables mode owns.
const NFTTable = "kube-proxy"

// servicePortID is how the nftables proxier spells a service port inside
// chain names: namespace/name/protocol/port.
func (s ServiceSet) servicePortID(i int) string {
	return fmt.Sprintf("%s/%s/%s/p", s.NS(), s.Name(i), s.Proto)
}

// NFTServiceChain is the service-* chain of service i.
func (s ServiceSet) NFTServiceChain(i int) string {
	id := s.servicePortID(i)
	return "service-" + chainHash(id)[:8] + "-" + id
}

// NFTEndpointChain is the endpoint-* chain of endpoint e of service i.
func (s ServiceSet) NFTEndpointChain(i, e int) string {
	id := s.servicePortID(i) + "__" + endpointString(s.Endpoints[e])
	return "endpoint-" + chainHash(id)[:8] + "-" + id
}

// WriteNFT writes nft -f input that (re)creates table ip kube-proxy in
// kube-proxy's nftables-mode shape: base chains at kube-proxy's hooks and
// priorities, the service-ips verdict map with one element per service,
// a service chain per service that marks traffic from outside the cluster
// CIDR for masquerade and picks an endpoint with numgen, and an endpoint
// chain per endpoint that DNATs.
func (s ServiceSet) WriteNFT(w io.Writer) error {
	if err := s.Validate(); err != nil {
		return err
	}
	b := bufio.NewWriterSize(w, 1<<20)
	p := func(format string, args ...any) { fmt.Fprintf(b, format, args...) }
	t := "ip " + NFTTable

	// Creating then deleting makes the load replace an older table.
	p("add table %s\ndelete table %s\n", t, t)
	p("add table %s { comment \"rules for kube-proxy\" ; }\n", t)

	base := []struct{ name, spec string }{
		{"filter-prerouting", "type filter hook prerouting priority -110 ;"},
		{"filter-input", "type filter hook input priority -110 ;"},
		{"filter-forward", "type filter hook forward priority -110 ;"},
		{"filter-output", "type filter hook output priority -110 ;"},
		{"filter-output-post-dnat", "type filter hook output priority -90 ;"},
		{"nat-prerouting", "type nat hook prerouting priority -100 ;"},
		{"nat-output", "type nat hook output priority -100 ;"},
		{"nat-postrouting", "type nat hook postrouting priority 100 ;"},
	}
	for _, c := range base {
		p("add chain %s %s { %s }\n", t, c.name, c.spec)
	}
	for _, c := range []string{"mark-for-masquerade", "masquerading", "services", "service-endpoints-check",
		"firewall-check", "cluster-ips-check", "nodeport-endpoints-check"} {
		p("add chain %s %s\n", t, c)
	}
	p("add set %s cluster-ips { type ipv4_addr ; comment \"Active ClusterIPs\" ; }\n", t)
	p("add set %s nodeport-ips { type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }\n", t)
	p("add map %s service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }\n", t)
	p("add map %s service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }\n", t)
	p("add map %s no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }\n", t)
	p("add map %s no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ; }\n", t)
	p("add map %s firewall-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ; }\n", t)

	p("add rule %s filter-prerouting ct state new jump firewall-check\n", t)
	p("add rule %s filter-input ct state new jump nodeport-endpoints-check\n", t)
	p("add rule %s filter-input ct state new jump service-endpoints-check\n", t)
	p("add rule %s filter-forward ct state new jump service-endpoints-check\n", t)
	p("add rule %s filter-forward ct state new jump cluster-ips-check\n", t)
	p("add rule %s filter-output ct state new jump service-endpoints-check\n", t)
	p("add rule %s filter-output ct state new jump cluster-ips-check\n", t)
	p("add rule %s filter-output-post-dnat ct state new jump firewall-check\n", t)
	p("add rule %s nat-prerouting jump services\n", t)
	p("add rule %s nat-output jump services\n", t)
	p("add rule %s nat-postrouting jump masquerading\n", t)
	p("add rule %s mark-for-masquerade mark set mark or %s\n", t, MasqMark)
	p("add rule %s masquerading mark and %s == 0 return\n", t, MasqMark)
	p("add rule %s masquerading mark set mark xor %s\n", t, MasqMark)
	p("add rule %s masquerading masquerade fully-random\n", t)
	p("add rule %s services ip daddr . meta l4proto . th dport vmap @service-ips\n", t)
	p("add rule %s services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports\n", t)
	p("add rule %s service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services\n", t)
	p("add rule %s nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports\n", t)
	p("add rule %s firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips\n", t)
	p("add rule %s cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"\n", t)
	p("add rule %s cluster-ips-check ip daddr %s drop comment \"Drop traffic to unallocated ClusterIPs\"\n", t, s.ServiceCIDR)

	proto := string(s.Proto)
	n := len(s.Endpoints)
	for i := range s.Count {
		svc := s.NFTServiceChain(i)
		p("add chain %s %s\n", t, svc)
		for e := range s.Endpoints {
			p("add chain %s %s\n", t, s.NFTEndpointChain(i, e))
		}
		p("add rule %s %s ip daddr %s %s dport %d ip saddr != %s jump mark-for-masquerade\n",
			t, svc, s.VIP(i), proto, s.Port(i), s.ClusterCIDR)
		p("add rule %s %s numgen random mod %d vmap {", t, svc, n)
		for e := range s.Endpoints {
			if e > 0 {
				p(" ,")
			}
			p(" %d : goto %s", e, s.NFTEndpointChain(i, e))
		}
		p(" }\n")
		for e, ep := range s.Endpoints {
			ch := s.NFTEndpointChain(i, e)
			p("add rule %s %s ip saddr %s jump mark-for-masquerade\n", t, ch, ep.Addr())
			p("add rule %s %s meta l4proto %s dnat to %s\n", t, ch, proto, ep)
		}
	}
	// Elements last, as kube-proxy does: the chains they name must exist.
	distinct := min(s.Count, AddrsPerPort)
	for i := 0; i < distinct; i += 1000 {
		p("add element %s cluster-ips {", t)
		for j := i; j < min(distinct, i+1000); j++ {
			if j > i {
				p(" ,")
			}
			p(" %s", s.VIP(j))
		}
		p(" }\n")
	}
	for i := range s.Count {
		p("add element %s service-ips { %s . %s . %d : goto %s }\n", t, s.VIP(i), proto, s.Port(i), s.NFTServiceChain(i))
	}
	return b.Flush()
}
