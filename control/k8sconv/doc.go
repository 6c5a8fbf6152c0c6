// Package k8sconv turns Kubernetes API objects — core/v1 Services and
// discovery/v1 EndpointSlices — into the plain service.Model that the
// dataplane compiles. Both service sources (the static file and the API
// server) use it, so a Service means the same thing whichever way it
// arrives.
//
// It programs exactly the services kube-proxy programs:
//
//   - skipped: ExternalName services, services without a cluster IP
//     (unallocated or headless "None"), services labelled
//     service.kubernetes.io/headless, and services whose label
//     service.kubernetes.io/service-proxy-name names another proxy (a
//     service naming ours, Options.ProxyName, default "xdproxy", is kept);
//   - external IPs and load-balancer ingress IPs are kept only in families
//     the service has a cluster IP in; ingress IPs with ipMode Proxy are not
//     programmed (the load balancer delivers to the node itself);
//   - endpoints are matched to a service port by port name and protocol
//     across all EndpointSlices labelled kubernetes.io/service-name, and an
//     ip:port listed by several slices appears once (a non-terminating entry
//     wins over a terminating one, as in kube-proxy);
//   - FQDN slices are ignored; an endpoint whose address is not of its
//     slice's address type is dropped.
//
// ServicePort.Endpoints holds endpoints of both families for a dual-stack
// service; Compile must pair each frontend with endpoints of its own family,
// as kube-proxy's per-family proxiers do. SourceRanges likewise holds the
// prefixes of both families.
//
// The scheduler of a service is chosen with the annotation
// xdproxy.io/scheduler: random, roundrobin or maglev; without it the
// service gets Options.DefaultScheduler (random unless configured, as in
// kube-proxy). An unknown value is logged and the default used.
//
// TopologyAware is set when the service asks for it (trafficDistribution
// PreferClose, PreferSameZone or PreferSameNode, or the annotation
// service.kubernetes.io/topology-mode: Auto) or when its endpoints carry
// zone hints: current kube-proxy honours hints whenever every ready endpoint
// has one, whoever set them.
//
// Bad input loses only itself, as in kube-proxy. A malformed entry of
// spec.externalIPs, spec.loadBalancerSourceRanges or
// status.loadBalancer.ingress[].ip is dropped and the rest of the Service
// programmed; so is a port with a protocol xdproxy does not forward (SCTP),
// an endpoint with a malformed address, or a slice port out of range. One
// exception keeps a typo from opening a service: where dropping malformed
// source ranges leaves a family with no range at all, the ingress IPs of
// that family are not programmed (kube-proxy would leave them open to
// everyone). An object that cannot be used as a whole (malformed cluster
// IP, service port or healthCheckNodePort out of range, a slice without its
// service-name label or with an unknown addressType) is skipped and counted
// in xdproxy_invalid_objects_total{kind} (Options.Metrics). Either way the
// object gets one log line per resourceVersion, naming it and every
// problem, however often it is converted. Every other object keeps
// working.
//
// A Builder keeps the converted objects and the ServicePorts built from
// them, and rebuilds only the services whose objects changed. A Model it
// returns, and everything the Model points to, is never modified afterwards:
// callers may hand it to another goroutine and must not change it.
package k8sconv
