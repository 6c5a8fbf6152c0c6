package k8sconv

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	netutils "k8s.io/utils/net"

	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// Labels and annotations that decide whether and how a service is programmed.
const (
	// LabelServiceProxyName hands a service to a named proxy; kube-proxy
	// (and xdproxy, unless the name is ours) leaves it alone.
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	// AnnotationScheduler picks the backend scheduler: random, roundrobin
	// or maglev.
	AnnotationScheduler = "xdproxy.io/scheduler"
	// DefaultProxyName is the service-proxy-name xdproxy answers to.
	DefaultProxyName = "xdproxy"
)

// DefaultAffinityTimeout is the ClientIP affinity timeout when the service
// gives none (the API server's default, 3 hours).
const DefaultAffinityTimeout = time.Duration(v1.DefaultClientIPServiceAffinitySeconds) * time.Second

// Options configure a Converter.
type Options struct {
	// ProxyName is the service-proxy-name label value xdproxy accepts;
	// DefaultProxyName when empty.
	ProxyName string
	// DefaultScheduler is the scheduler of a service without the
	// xdproxy.io/scheduler annotation (the zero value is service.Random,
	// kube-proxy's behaviour).
	DefaultScheduler service.Scheduler
	// Logger receives one line per unusable object and resourceVersion;
	// slog.Default() when nil.
	Logger *slog.Logger
	// Metrics counts the objects skipped as a whole, once per
	// resourceVersion (xdproxy_invalid_objects_total); nil counts nothing.
	Metrics *metrics.Metrics
}

// Converter converts Services and EndpointSlices. It is safe for concurrent
// use; its only state is the record of what it has already logged.
type Converter struct {
	proxyName        string
	defaultScheduler service.Scheduler
	log              *slog.Logger
	metrics          *metrics.Metrics

	mu       sync.Mutex
	reported map[objectRef]string // object -> resourceVersion and problems last logged
}

type objectRef struct {
	kind      string
	namespace string
	name      string
}

// NewConverter returns a Converter with opts applied.
func NewConverter(opts Options) *Converter {
	c := &Converter{
		proxyName:        opts.ProxyName,
		defaultScheduler: opts.DefaultScheduler,
		log:              opts.Logger,
		metrics:          opts.Metrics,
		reported:         make(map[objectRef]string),
	}
	if c.proxyName == "" {
		c.proxyName = DefaultProxyName
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	return c
}

// Service is a Service reduced to what the model needs: one ServicePort per
// forwarded spec port, in spec order, with no endpoints yet.
type Service struct {
	Key   types.NamespacedName
	Ports []service.ServicePort
}

// Slice is an EndpointSlice reduced to what the model needs.
type Slice struct {
	// Service is the service the slice belongs to (label
	// kubernetes.io/service-name).
	Service types.NamespacedName
	// Ports are sorted by number; Endpoints by address. Sorting makes two
	// slices that list the same things compare equal.
	Ports []SlicePort
	// Endpoints have Port 0: the port comes from the SlicePort that matches
	// the service port.
	Endpoints []service.Endpoint
}

// SlicePort is one port of an EndpointSlice.
type SlicePort struct {
	Name  string
	Proto packet.Proto
	Port  uint16
}

// problems collects what is wrong with one object while it is converted.
type problems struct {
	fatal    []string // the object is skipped
	warnings []string // part of the object is dropped
}

func (p *problems) fail(format string, args ...any) {
	p.fatal = append(p.fatal, fmt.Sprintf(format, args...))
}

func (p *problems) warn(format string, args ...any) {
	p.warnings = append(p.warnings, fmt.Sprintf(format, args...))
}

// Service converts svc. It returns nil when svc is nil, is not programmed
// (see the package documentation) or cannot be used.
func (c *Converter) Service(svc *v1.Service) *Service {
	if svc == nil || !c.serviceIsOurs(svc) {
		return nil
	}
	var p problems
	out := c.convertService(svc, &p)
	c.report(metrics.KindService, svc, &p)
	if len(p.fatal) > 0 {
		return nil
	}
	return out
}

// serviceIsOurs applies kube-proxy's skip rules that need no parsing.
func (c *Converter) serviceIsOurs(svc *v1.Service) bool {
	if _, headless := svc.Labels[v1.IsHeadlessService]; headless {
		return false
	}
	if name, named := svc.Labels[LabelServiceProxyName]; named && name != c.proxyName {
		return false
	}
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return false
	}
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	return len(ips) > 0 && ips[0] != "" && ips[0] != v1.ClusterIPNone
}

func (c *Converter) convertService(svc *v1.Service, p *problems) *Service {
	spec := &svc.Spec
	ipStrings := spec.ClusterIPs
	if len(ipStrings) == 0 {
		ipStrings = []string{spec.ClusterIP}
	}
	var clusterIPs []packet.Addr
	var has4, has6 bool
	for _, s := range ipStrings {
		a, err := parseAddr(s)
		if err != nil {
			p.fail("spec.clusterIPs: %v", err)
			continue
		}
		has4 = has4 || a.Is4()
		has6 = has6 || !a.Is4()
		clusterIPs = append(clusterIPs, a)
	}
	// kube-proxy programs an external or load-balancer IP only in a family
	// the service has a cluster IP in.
	inFamily := func(a packet.Addr) bool { return a.Is4() && has4 || !a.Is4() && has6 }

	// A malformed external IP, ingress IP or source range loses only
	// itself, as in kube-proxy; the rest of the service is programmed.
	var externalIPs []packet.Addr
	for i, s := range spec.ExternalIPs {
		if strings.TrimSpace(s) == "" {
			continue // kube-proxy ignores empty strings quietly
		}
		a, err := parseAddr(s)
		if err != nil {
			p.warn("spec.externalIPs[%d]: %v; entry skipped", i, err)
		} else if inFamily(a) {
			externalIPs = append(externalIPs, a)
		}
	}
	var lbIPs []packet.Addr
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IP == "" || ing.IPMode != nil && *ing.IPMode != v1.LoadBalancerIPModeVIP {
			continue // hostname only, or ipMode Proxy: the load balancer proxies
		}
		a, err := parseAddr(ing.IP)
		if err != nil {
			p.warn("status.loadBalancer.ingress[%d].ip: %v; entry skipped", i, err)
		} else if inFamily(a) {
			lbIPs = append(lbIPs, a)
		}
	}
	var ranges []netip.Prefix
	var badRange bool
	for i, s := range spec.LoadBalancerSourceRanges {
		// Validation lets whitespace through; kube-proxy trims it too.
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		pfx, err := parsePrefix(s)
		if err != nil {
			p.warn("spec.loadBalancerSourceRanges[%d]: %v; entry skipped", i, err)
			badRange = true
			continue
		}
		ranges = append(ranges, pfx)
	}
	if badRange {
		// Ranges apply per family and a family without any is open to
		// everyone. Where dropping malformed ranges left a family with
		// none, kube-proxy would open the load balancer; close it instead
		// (its ingress IPs of that family are not programmed), since the
		// malformed entry may have been that family's restriction.
		var kept []packet.Addr
		for _, a := range lbIPs {
			if slices.ContainsFunc(ranges, func(r netip.Prefix) bool { return r.Addr().Is4() == a.Is4() }) {
				kept = append(kept, a)
			} else {
				p.warn("status.loadBalancer.ingress IP %s not programmed: no usable loadBalancerSourceRange of its family", a)
			}
		}
		lbIPs = kept
	}

	var affinity time.Duration
	if spec.SessionAffinity == v1.ServiceAffinityClientIP {
		affinity = DefaultAffinityTimeout
		if cfg := spec.SessionAffinityConfig; cfg != nil && cfg.ClientIP != nil && cfg.ClientIP.TimeoutSeconds != nil {
			if t := *cfg.ClientIP.TimeoutSeconds; t > 0 {
				affinity = time.Duration(t) * time.Second
			} else {
				p.warn("sessionAffinityConfig.clientIP.timeoutSeconds %d is not positive; using %v", t, DefaultAffinityTimeout)
			}
		}
	}

	externallyAccessible := spec.Type == v1.ServiceTypeLoadBalancer || spec.Type == v1.ServiceTypeNodePort ||
		len(spec.ExternalIPs) > 0
	externalLocal := externallyAccessible && spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal
	internalLocal := spec.InternalTrafficPolicy != nil && *spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal
	var healthCheckPort uint16
	if spec.Type == v1.ServiceTypeLoadBalancer && externalLocal {
		if hc, ok := portNumber(spec.HealthCheckNodePort); ok {
			healthCheckPort = hc
		} else if spec.HealthCheckNodePort != 0 {
			p.fail("spec.healthCheckNodePort %d out of range", spec.HealthCheckNodePort)
		}
	}

	scheduler := c.defaultScheduler
	if s, ok := svc.Annotations[AnnotationScheduler]; ok {
		switch strings.ToLower(strings.TrimSpace(s)) {
		case "":
		case "random":
			scheduler = service.Random
		case "roundrobin":
			scheduler = service.RoundRobin
		case "maglev":
			scheduler = service.Maglev
		default:
			p.warn("annotation %s: unknown scheduler %q; using %v", AnnotationScheduler, s, scheduler)
		}
	}

	out := &Service{Key: types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}}
	template := service.ServicePort{
		ClusterIPs:          clusterIPs,
		ExternalIPs:         externalIPs,
		LoadBalancerIPs:     lbIPs,
		SourceRanges:        ranges,
		AffinityTimeout:     affinity,
		ExternalPolicyLocal: externalLocal,
		InternalPolicyLocal: internalLocal,
		HealthCheckNodePort: healthCheckPort,
		TopologyAware:       topologyRequested(svc),
		Scheduler:           scheduler,
	}
	for i := range spec.Ports {
		sp := &spec.Ports[i]
		proto, ok := protocol(sp.Protocol)
		if !ok {
			p.warn("spec.ports[%d] (%q): protocol %s is not forwarded; port skipped", i, sp.Name, sp.Protocol)
			continue
		}
		port, ok := portNumber(sp.Port)
		if !ok || port == 0 {
			p.fail("spec.ports[%d] (%q): port %d out of range", i, sp.Name, sp.Port)
			continue
		}
		nodePort, ok := portNumber(sp.NodePort)
		if !ok {
			p.fail("spec.ports[%d] (%q): nodePort %d out of range", i, sp.Name, sp.NodePort)
			continue
		}
		t := template
		t.Name = service.PortName{Namespace: svc.Namespace, Name: svc.Name, Port: sp.Name}
		t.Proto = proto
		t.Port = port
		t.NodePort = nodePort
		out.Ports = append(out.Ports, t)
	}
	return out
}

func topologyRequested(svc *v1.Service) bool {
	if d := svc.Spec.TrafficDistribution; d != nil {
		switch *d {
		case v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone,
			v1.ServiceTrafficDistributionPreferSameNode:
			return true
		}
	}
	mode, ok := svc.Annotations[v1.AnnotationTopologyMode]
	if !ok {
		mode = svc.Annotations[v1.DeprecatedAnnotationTopologyAwareHints]
	}
	return mode == "Auto" || mode == "auto"
}

// EndpointSlice converts es. It returns nil when es is nil, is not used by
// kube-proxy (no service-name label, headless, FQDN) or cannot be used.
func (c *Converter) EndpointSlice(es *discovery.EndpointSlice) *Slice {
	if es == nil {
		return nil
	}
	if _, headless := es.Labels[v1.IsHeadlessService]; headless {
		return nil
	}
	var p problems
	out := c.convertSlice(es, &p)
	c.report(metrics.KindEndpointSlice, es, &p)
	if len(p.fatal) > 0 {
		return nil
	}
	return out
}

func (c *Converter) convertSlice(es *discovery.EndpointSlice, p *problems) *Slice {
	var want4 bool
	switch es.AddressType {
	case discovery.AddressTypeIPv4:
		want4 = true
	case discovery.AddressTypeIPv6:
	case discovery.AddressTypeFQDN:
		return nil // kube-proxy ignores FQDN slices; not a problem worth logging
	default:
		p.fail("unknown addressType %q", es.AddressType)
		return nil
	}
	svcName := es.Labels[discovery.LabelServiceName]
	if svcName == "" {
		p.fail("no %s label", discovery.LabelServiceName)
		return nil
	}
	out := &Slice{Service: types.NamespacedName{Namespace: es.Namespace, Name: svcName}}
	for i, ep := range es.Ports {
		// The API server defaults the name to "" and the protocol to TCP;
		// a hand-written file may leave them out.
		name := ""
		if ep.Name != nil {
			name = *ep.Name
		}
		proto := packet.ProtoTCP
		if ep.Protocol != nil {
			var ok bool
			if proto, ok = protocol(*ep.Protocol); !ok {
				continue // the service port is reported, not each slice
			}
		}
		if ep.Port == nil {
			p.warn("ports[%d] (%q): no port number; port skipped", i, name)
			continue
		}
		port, ok := portNumber(*ep.Port)
		if !ok || port == 0 {
			p.warn("ports[%d] (%q): port %d out of range; port skipped", i, name, *ep.Port)
			continue
		}
		out.Ports = append(out.Ports, SlicePort{Name: name, Proto: proto, Port: port})
	}
	slices.SortFunc(out.Ports, func(a, b SlicePort) int {
		if a.Port != b.Port {
			return int(a.Port) - int(b.Port)
		}
		if a.Proto != b.Proto {
			return int(a.Proto) - int(b.Proto)
		}
		return strings.Compare(a.Name, b.Name)
	})

	for i := range es.Endpoints {
		e := &es.Endpoints[i]
		if len(e.Addresses) == 0 {
			p.warn("endpoints[%d]: no address; endpoint skipped", i)
			continue
		}
		// kube-proxy uses the first address only.
		a, err := parseAddr(e.Addresses[0])
		if err != nil {
			p.warn("endpoints[%d]: %v; endpoint skipped", i, err)
			continue
		}
		if a.Is4() != want4 {
			p.warn("endpoints[%d]: %s is not of addressType %s; endpoint skipped", i, e.Addresses[0], es.AddressType)
			continue
		}
		ready := e.Conditions.Ready == nil || *e.Conditions.Ready
		// The API says a consumer should defer to ready when serving is unset.
		serving := ready
		if e.Conditions.Serving != nil {
			serving = *e.Conditions.Serving
		}
		ep := service.Endpoint{
			Addr:        a,
			Ready:       ready,
			Serving:     serving,
			Terminating: e.Conditions.Terminating != nil && *e.Conditions.Terminating,
		}
		if e.NodeName != nil {
			ep.NodeName = *e.NodeName
		}
		if e.Zone != nil {
			ep.Zone = *e.Zone
		}
		if e.Hints != nil && len(e.Hints.ForZones) > 0 {
			ep.ZoneHints = make([]string, len(e.Hints.ForZones))
			for j, z := range e.Hints.ForZones {
				ep.ZoneHints[j] = z.Name
			}
			slices.Sort(ep.ZoneHints)
		}
		out.Endpoints = append(out.Endpoints, ep)
	}
	slices.SortStableFunc(out.Endpoints, func(a, b service.Endpoint) int { return compareAddr(a.Addr, b.Addr) })
	return out
}

// report logs p for obj unless the same problems were already logged for
// the same resourceVersion.
func (c *Converter) report(kind string, obj metav1.Object, p *problems) {
	if len(p.fatal) == 0 && len(p.warnings) == 0 {
		return
	}
	ref := objectRef{kind: kind, namespace: obj.GetNamespace(), name: obj.GetName()}
	all := append(slices.Clip(p.fatal), p.warnings...)
	stamp := obj.GetResourceVersion() + "\x00" + strings.Join(all, "\x00")
	c.mu.Lock()
	seen := c.reported[ref] == stamp
	c.reported[ref] = stamp
	c.mu.Unlock()
	if seen {
		return
	}
	msg := kind + " partly used"
	if len(p.fatal) > 0 {
		msg = kind + " skipped"
		c.metrics.InvalidObject(kind)
	}
	c.log.Warn(msg, "object", ref.namespace+"/"+ref.name, "resourceVersion", obj.GetResourceVersion(),
		"problems", strings.Join(all, "; "))
}

// Forget drops what the Converter remembers about a deleted object, so that
// memory does not grow with churn and a recreated object is logged again.
func (c *Converter) Forget(kind, namespace, name string) {
	c.mu.Lock()
	delete(c.reported, objectRef{kind: kind, namespace: namespace, name: name})
	c.mu.Unlock()
}

func protocol(p v1.Protocol) (packet.Proto, bool) {
	switch p {
	case v1.ProtocolTCP, "":
		return packet.ProtoTCP, true
	case v1.ProtocolUDP:
		return packet.ProtoUDP, true
	}
	return 0, false
}

func portNumber(n int32) (uint16, bool) {
	if n < 0 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}

var errNoAddress = errors.New("empty address")

// parseAddr parses an IP the way kube-proxy does: strictly, falling back to
// the legacy form with leading zeros that old objects may still hold.
func parseAddr(s string) (packet.Addr, error) {
	if s == "" {
		return packet.Addr{}, errNoAddress
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		ip := netutils.ParseIPSloppy(s)
		if ip == nil {
			return packet.Addr{}, fmt.Errorf("malformed IP %q", s)
		}
		a, _ = netip.AddrFromSlice(ip)
	}
	if a.Zone() != "" {
		return packet.Addr{}, fmt.Errorf("malformed IP %q: zones are not allowed", s)
	}
	a = a.Unmap()
	if a.IsUnspecified() {
		return packet.Addr{}, fmt.Errorf("unspecified IP %q", s)
	}
	return packet.AddrFromNetip(a), nil
}

func parsePrefix(s string) (netip.Prefix, error) {
	pfx, err := netip.ParsePrefix(s)
	if err != nil {
		_, ipnet, err2 := netutils.ParseCIDRSloppy(s)
		if err2 != nil {
			return netip.Prefix{}, fmt.Errorf("malformed CIDR %q", s)
		}
		addr, _ := netip.AddrFromSlice(ipnet.IP)
		ones, _ := ipnet.Mask.Size()
		pfx = netip.PrefixFrom(addr.Unmap(), ones)
	}
	return pfx.Masked(), nil
}

func compareAddr(a, b packet.Addr) int {
	return bytes.Compare(a[:], b[:])
}
