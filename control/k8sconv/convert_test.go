package k8sconv

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// basePort is what makeService's port converts to.
func basePort(ns, name string) service.ServicePort {
	return service.ServicePort{
		Name:       service.PortName{Namespace: ns, Name: name, Port: "p80"},
		Proto:      packet.ProtoTCP,
		ClusterIPs: addrs("172.30.0.1"),
		Port:       80,
	}
}

func TestServiceConversion(t *testing.T) {
	testCases := []struct {
		name      string
		proxyName string
		scheduler service.Scheduler // Options.DefaultScheduler
		svc       *v1.Service
		want      []service.ServicePort // nil: skipped
		wantLog   string                // substring of the one log line; "" means none
	}{
		{
			name: "cluster IP, one port",
			svc:  makeService("ns1", "a"),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name: "two ports keep spec order, unnamed port and UDP",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{{Port: 53, Protocol: v1.ProtocolUDP}, {Name: "t", Port: 53}}
			}),
			want: []service.ServicePort{
				func() service.ServicePort {
					p := basePort("ns1", "a")
					p.Name.Port, p.Proto, p.Port = "", packet.ProtoUDP, 53
					return p
				}(),
				func() service.ServicePort {
					p := basePort("ns1", "a")
					p.Name.Port, p.Port = "t", 53
					return p
				}(),
			},
		},
		{
			name: "headless (clusterIP None) is skipped",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} }),
		},
		{
			name: "no cluster IP is skipped",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "", nil }),
		},
		{
			name: "only spec.clusterIP set (old object) is used",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIPs = nil }),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name: "ExternalName is skipped even with a cluster IP",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName }),
		},
		{
			name: "headless label is skipped",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Labels = map[string]string{v1.IsHeadlessService: ""}
			}),
		},
		{
			name: "service-proxy-name of another proxy is skipped",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Labels = map[string]string{LabelServiceProxyName: "other"}
			}),
		},
		{
			name: "service-proxy-name naming us is kept",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Labels = map[string]string{LabelServiceProxyName: "xdproxy"}
			}),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name:      "configured proxy name",
			proxyName: "edge",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Labels = map[string]string{LabelServiceProxyName: "edge"}
			}),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name:      "default name is not ours when configured otherwise",
			proxyName: "edge",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Labels = map[string]string{LabelServiceProxyName: "xdproxy"}
			}),
		},
		{
			name: "NodePort",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30080
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.NodePort = 30080
				return p
			}()},
		},
		{
			name: "LoadBalancer: VIP and unset ipMode programmed, Proxy and hostname not; ETP Local with health check",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.Ports[0].NodePort = 30080
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 30999
				s.Spec.LoadBalancerSourceRanges = []string{" 198.18.0.0/16 ", "198.19.1.7/24"}
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{
					{IP: "198.18.100.1"},
					{IP: "198.18.100.2", IPMode: ptr(v1.LoadBalancerIPModeVIP)},
					{IP: "198.18.100.3", IPMode: ptr(v1.LoadBalancerIPModeProxy)},
					{Hostname: "lb.example"},
				}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.NodePort = 30080
				p.LoadBalancerIPs = addrs("198.18.100.1", "198.18.100.2")
				p.SourceRanges = prefixes("198.18.0.0/16", "198.19.1.0/24")
				p.ExternalPolicyLocal = true
				p.HealthCheckNodePort = 30999
				return p
			}()},
		},
		{
			name: "ETP Local on a ClusterIP service without external IPs means nothing",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 30999
			}),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name: "ETP Local on a ClusterIP service with external IPs; no health check port",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.ExternalIPs = []string{"198.18.5.5"}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.ExternalIPs = addrs("198.18.5.5")
				p.ExternalPolicyLocal = true
				return p
			}()},
		},
		{
			name: "ITP Local",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.InternalTrafficPolicy = ptr(v1.ServiceInternalTrafficPolicyLocal)
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.InternalPolicyLocal = true
				return p
			}()},
		},
		{
			name: "ClientIP affinity without config gets the default timeout",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP }),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.AffinityTimeout = 10800 * time.Second
				return p
			}()},
		},
		{
			name: "ClientIP affinity with timeout",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr[int32](60)}}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.AffinityTimeout = time.Minute
				return p
			}()},
		},
		{
			name: "dual-stack keeps both cluster IPs and external IPs of both families",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"172.30.0.1", "fd00:30::1"}
				s.Spec.ExternalIPs = []string{"198.18.5.5", "2001:db8::5"}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.ClusterIPs = addrs("172.30.0.1", "fd00:30::1")
				p.ExternalIPs = addrs("198.18.5.5", "2001:db8::5")
				return p
			}()},
		},
		{
			name: "single-stack drops external and LB IPs of the other family",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.ExternalIPs = []string{"198.18.5.5", "2001:db8::5"}
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "2001:db8::7"}}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.ExternalIPs = addrs("198.18.5.5")
				return p
			}()},
		},
		{
			name: "trafficDistribution PreferClose",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.TrafficDistribution = ptr(v1.ServiceTrafficDistributionPreferClose)
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.TopologyAware = true
				return p
			}()},
		},
		{
			name: "topology-mode annotation Auto",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Auto"}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.TopologyAware = true
				return p
			}()},
		},
		{
			name: "topology-mode annotation Disabled",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Disabled"}
			}),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name: "scheduler annotation maglev",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationScheduler: "maglev"}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.Scheduler = service.Maglev
				return p
			}()},
		},
		{
			name: "scheduler annotation roundrobin",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationScheduler: "RoundRobin"}
			}),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.Scheduler = service.RoundRobin
				return p
			}()},
		},
		{
			name: "unknown scheduler falls back to random and is logged",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationScheduler: "fastest"}
			}),
			want:    []service.ServicePort{basePort("ns1", "a")},
			wantLog: `unknown scheduler \"fastest\"`,
		},
		{
			name:      "configured default scheduler applies without the annotation",
			scheduler: service.Maglev,
			svc:       makeService("ns1", "a"),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.Scheduler = service.Maglev
				return p
			}()},
		},
		{
			name:      "annotation random overrides the configured default",
			scheduler: service.Maglev,
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationScheduler: "random"}
			}),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
		{
			name: "SCTP port is dropped and logged; the TCP port stays",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "s", Port: 9, Protocol: v1.ProtocolSCTP})
			}),
			want:    []service.ServicePort{basePort("ns1", "a")},
			wantLog: "protocol SCTP is not forwarded",
		},
		{
			name:    "malformed cluster IP skips the service",
			svc:     makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"172.30.0.300"} }),
			wantLog: `malformed IP \"172.30.0.300\"`,
		},
		{
			name: "malformed external IP loses only itself (more in TestMalformedEntriesLoseOnlyThemselves)",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.ExternalIPs = []string{"nope", "198.18.5.5"} }),
			want: []service.ServicePort{func() service.ServicePort {
				p := basePort("ns1", "a")
				p.ExternalIPs = addrs("198.18.5.5")
				return p
			}()},
			wantLog: `Service partly used`,
		},
		{
			name: "malformed healthCheckNodePort still skips the service",
			svc: makeService("ns1", "a", func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 70000
			}),
			wantLog: "Service skipped",
		},
		{
			name:    "port out of range skips the service",
			svc:     makeService("ns1", "a", func(s *v1.Service) { s.Spec.Ports[0].Port = 70000 }),
			wantLog: "port 70000 out of range",
		},
		{
			name: "legacy IPv4 with leading zeros is read as decimal, like kube-proxy",
			svc:  makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"172.030.000.001"} }),
			want: []service.ServicePort{basePort("ns1", "a")},
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			c, logs := newTestConverter(t, Options{ProxyName: tc.proxyName, DefaultScheduler: tc.scheduler})
			got := c.Service(tc.svc)
			if tc.want == nil {
				if got != nil {
					t.Fatalf("got %+v, want the service skipped", got.Ports)
				}
			} else {
				if got == nil {
					t.Fatalf("service skipped; logs: %q", logs.lines())
				}
				if got.Key.Namespace != tc.svc.Namespace || got.Key.Name != tc.svc.Name {
					t.Errorf("key %v", got.Key)
				}
				if !reflect.DeepEqual(got.Ports, tc.want) {
					t.Errorf("ports:\n got %+v\nwant %+v", got.Ports, tc.want)
				}
			}
			lines := logs.lines()
			switch {
			case tc.wantLog == "" && len(lines) != 0:
				t.Errorf("unexpected log: %q", lines)
			case tc.wantLog != "" && (len(lines) != 1 || !strings.Contains(lines[0], tc.wantLog)):
				t.Errorf("log %q, want one line containing %q", lines, tc.wantLog)
			case tc.wantLog != "" && !strings.Contains(lines[0], "object=ns1/a"):
				t.Errorf("log %q does not name the object", lines[0])
			}
		})
	}
}

func TestSliceConversion(t *testing.T) {
	testCases := []struct {
		name    string
		slice   *discovery.EndpointSlice
		want    *Slice
		wantLog string
	}{
		{
			name: "conditions, topology and sorting",
			slice: makeSlice("ns1", "a-1", "a", withEndpoints(
				ep("10.0.0.2", func(e *discovery.Endpoint) {
					e.Conditions = discovery.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}
					e.NodeName, e.Zone = ptr("n2"), ptr("z2")
				}),
				ep("10.0.0.1", func(e *discovery.Endpoint) {
					e.NodeName, e.Zone = ptr("n1"), ptr("z1")
					e.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "z3"}, {Name: "z1"}}}
				}),
				ep("10.0.0.3", func(e *discovery.Endpoint) { e.Conditions.Ready = ptr(false) }),
			)),
			want: &Slice{
				Service: typesName("ns1", "a"),
				Ports:   []SlicePort{{Name: "p80", Proto: packet.ProtoTCP, Port: 8080}},
				Endpoints: []service.Endpoint{
					// nil ready means ready; nil serving follows ready.
					{Addr: packet.MustParseAddr("10.0.0.1"), Ready: true, Serving: true, NodeName: "n1", Zone: "z1", ZoneHints: []string{"z1", "z3"}},
					{Addr: packet.MustParseAddr("10.0.0.2"), Serving: true, Terminating: true, NodeName: "n2", Zone: "z2"},
					{Addr: packet.MustParseAddr("10.0.0.3")},
				},
			},
		},
		{
			name: "missing port name and protocol default to unnamed TCP",
			slice: makeSlice("ns1", "a-1", "a", func(es *discovery.EndpointSlice) {
				es.Ports = []discovery.EndpointPort{{Port: ptr[int32](53), Protocol: ptr(v1.ProtocolUDP)}, {Port: ptr[int32](80)}}
			}),
			want: &Slice{
				Service: typesName("ns1", "a"),
				Ports:   []SlicePort{{Proto: packet.ProtoUDP, Port: 53}, {Proto: packet.ProtoTCP, Port: 80}},
			},
		},
		{
			name: "IPv6 slice drops an IPv4 address",
			slice: makeSlice("ns1", "a-1", "a", func(es *discovery.EndpointSlice) { es.AddressType = discovery.AddressTypeIPv6 },
				withEndpoints(ep("fd00::1"), ep("10.0.0.1"))),
			want: &Slice{
				Service:   typesName("ns1", "a"),
				Ports:     []SlicePort{{Name: "p80", Proto: packet.ProtoTCP, Port: 8080}},
				Endpoints: []service.Endpoint{{Addr: packet.MustParseAddr("fd00::1"), Ready: true, Serving: true}},
			},
			wantLog: "is not of addressType IPv6",
		},
		{
			name:  "malformed endpoint address drops that endpoint only",
			slice: makeSlice("ns1", "a-1", "a", withEndpoints(ep("10.0.0.1"), ep("10.0.0"))),
			want: &Slice{
				Service:   typesName("ns1", "a"),
				Ports:     []SlicePort{{Name: "p80", Proto: packet.ProtoTCP, Port: 8080}},
				Endpoints: []service.Endpoint{{Addr: packet.MustParseAddr("10.0.0.1"), Ready: true, Serving: true}},
			},
			wantLog: `malformed IP \"10.0.0\"`,
		},
		{
			name:  "FQDN slice is ignored quietly",
			slice: makeSlice("ns1", "a-1", "a", func(es *discovery.EndpointSlice) { es.AddressType = discovery.AddressTypeFQDN }),
		},
		{
			name:  "headless slice is ignored",
			slice: makeSlice("ns1", "a-1", "a", func(es *discovery.EndpointSlice) { es.Labels[v1.IsHeadlessService] = "" }),
		},
		{
			name:    "slice without service name is skipped and logged",
			slice:   makeSlice("ns1", "a-1", "", func(es *discovery.EndpointSlice) { delete(es.Labels, discovery.LabelServiceName) }),
			wantLog: "no kubernetes.io/service-name label",
		},
		{
			name: "port 0 and SCTP ports are dropped",
			slice: makeSlice("ns1", "a-1", "a", func(es *discovery.EndpointSlice) {
				es.Ports = append(es.Ports,
					discovery.EndpointPort{Name: ptr("z"), Port: ptr[int32](0)},
					discovery.EndpointPort{Name: ptr("s"), Port: ptr[int32](9), Protocol: ptr(v1.ProtocolSCTP)})
			}),
			want: &Slice{
				Service: typesName("ns1", "a"),
				Ports:   []SlicePort{{Name: "p80", Proto: packet.ProtoTCP, Port: 8080}},
			},
			wantLog: "port 0 out of range",
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			c, logs := newTestConverter(t, Options{})
			got := c.EndpointSlice(tc.slice)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("\n got %+v\nwant %+v", got, tc.want)
			}
			lines := logs.lines()
			switch {
			case tc.wantLog == "" && len(lines) != 0:
				t.Errorf("unexpected log: %q", lines)
			case tc.wantLog != "" && (len(lines) != 1 || !strings.Contains(lines[0], tc.wantLog)):
				t.Errorf("log %q, want one line containing %q", lines, tc.wantLog)
			}
		})
	}
}

func TestProblemsLoggedOncePerResourceVersion(t *testing.T) {
	c, logs := newTestConverter(t, Options{})
	bad := makeService("ns1", "a", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"bogus"} })
	for range 3 {
		if c.Service(bad) != nil {
			t.Fatal("bad service converted")
		}
	}
	if n := len(logs.lines()); n != 1 {
		t.Fatalf("%d log lines after three conversions of one version, want 1", n)
	}
	bad2 := bad.DeepCopy()
	bad2.ResourceVersion = "2"
	c.Service(bad2)
	c.Service(bad2)
	if n := len(logs.lines()); n != 2 {
		t.Fatalf("%d log lines after a new resourceVersion, want 2", n)
	}
	c.Forget("Service", "ns1", "a")
	c.Service(bad2)
	if n := len(logs.lines()); n != 3 {
		t.Fatalf("%d log lines after Forget, want 3", n)
	}
	// Other objects are unaffected by a bad one.
	if c.Service(makeService("ns1", "b")) == nil {
		t.Fatal("good service skipped")
	}
}

func TestMalformedEntriesLoseOnlyThemselves(t *testing.T) {
	// lb makes a LoadBalancer service with node port 30080 and ingress IPs.
	lb := func(ingress ...string) func(*v1.Service) {
		return func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			s.Spec.Ports[0].NodePort = 30080
			for _, ip := range ingress {
				s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{IP: ip})
			}
		}
	}
	dualStack := func(s *v1.Service) { s.Spec.ClusterIPs = []string{"172.30.0.1", "fd00:30::1"} }
	testCases := []struct {
		name    string
		tweaks  []func(*v1.Service)
		want    func(*service.ServicePort) // applied to basePort
		wantLog []string                   // substrings of the one log line; none: no line
	}{
		{
			name: "externalIPs: a malformed entry among good ones",
			tweaks: []func(*v1.Service){func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"198.18.5.5", "198.18.5.256", "198.18.5.6"}
			}},
			want:    func(p *service.ServicePort) { p.ExternalIPs = addrs("198.18.5.5", "198.18.5.6") },
			wantLog: []string{"Service partly used", `spec.externalIPs[1]: malformed IP \"198.18.5.256\"; entry skipped`},
		},
		{
			name:    "externalIPs: all malformed leaves the service without external IPs",
			tweaks:  []func(*v1.Service){func(s *v1.Service) { s.Spec.ExternalIPs = []string{"nope", "fe80::1%eth0", "0.0.0.0"} }},
			want:    func(p *service.ServicePort) {},
			wantLog: []string{"spec.externalIPs[0]", "spec.externalIPs[1]: malformed IP", "zones are not allowed", "spec.externalIPs[2]: unspecified IP"},
		},
		{
			name:   "externalIPs: an empty string is ignored quietly, as kube-proxy does",
			tweaks: []func(*v1.Service){func(s *v1.Service) { s.Spec.ExternalIPs = []string{"", "198.18.5.5"} }},
			want:   func(p *service.ServicePort) { p.ExternalIPs = addrs("198.18.5.5") },
		},
		{
			name:   "ingress IP: a malformed entry among good ones",
			tweaks: []func(*v1.Service){lb("198.18.100.1", "198.18.100", "198.18.100.2")},
			want: func(p *service.ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerIPs = addrs("198.18.100.1", "198.18.100.2")
			},
			wantLog: []string{`status.loadBalancer.ingress[1].ip: malformed IP \"198.18.100\"; entry skipped`},
		},
		{
			name:    "ingress IP: the only one malformed keeps the node port",
			tweaks:  []func(*v1.Service){lb("::")},
			want:    func(p *service.ServicePort) { p.NodePort = 30080 },
			wantLog: []string{"status.loadBalancer.ingress[0].ip: unspecified IP"},
		},
		{
			name: "source ranges: a malformed entry among good ones of the family",
			tweaks: []func(*v1.Service){lb("198.18.100.1"), func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"198.18.0.0/16", "198.19.0.0/33", " 10.0.0.0/8 "}
			}},
			want: func(p *service.ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerIPs = addrs("198.18.100.1")
				p.SourceRanges = prefixes("198.18.0.0/16", "10.0.0.0/8")
			},
			wantLog: []string{`spec.loadBalancerSourceRanges[1]: malformed CIDR \"198.19.0.0/33\"; entry skipped`},
		},
		{
			name: "source ranges: all malformed closes the load balancer rather than opening it",
			tweaks: []func(*v1.Service){lb("198.18.100.1"), func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"198.18.0.0/33"}
			}},
			want:    func(p *service.ServicePort) { p.NodePort = 30080 },
			wantLog: []string{"malformed CIDR", "ingress IP 198.18.100.1 not programmed: no usable loadBalancerSourceRange of its family"},
		},
		{
			name: "source ranges: dual-stack, a malformed entry leaves IPv6 without a range: IPv6 ingress closed",
			tweaks: []func(*v1.Service){dualStack, lb("198.18.100.1", "2001:db8::1"), func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"198.18.0.0/16", "2001:db8::/129"}
			}},
			want: func(p *service.ServicePort) {
				p.ClusterIPs = addrs("172.30.0.1", "fd00:30::1")
				p.NodePort = 30080
				p.LoadBalancerIPs = addrs("198.18.100.1")
				p.SourceRanges = prefixes("198.18.0.0/16")
			},
			wantLog: []string{"spec.loadBalancerSourceRanges[1]", "ingress IP 2001:db8::1 not programmed"},
		},
		{
			name: "source ranges: dual-stack with both families given and valid is untouched by a third, bad one",
			tweaks: []func(*v1.Service){dualStack, lb("198.18.100.1", "2001:db8::1"), func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"198.18.0.0/16", "2001:db8::/32", "bogus"}
			}},
			want: func(p *service.ServicePort) {
				p.ClusterIPs = addrs("172.30.0.1", "fd00:30::1")
				p.NodePort = 30080
				p.LoadBalancerIPs = addrs("198.18.100.1", "2001:db8::1")
				p.SourceRanges = prefixes("198.18.0.0/16", "2001:db8::/32")
			},
			wantLog: []string{`spec.loadBalancerSourceRanges[2]: malformed CIDR \"bogus\"`},
		},
		{
			name: "several bad fields: one line names them all",
			tweaks: []func(*v1.Service){lb("198.18.100.1", "x"), func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"y", "198.18.5.5"}
				s.Spec.LoadBalancerSourceRanges = []string{"z", "198.18.0.0/16"}
			}},
			want: func(p *service.ServicePort) {
				p.NodePort = 30080
				p.ExternalIPs = addrs("198.18.5.5")
				p.LoadBalancerIPs = addrs("198.18.100.1")
				p.SourceRanges = prefixes("198.18.0.0/16")
			},
			wantLog: []string{"spec.externalIPs[0]", "status.loadBalancer.ingress[1].ip", "spec.loadBalancerSourceRanges[0]"},
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			c, logs := newTestConverter(t, Options{Metrics: m})
			svc := makeService("ns1", "a", tc.tweaks...)
			want := basePort("ns1", "a")
			tc.want(&want)
			for range 3 { // as a resync would: one line per revision, not per conversion
				got := c.Service(svc)
				if got == nil {
					t.Fatalf("service skipped; logs: %q", logs.lines())
				}
				if !reflect.DeepEqual(got.Ports, []service.ServicePort{want}) {
					t.Fatalf("ports:\n got %+v\nwant %+v", got.Ports, []service.ServicePort{want})
				}
			}
			lines := logs.lines()
			if len(tc.wantLog) == 0 {
				if len(lines) != 0 {
					t.Fatalf("unexpected log: %q", lines)
				}
			} else {
				if len(lines) != 1 {
					t.Fatalf("log %q, want one line", lines)
				}
				for _, w := range append(tc.wantLog, "object=ns1/a", "resourceVersion=1", "Service partly used") {
					if !strings.Contains(lines[0], w) {
						t.Errorf("log %q lacks %q", lines[0], w)
					}
				}
			}
			if n := testutil.ToFloat64(m.InvalidObjects.WithLabelValues(metrics.KindService)); n != 0 {
				t.Errorf("a partly used service counted as invalid (%v)", n)
			}
		})
	}
}

func TestInvalidObjectsCountedOncePerRevision(t *testing.T) {
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c, logs := newTestConverter(t, Options{Metrics: m})
	count := func(kind string) float64 { return testutil.ToFloat64(m.InvalidObjects.WithLabelValues(kind)) }

	bad := makeService("ns1", "a", func(s *v1.Service) { s.Spec.Ports[0].Port = 70000 })
	for range 3 {
		if c.Service(bad) != nil {
			t.Fatal("service with port 70000 converted")
		}
	}
	if n := count(metrics.KindService); n != 1 {
		t.Fatalf("invalid services %v after three conversions of one revision, want 1", n)
	}
	bad2 := bad.DeepCopy()
	bad2.ResourceVersion = "2"
	c.Service(bad2)
	if n := count(metrics.KindService); n != 2 {
		t.Fatalf("invalid services %v after a new revision, want 2", n)
	}

	badSlice := makeSlice("ns1", "a-1", "", func(es *discovery.EndpointSlice) { es.AddressType = "IPv5" })
	c.EndpointSlice(badSlice)
	c.EndpointSlice(badSlice)
	if n := count(metrics.KindEndpointSlice); n != 1 {
		t.Fatalf("invalid slices %v, want 1", n)
	}
	// A slice that loses one endpoint is not invalid.
	c.EndpointSlice(makeSlice("ns1", "b-1", "b", withEndpoints(ep("10.0.0.1"), ep("10.0.0"))))
	if n := count(metrics.KindEndpointSlice); n != 1 {
		t.Fatalf("invalid slices %v after a partly used one, want 1", n)
	}
	if n := len(logs.lines()); n != 4 {
		t.Fatalf("%d log lines, want 4: %q", n, logs.lines())
	}
}
