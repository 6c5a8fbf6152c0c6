package kernelrules

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// WriteManifests writes the services as kubectl-style YAML: one v1 Service
// with spec.clusterIP set and one discovery.k8s.io/v1 EndpointSlice per
// service, as xdproxy's file source (and kubectl apply) reads them.
func (s ServiceSet) WriteManifests(w io.Writer) error {
	if err := s.Validate(); err != nil {
		return err
	}
	b := bufio.NewWriterSize(w, 1<<20)
	proto := strings.ToUpper(string(s.Proto))
	for i := range s.Count {
		fmt.Fprintf(b, `---
apiVersion: v1
kind: Service
metadata:
  name: %s
  namespace: %s
spec:
  type: ClusterIP
  clusterIP: %s
  ports:
  - name: p
    port: %d
    protocol: %s
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s-1
  namespace: %s
  labels:
    kubernetes.io/service-name: %s
addressType: IPv4
ports:
- name: p
  port: %d
  protocol: %s
endpoints:
`, s.Name(i), s.NS(), s.VIP(i), s.Port(i), proto, s.Name(i), s.NS(), s.Name(i), s.Endpoints[0].Port(), proto)
		for _, ep := range s.Endpoints {
			fmt.Fprintf(b, "- addresses: [%q]\n  conditions: {ready: true, serving: true, terminating: false}\n", ep.Addr().String())
		}
	}
	return b.Flush()
}
