package main

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/xdproxy/xdproxy/internal/kubetest"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// kubeAgent starts a real API server and etcd, and xdproxy with the
// kubernetes source in the testbed's node namespace (see kubeAgentWith).
func kubeAgent(t *testing.T, tb *testbed.Testbed) (*kubetest.Cluster, *daemon) {
	t.Helper()
	return kubeAgentWith(t, tb, "minSyncPeriod: 100ms", "maxSyncPeriod: 10s")
}

func apply(t *testing.T, c *kubetest.Cluster, manifests string) {
	t.Helper()
	if out, err := c.KubectlWithInput([]byte(manifests), "apply", "-f", "-"); err != nil {
		t.Fatalf("kubectl apply: %v\n%s", err, out)
	}
}

// backendsReached sends n requests to the VIP and returns the set of
// backends that answered.
func backendsReached(t *testing.T, tb *testbed.Testbed, a *daemon, n int) map[string]bool {
	t.Helper()
	seen := map[string]bool{}
	for i := 0; i < n; i++ {
		name, err := get(tb, "http://198.19.0.10/")
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, a.dump())
		}
		seen[name] = true
	}
	return seen
}

// eventually retries check until it returns "" or the deadline passes.
func eventually(t *testing.T, what string, check func() string) {
	t.Helper()
	last := ""
	if !waitUntil(200*time.Millisecond, 40*time.Second, func() bool {
		last = check()
		return last == ""
	}) {
		t.Fatalf("%s: %s", what, last)
	}
}

// TestKubernetesSource drives xdproxy from a real kube-apiserver: applied
// objects become forwarding, scaling the EndpointSlice moves traffic,
// deleting the Service stops it, and an API server outage changes nothing
// until it comes back and resyncs.
func TestKubernetesSource(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	cluster, a := kubeAgent(t, tb)

	t.Log("applied Service and EndpointSlice: traffic reaches all three backends")
	if got := backendsReached(t, tb, a, 40); len(got) != 3 {
		t.Fatalf("reached %v, want 3 backends", got)
	}

	t.Log("scale the EndpointSlice down to backend-0")
	one := webSvc
	one.backends = []int{0}
	apply(t, cluster, serviceFile(one))
	a.waitBackends("web", 1)
	if got := backendsReached(t, tb, a, 20); len(got) != 1 || !got[testbed.BackendName(0)] {
		t.Fatalf("after scale-down reached %v", got)
	}

	t.Log("scale up to backends 1 and 2")
	two := webSvc
	two.backends = []int{1, 2}
	apply(t, cluster, serviceFile(two))
	a.waitBackends("web", 2)
	if got := backendsReached(t, tb, a, 30); len(got) != 2 || got[testbed.BackendName(0)] {
		t.Fatalf("after scale-up reached %v", got)
	}

	t.Log("stop the API server: forwarding goes on with the last table")
	cluster.StopAPIServer()
	time.Sleep(2 * time.Second)
	if got := backendsReached(t, tb, a, 20); len(got) != 2 {
		t.Fatalf("during the outage reached %v", got)
	}

	t.Log("restart it: the informers reconnect, and a change applied now reaches the agent")
	cluster.StartAPIServer()
	apply(t, cluster, serviceFile(webSvc))
	a.waitBackends("web", 3)
	if got := backendsReached(t, tb, a, 40); len(got) != 3 {
		t.Fatalf("after the restart reached %v", got)
	}

	t.Log("delete the Service: the VIP stops forwarding")
	if out, err := cluster.Kubectl("delete", "service", "web"); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	eventually(t, "VIP still forwards after the Service was deleted", func() string {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		c, err := tb.Dial(ctx, tb.ClientNS(), "tcp", "198.19.0.10:80")
		if err != nil {
			return ""
		}
		c.Close()
		return "connection to the VIP still succeeds"
	})
}

// TestAPIServerByConfiguredAddress: on a node without kube-proxy, the
// DaemonSet's in-cluster address (the kubernetes Service's ClusterIP) is
// reachable only through xdproxy itself. With services.kubernetes.apiServer
// xdproxy reaches the API server at its real address, syncs, and then
// serves the kubernetes Service to a pod on the node.
func TestAPIServerByConfiguredAddress(t *testing.T) {
	nb := newNodeBed(t)
	cluster := kubetest.Start(t, kubetest.Options{})
	cfg, err := clientcmd.LoadFromFile(cluster.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	var target string
	for _, c := range cfg.Clusters {
		target = strings.TrimPrefix(c.Server, "https://")
	}
	// The control plane, as the node sees it: node2, port 6443.
	apiAddr := netip.AddrPortFrom(nb.Node2().Addr, 6443)
	ln, err := testbed.ForwardIntoAt(nb.Node2NS(), apiAddr.String(), target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var kubeIP string
	eventually(t, "the kubernetes Service", func() string {
		out, err := cluster.Kubectl("get", "service", "kubernetes", "-o", "jsonpath={.spec.clusterIP}")
		kubeIP = strings.TrimSpace(string(out))
		if err != nil || kubeIP == "" {
			return fmt.Sprintf("%v %s", err, out)
		}
		return ""
	})
	// The credentials' server is the in-cluster address, which nothing
	// serves before xdproxy runs; the certificate names 127.0.0.1.
	for _, c := range cfg.Clusters {
		c.Server = "https://" + kubeIP + ":443"
		c.TLSServerName = "127.0.0.1"
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	// The API server's endpoint, as a control plane node would publish it.
	apply(t, cluster, fmt.Sprintf(`apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes}
addressType: IPv4
ports: [{name: https, port: 6443, protocol: TCP}]
endpoints:
- addresses: [%s]
  conditions: {ready: true}
`, apiAddr.Addr()))
	a := newNodeAgentWith(t, nb, "", fmt.Sprintf(`services:
  kubernetes:
    kubeconfig: %s
    apiServer: https://%s
    minSyncPeriod: 100ms`, kubeconfig, apiAddr))
	lines, err := onNode(nb, nb.Pod("pod-a").NS, true, "https", "https://"+kubeIP+"/version", "3")
	if err != nil {
		t.Fatalf("a pod asking the kubernetes Service: %v\n%s", err, a.dump())
	}
	if n := strings.Count(strings.Join(lines, "\n"), `"major": "1"`); n != 3 {
		t.Errorf("%d of 3 answers are the API server's /version:\n%s", n, strings.Join(lines, "\n"))
	}
}
