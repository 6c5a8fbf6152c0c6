package kernelrules

import (
	"fmt"
	"net/netip"
)

// Proto is a service port protocol as kube-proxy writes it.
type Proto string

// Protocols the benchmark uses.
const (
	UDP Proto = "udp"
	TCP Proto = "tcp"
)

// ServiceSet describes Count synthetic ClusterIP services of one protocol.
// Service i listens on VIP(i):Port(i) and every service has the same
// Endpoints, which is what the rule shape needs: kube-proxy writes per
// service and per endpoint chains whether or not backends are shared.
type ServiceSet struct {
	Count int
	Proto Proto
	// VIPBase is the first cluster IP; services take consecutive
	// addresses, and after AddrsPerPort of them the addresses repeat with
	// the next port (see VIP and Port).
	VIPBase netip.Addr
	// BasePort is the port of the first 65,536 services.
	BasePort uint16
	// Endpoints are the backends of every service.
	Endpoints []netip.AddrPort
	// ClusterCIDR is the pod range: traffic from outside it is marked for
	// masquerade, as kube-proxy does with --cluster-cidr.
	ClusterCIDR netip.Prefix
	// ServiceCIDR covers every VIP (nftables' cluster-ips-check drops
	// traffic to unallocated addresses in it).
	ServiceCIDR netip.Prefix
	// Namespace of the synthetic services; "bench" when empty.
	Namespace string
}

// AddrsPerPort is how many consecutive VIPs share one port before the
// layout moves to the next port: a /16 service range holds 65,000 VIPs
// above its first address with room to spare.
const AddrsPerPort = 65000

// Validate reports a set that cannot be laid out.
func (s ServiceSet) Validate() error {
	switch {
	case s.Count < 1:
		return fmt.Errorf("kernelrules: %d services, want at least 1", s.Count)
	case s.Proto != UDP && s.Proto != TCP:
		return fmt.Errorf("kernelrules: protocol %q, want udp or tcp", s.Proto)
	case !s.VIPBase.Is4():
		return fmt.Errorf("kernelrules: VIP base %v is not IPv4", s.VIPBase)
	case len(s.Endpoints) == 0:
		return fmt.Errorf("kernelrules: no endpoints")
	case !s.ClusterCIDR.IsValid() || !s.ServiceCIDR.IsValid():
		return fmt.Errorf("kernelrules: cluster and service CIDRs are required")
	case int(s.BasePort)+(s.Count-1)/AddrsPerPort > 65535:
		return fmt.Errorf("kernelrules: %d services do not fit above port %d", s.Count, s.BasePort)
	}
	last := s.VIP(min(s.Count, AddrsPerPort) - 1)
	if !s.ServiceCIDR.Contains(s.VIPBase) || !s.ServiceCIDR.Contains(last) {
		return fmt.Errorf("kernelrules: VIPs %v-%v leave the service CIDR %v", s.VIPBase, last, s.ServiceCIDR)
	}
	return nil
}

// VIP is the cluster IP of service i.
func (s ServiceSet) VIP(i int) netip.Addr {
	b := s.VIPBase.As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += uint32(i % AddrsPerPort)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Port is the service port of service i.
func (s ServiceSet) Port(i int) uint16 { return s.BasePort + uint16(i/AddrsPerPort) }

// Name is the Service name of service i.
func (s ServiceSet) Name(i int) string { return fmt.Sprintf("svc-%d", i) }

// NS is the namespace of every service.
func (s ServiceSet) NS() string {
	if s.Namespace == "" {
		return "bench"
	}
	return s.Namespace
}

// portName is kube-proxy's ServicePortName string, "ns/name:port".
func (s ServiceSet) portName(i int) string { return s.NS() + "/" + s.Name(i) + ":p" }
