package runner

import (
	"net/netip"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/topo"
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
