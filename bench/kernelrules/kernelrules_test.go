package kernelrules

import (
	"bytes"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

func testSet(n, eps int) ServiceSet {
	s := ServiceSet{
		Count: n, Proto: UDP, VIPBase: netip.MustParseAddr("198.19.0.1"), BasePort: 80,
		ClusterCIDR: netip.MustParsePrefix("198.18.0.0/24"), ServiceCIDR: netip.MustParsePrefix("198.19.0.0/16"),
	}
	for i := range eps {
		s.Endpoints = append(s.Endpoints, netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 1, byte(2 + i)}), 9))
	}
	return s
}

func TestLayout(t *testing.T) {
	s := testSet(70000, 1)
	if s.VIP(0) != netip.MustParseAddr("198.19.0.1") || s.VIP(255) != netip.MustParseAddr("198.19.1.0") {
		t.Fatalf("VIPs %v %v", s.VIP(0), s.VIP(255))
	}
	if s.Port(AddrsPerPort-1) != 80 || s.Port(AddrsPerPort) != 81 || s.VIP(AddrsPerPort) != s.VIP(0) {
		t.Fatalf("service %d at %v:%d, want %v:81", AddrsPerPort, s.VIP(AddrsPerPort), s.Port(AddrsPerPort), s.VIP(0))
	}
	big := testSet(100_000, 2)
	if err := big.Validate(); err != nil {
		t.Fatalf("100,000 services do not fit the /16: %v", err)
	}
	// Every (VIP, port) is distinct.
	seen := map[netip.AddrPort]bool{}
	for i := range s.Count {
		ap := netip.AddrPortFrom(s.VIP(i), s.Port(i))
		if seen[ap] {
			t.Fatalf("service %d repeats %v", i, ap)
		}
		seen[ap] = true
	}
}

func TestValidate(t *testing.T) {
	good := testSet(3, 2)
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	bad := []func(*ServiceSet){
		func(s *ServiceSet) { s.Count = 0 },
		func(s *ServiceSet) { s.Proto = "sctp" },
		func(s *ServiceSet) { s.Endpoints = nil },
		func(s *ServiceSet) { s.VIPBase = netip.MustParseAddr("2001:db8::1") },
		func(s *ServiceSet) { s.ServiceCIDR = netip.MustParsePrefix("198.19.0.0/31") },
		func(s *ServiceSet) { s.ClusterCIDR = netip.Prefix{} },
	}
	for i, f := range bad {
		s := testSet(3, 2)
		f(&s)
		if err := s.Validate(); err == nil {
			t.Errorf("case %d: invalid set accepted", i)
		}
		var b bytes.Buffer
		if err := s.WriteIPTables(&b); err == nil {
			t.Errorf("case %d: WriteIPTables accepted an invalid set", i)
		}
	}
}

func TestProbability(t *testing.T) {
	if Probability(2) != "0.5000000000" || Probability(3) != "0.3333333333" {
		t.Fatalf("%s %s", Probability(2), Probability(3))
	}
}

// iptRules parses "-A CHAIN rest" lines per table.
func iptRules(t *testing.T, text string) map[string]map[string][]string {
	t.Helper()
	tables := map[string]map[string][]string{}
	var cur map[string][]string
	declared := map[string]bool{}
	for _, line := range strings.Split(text, "\n") {
		switch {
		case strings.HasPrefix(line, "*"):
			cur = map[string][]string{}
			tables[line[1:]] = cur
			declared = map[string]bool{}
		case strings.HasPrefix(line, ":"):
			declared[strings.Fields(line[1:])[0]] = true
		case strings.HasPrefix(line, "-A "):
			f := strings.SplitN(line[3:], " ", 2)
			builtin := f[0] == "PREROUTING" || f[0] == "INPUT" || f[0] == "FORWARD" || f[0] == "OUTPUT" || f[0] == "POSTROUTING"
			if !builtin && !declared[f[0]] {
				t.Fatalf("rule for undeclared chain %s", f[0])
			}
			cur[f[0]] = append(cur[f[0]], f[1])
		}
	}
	return tables
}

var jumpRe = regexp.MustCompile(`-j (\S+)`)

func jump(rule string) string {
	m := jumpRe.FindStringSubmatch(rule)
	if m == nil {
		return ""
	}
	return m[1]
}

// TestIPTablesTrace follows a packet to each service through the nat table
// the way the kernel would and checks where it ends, kube-proxy
// tracer-style.
func TestIPTablesTrace(t *testing.T) {
	s := testSet(5, 3)
	var b bytes.Buffer
	if err := s.WriteIPTables(&b); err != nil {
		t.Fatal(err)
	}
	tables := iptRules(t, b.String())
	nat, filter := tables["nat"], tables["filter"]
	if nat == nil || filter == nil || strings.Count(b.String(), "COMMIT\n") != 2 {
		t.Fatal("want a filter and a nat table, each committed")
	}
	if jump(nat["PREROUTING"][0]) != "KUBE-SERVICES" || jump(nat["POSTROUTING"][0]) != "KUBE-POSTROUTING" {
		t.Fatalf("hooks: %v %v", nat["PREROUTING"], nat["POSTROUTING"])
	}
	svcRules := nat["KUBE-SERVICES"]
	if len(svcRules) != s.Count+1 || jump(svcRules[len(svcRules)-1]) != "KUBE-NODEPORTS" {
		t.Fatalf("KUBE-SERVICES has %d rules, want one per service and the nodeports rule last", len(svcRules))
	}
	for i := range s.Count {
		// Find the KUBE-SERVICES rule matching this VIP and port.
		want := "-d " + s.VIP(i).String() + "/32 --dport " + strconv.Itoa(int(s.Port(i)))
		var svc string
		for _, r := range svcRules {
			if strings.Contains(r, want) {
				svc = jump(r)
			}
		}
		if svc != s.SvcChain(i) {
			t.Fatalf("service %d: KUBE-SERVICES jumps to %q, want %q", i, svc, s.SvcChain(i))
		}
		rules := nat[svc]
		if len(rules) != 1+len(s.Endpoints) {
			t.Fatalf("%s has %d rules", svc, len(rules))
		}
		if !strings.Contains(rules[0], "! -s "+s.ClusterCIDR.String()) || jump(rules[0]) != "KUBE-MARK-MASQ" {
			t.Fatalf("first rule of %s does not mark off-cluster traffic for masquerade: %s", svc, rules[0])
		}
		// Probabilities 1/3, 1/2, then unconditional: each endpoint 1/3.
		wantProb := []string{"0.3333333333", "0.5000000000", ""}
		for e, r := range rules[1:] {
			if wantProb[e] == "" && strings.Contains(r, "statistic") || wantProb[e] != "" && !strings.Contains(r, "--probability "+wantProb[e]) {
				t.Fatalf("%s endpoint %d: %s", svc, e, r)
			}
			sep := jump(r)
			if sep != s.SepChain(i, e) {
				t.Fatalf("%s endpoint %d jumps to %s", svc, e, sep)
			}
			sr := nat[sep]
			if len(sr) != 2 || jump(sr[0]) != "KUBE-MARK-MASQ" || !strings.HasSuffix(sr[1], "-j DNAT --to-destination "+s.Endpoints[e].String()) {
				t.Fatalf("%s: %v", sep, sr)
			}
		}
	}
	if got := jump(nat["KUBE-MARK-MASQ"][0]); got != "MARK" || !strings.Contains(nat["KUBE-MARK-MASQ"][0], "--or-mark "+MasqMark) {
		t.Fatalf("KUBE-MARK-MASQ: %v", nat["KUBE-MARK-MASQ"])
	}
	if !strings.Contains(strings.Join(nat["KUBE-POSTROUTING"], "\n"), "MASQUERADE --random-fully") {
		t.Fatal("no masquerade in KUBE-POSTROUTING")
	}
	if len(filter["KUBE-FORWARD"]) != 3 {
		t.Fatalf("KUBE-FORWARD: %v", filter["KUBE-FORWARD"])
	}
	// Chain names are unique per service and endpoint.
	names := map[string]bool{}
	for i := range s.Count {
		names[s.SvcChain(i)] = true
		for e := range s.Endpoints {
			names[s.SepChain(i, e)] = true
		}
	}
	if len(names) != s.Count*(1+len(s.Endpoints)) {
		t.Fatalf("%d distinct chain names", len(names))
	}
	if len(s.SvcChain(0)) != len("KUBE-SVC-")+16 {
		t.Fatalf("chain name %q", s.SvcChain(0))
	}
}

func TestNFTShape(t *testing.T) {
	s := testSet(4, 2)
	var b bytes.Buffer
	if err := s.WriteNFT(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	lines := strings.Split(strings.TrimSpace(text), "\n")
	if lines[0] != "add table ip kube-proxy" || lines[1] != "delete table ip kube-proxy" {
		t.Fatalf("the load does not replace the table: %q", lines[:2])
	}
	for _, want := range []string{
		"add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
		"add rule ip kube-proxy nat-prerouting jump services",
		"add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
		"add rule ip kube-proxy masquerading masquerade fully-random",
		"add rule ip kube-proxy cluster-ips-check ip daddr 198.19.0.0/16 drop",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("missing %q", want)
		}
	}
	// One verdict map element per service, pointing at its chain, and the
	// chain's rules: masquerade mark, numgen over the endpoints, DNAT.
	for i := range s.Count {
		elem := "add element ip kube-proxy service-ips { " + s.VIP(i).String() + " . udp . 80 : goto " + s.NFTServiceChain(i) + " }"
		if strings.Count(text, elem) != 1 {
			t.Fatalf("service %d: element %q appears %d times", i, elem, strings.Count(text, elem))
		}
		var rules []string
		for _, l := range lines {
			if strings.HasPrefix(l, "add rule ip kube-proxy "+s.NFTServiceChain(i)+" ") {
				rules = append(rules, l)
			}
		}
		if len(rules) != 2 || !strings.Contains(rules[0], "ip saddr != 198.18.0.0/24 jump mark-for-masquerade") ||
			!strings.Contains(rules[1], "numgen random mod 2 vmap { 0 : goto "+s.NFTEndpointChain(i, 0)+" , 1 : goto "+s.NFTEndpointChain(i, 1)+" }") {
			t.Fatalf("service chain %d rules: %q", i, rules)
		}
		for e, ep := range s.Endpoints {
			if !strings.Contains(text, "add rule ip kube-proxy "+s.NFTEndpointChain(i, e)+" meta l4proto udp dnat to "+ep.String()+"\n") {
				t.Fatalf("no DNAT to %v in %s", ep, s.NFTEndpointChain(i, e))
			}
		}
	}
	// Chains are declared before any element names them.
	firstElem := strings.Index(text, "add element ip kube-proxy service-ips")
	lastChain := strings.LastIndex(text, "add chain ")
	if firstElem < lastChain {
		t.Fatal("a verdict map element comes before the chain it names")
	}
	if !strings.Contains(text, "cluster-ips { 198.19.0.1 , 198.19.0.2 , 198.19.0.3 , 198.19.0.4 }") {
		t.Fatal("cluster-ips set does not list the four VIPs")
	}
}

func TestSizesScaleLinearly(t *testing.T) {
	size := func(n int) (int, int) {
		var a, b bytes.Buffer
		s := testSet(n, 2)
		if err := s.WriteIPTables(&a); err != nil {
			t.Fatal(err)
		}
		if err := s.WriteNFT(&b); err != nil {
			t.Fatal(err)
		}
		return strings.Count(a.String(), "\n-A ") + strings.Count(a.String(), "\n:"), strings.Count(b.String(), "\n")
	}
	i1, n1 := size(1000)
	i2, n2 := size(2000)
	// Per service: iptables 1 service rule + 3 SVC rules + 2x2 SEP rules
	// and 3 chains; nftables 3 chains, 6 rules, 1 element.
	if d := i2 - i1; d != 1000*11 {
		t.Fatalf("iptables grows by %d lines per 1000 services, want 11000", d)
	}
	if d := n2 - n1; d < 1000*10 || d > 1000*10+2 {
		t.Fatalf("nft grows by %d lines per 1000 services, want about 10000", d)
	}
}

func TestManifests(t *testing.T) {
	s := testSet(3, 2)
	var b bytes.Buffer
	if err := s.WriteManifests(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	if n := strings.Count(text, "kind: Service\n"); n != 3 {
		t.Fatalf("%d Services", n)
	}
	if n := strings.Count(text, "kind: EndpointSlice\n"); n != 3 {
		t.Fatalf("%d EndpointSlices", n)
	}
	for _, want := range []string{"clusterIP: 198.19.0.3\n", "kubernetes.io/service-name: svc-2\n", "- addresses: [\"198.18.1.3\"]\n", "protocol: UDP\n"} {
		if !strings.Contains(text, want) {
			t.Errorf("missing %q", want)
		}
	}
}
