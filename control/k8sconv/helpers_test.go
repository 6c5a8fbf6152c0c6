package k8sconv

import (
	"bytes"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// makeService returns a ClusterIP service with one TCP port 80 named "p80",
// changed by each tweak.
func makeService(ns, name string, tweaks ...func(*v1.Service)) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, ResourceVersion: "1"},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  "172.30.0.1",
			ClusterIPs: []string{"172.30.0.1"},
			Ports:      []v1.ServicePort{{Name: "p80", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, t := range tweaks {
		t(svc)
	}
	return svc
}

// makeSlice returns an IPv4 slice for service svcName with one TCP port
// named "p80" on 8080, changed by each tweak.
func makeSlice(ns, name, svcName string, tweaks ...func(*discovery.EndpointSlice)) *discovery.EndpointSlice {
	es := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns, Name: name, ResourceVersion: "1",
			Labels: map[string]string{discovery.LabelServiceName: svcName},
		},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("p80"), Port: ptr[int32](8080), Protocol: ptr(v1.ProtocolTCP)}},
	}
	for _, t := range tweaks {
		t(es)
	}
	return es
}

func withEndpoints(eps ...discovery.Endpoint) func(*discovery.EndpointSlice) {
	return func(es *discovery.EndpointSlice) { es.Endpoints = append(es.Endpoints, eps...) }
}

func ep(addr string, tweaks ...func(*discovery.Endpoint)) discovery.Endpoint {
	e := discovery.Endpoint{Addresses: []string{addr}}
	for _, t := range tweaks {
		t(&e)
	}
	return e
}

func ptr[T any](v T) *T { return &v }

func addrs(ss ...string) []packet.Addr {
	var out []packet.Addr
	for _, s := range ss {
		out = append(out, packet.MustParseAddr(s))
	}
	return out
}

func prefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

// logBuffer captures log lines from a Converter.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := strings.TrimSpace(l.buf.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func newTestConverter(t *testing.T, opts Options) (*Converter, *logBuffer) {
	t.Helper()
	lb := &logBuffer{}
	opts.Logger = slog.New(slog.NewTextHandler(lb, nil))
	return NewConverter(opts), lb
}

func typesName(ns, name string) types.NamespacedName {
	return types.NamespacedName{Namespace: ns, Name: name}
}
