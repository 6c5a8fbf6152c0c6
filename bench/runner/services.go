package runner

import (
	"net/netip"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// Ports of the benchmark's services and endpoints.
const (
	UDPServicePort  = 80
	UDPEndpointPort = 9
	TCPServicePort  = 8080
	TCPEndpointPort = 8080
)

// VIPBase is the cluster IP of service 0.
var VIPBase = netip.MustParseAddr("198.19.0.1")

// KubeProxyVIPBase is the cluster IP of service 0 on the real kube-proxy
// paths: their API server gives VIPBase, the first address of the service
// range, to its own kubernetes Service.
var KubeProxyVIPBase = VIPBase.Next()

// Services is the one description of the synthetic services every path
// gets: n services with the sink's two addresses as endpoints.
func Services(n int, proto kernelrules.Proto) kernelrules.ServiceSet {
	port, epPort := uint16(UDPServicePort), uint16(UDPEndpointPort)
	if proto == kernelrules.TCP {
		port, epPort = TCPServicePort, TCPEndpointPort
	}
	var eps []netip.AddrPort
	for _, a := range topo.SinkAddrs {
		eps = append(eps, netip.AddrPortFrom(a, epPort))
	}
	return kernelrules.ServiceSet{
		Count: n, Proto: proto, VIPBase: VIPBase, BasePort: port, Endpoints: eps,
		ClusterCIDR: topo.PodCIDR, ServiceCIDR: topo.ServiceCIDR,
	}
}

// Model turns a ServiceSet into xdproxy's service model.
func Model(s kernelrules.ServiceSet) *service.Model {
	proto := packet.ProtoUDP
	if s.Proto == kernelrules.TCP {
		proto = packet.ProtoTCP
	}
	m := &service.Model{Node: service.Node{Name: "bench-node"}, Ports: make([]service.ServicePort, 0, s.Count)}
	eps := make([]service.Endpoint, 0, len(s.Endpoints))
	for _, ep := range s.Endpoints {
		eps = append(eps, service.Endpoint{Addr: packet.AddrFromNetip(ep.Addr()), Port: ep.Port(), Ready: true, Serving: true, NodeName: "bench-node"})
	}
	for i := range s.Count {
		m.Ports = append(m.Ports, service.ServicePort{
			Name:       service.PortName{Namespace: s.NS(), Name: s.Name(i), Port: "p"},
			Proto:      proto,
			ClusterIPs: []packet.Addr{packet.AddrFromNetip(s.VIP(i))},
			Port:       s.Port(i),
			Endpoints:  eps,
		})
	}
	return m
}
