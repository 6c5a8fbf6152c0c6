package kernelrules

import (
	"bufio"
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"io"
	"net/netip"
)

// MasqMark is kube-proxy's default masquerade mark bit (--iptables-masquerade-bit 14).
const MasqMark = "0x4000"

// chainHash is a 16-character base32 digest, the way kube-proxy derives
// KUBE-SVC-/KUBE-SEP- names from the service port (and endpoint).
func chainHash(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
	}
	return base32.StdEncoding.EncodeToString(h.Sum(nil))[:16]
}

// SvcChain is the KUBE-SVC- chain of service i.
func (s ServiceSet) SvcChain(i int) string {
	return "KUBE-SVC-" + chainHash(s.portName(i), string(s.Proto))
}

// SepChain is the KUBE-SEP- chain of endpoint e of service i.
func (s ServiceSet) SepChain(i, e int) string {
	return "KUBE-SEP-" + chainHash(s.portName(i), string(s.Proto), s.Endpoints[e].String())
}

// WriteIPTables writes iptables-restore input for the filter and nat
// tables in kube-proxy's iptables-mode shape. Only KUBE-* chains are
// declared; the built-in chains get one jump each, appended to whatever they
// hold (feed it with iptables-restore --noflush into a fresh namespace).
func (s ServiceSet) WriteIPTables(w io.Writer) error {
	if err := s.Validate(); err != nil {
		return err
	}
	b := bufio.NewWriterSize(w, 1<<20)
	p := func(format string, args ...any) { fmt.Fprintf(b, format, args...) }

	p("*filter\n")
	for _, c := range []string{"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL", "KUBE-FIREWALL"} {
		p(":%s - [0:0]\n", c)
	}
	p("-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n")
	p("-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n")
	p("-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally visible service portals\" -j KUBE-EXTERNAL-SERVICES\n")
	p("-A INPUT -j KUBE-FIREWALL\n")
	p("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n")
	p("-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n")
	p("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	p("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally visible service portals\" -j KUBE-EXTERNAL-SERVICES\n")
	p("-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n")
	p("-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	p("-A OUTPUT -j KUBE-FIREWALL\n")
	p("-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n")
	p("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n")
	p("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark %s/%s -j ACCEPT\n", MasqMark, MasqMark)
	p("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n")
	p("COMMIT\n")

	p("*nat\n")
	for _, c := range []string{"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"} {
		p(":%s - [0:0]\n", c)
	}
	for i := range s.Count {
		p(":%s - [0:0]\n", s.SvcChain(i))
		for e := range s.Endpoints {
			p(":%s - [0:0]\n", s.SepChain(i, e))
		}
	}
	p("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	p("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	p("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n")
	p("-A KUBE-POSTROUTING -m mark ! --mark %s/%s -j RETURN\n", MasqMark, MasqMark)
	p("-A KUBE-POSTROUTING -j MARK --xor-mark %s\n", MasqMark)
	p("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n")
	p("-A KUBE-MARK-MASQ -j MARK --or-mark %s\n", MasqMark)
	proto := string(s.Proto)
	for i := range s.Count {
		p("-A KUBE-SERVICES -m comment --comment \"%s cluster IP\" -m %s -p %s -d %s/32 --dport %d -j %s\n",
			s.portName(i), proto, proto, s.VIP(i), s.Port(i), s.SvcChain(i))
	}
	p("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n")
	for i := range s.Count {
		name, svc := s.portName(i), s.SvcChain(i)
		p("-A %s -m comment --comment \"%s cluster IP\" -m %s -p %s -d %s/32 --dport %d ! -s %s -j KUBE-MARK-MASQ\n",
			svc, name, proto, proto, s.VIP(i), s.Port(i), s.ClusterCIDR)
		n := len(s.Endpoints)
		for e, ep := range s.Endpoints {
			// kube-proxy's choice: endpoint e of n is taken with
			// probability 1/(n-e) among those not yet passed over, the
			// last one unconditionally.
			if e < n-1 {
				p("-A %s -m comment --comment \"%s -> %s\" -m statistic --mode random --probability %s -j %s\n",
					svc, name, ep, Probability(n-e), s.SepChain(i, e))
			} else {
				p("-A %s -m comment --comment \"%s -> %s\" -j %s\n", svc, name, ep, s.SepChain(i, e))
			}
		}
		for e, ep := range s.Endpoints {
			sep := s.SepChain(i, e)
			p("-A %s -m comment --comment %s -s %s/32 -j KUBE-MARK-MASQ\n", sep, name, ep.Addr())
			p("-A %s -m comment --comment %s -m %s -p %s -j DNAT --to-destination %s\n", sep, name, proto, proto, ep)
		}
	}
	p("COMMIT\n")
	return b.Flush()
}

// Probability is the string kube-proxy writes for a 1-in-n choice: ten
// decimal places.
func Probability(n int) string { return fmt.Sprintf("%0.10f", 1.0/float64(n)) }

// endpointString is addr:port with the slash form nftables chain names use.
func endpointString(ep netip.AddrPort) string { return fmt.Sprintf("%s/%d", ep.Addr(), ep.Port()) }
