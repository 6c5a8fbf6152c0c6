package main

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// The tests of "pods and host processes on the node use services too", on
// the node-shaped topology: a NIC towards a LAN with an off-cluster client
// and a second node, pods behind routed veths and a bridge, host
// processes.

// nodeEP is one endpoint of a nodeSvc: a pod of the NodeBed.
type nodeEP struct {
	pod  string // NodeBed pod name
	node string // the node it runs on: node-1 (this one) or node-2
}

type nodeSvc struct {
	name, clusterIP string
	port            int
	proto           string // TCP (default) or UDP
	nodePort        int
	local           bool // externalTrafficPolicy Local
	eps             []nodeEP
}

// nodeServiceFile renders services whose endpoints are NodeBed pods.
func nodeServiceFile(nb *testbed.NodeBed, svcs ...nodeSvc) string {
	var b strings.Builder
	for _, s := range svcs {
		proto, target := s.proto, testbed.HTTPPort
		if proto == "" {
			proto = "TCP"
		}
		if proto == "UDP" {
			target = testbed.UDPPort
		}
		typ, extra := "ClusterIP", ""
		if s.nodePort != 0 {
			typ = "NodePort"
			extra = fmt.Sprintf("    nodePort: %d\n", s.nodePort)
		}
		policy := ""
		if s.local {
			policy = "  externalTrafficPolicy: Local\n"
		}
		fmt.Fprintf(&b, `---
apiVersion: v1
kind: Service
metadata: {name: %s, namespace: default}
spec:
  type: %s
  clusterIP: %s
  clusterIPs: [%s]
%s  ports:
  - name: p
    port: %d
    protocol: %s
    targetPort: %d
%s---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s-1
  namespace: default
  labels: {kubernetes.io/service-name: %s}
addressType: IPv4
ports: [{name: p, port: %d, protocol: %s}]
endpoints:
`, s.name, typ, s.clusterIP, s.clusterIP, policy, s.port, proto, target, extra, s.name, s.name, target, proto)
		for _, ep := range s.eps {
			fmt.Fprintf(&b, "- addresses: [%s]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: %s\n",
				nb.Pod(ep.pod).Addr, ep.node)
		}
	}
	return b.String()
}

// newNodeAgent runs xdproxy on the NodeBed's node: its NIC with every
// queue, pods in 10.244.0.0/16, local clients in the NodeBed's cgroup.
func newNodeAgent(t *testing.T, nb *testbed.NodeBed, services string) *daemon {
	t.Helper()
	return newNodeAgentWith(t, nb, services, "")
}

// newNodeAgentWith is newNodeAgent with sourceCfg, when not empty, as the
// config's services section.
func newNodeAgentWith(t *testing.T, nb *testbed.NodeBed, services, sourceCfg string) *daemon {
	t.Helper()
	needRoot(t)
	dir := t.TempDir()
	a := &daemon{t: t, ns: nb.NodeNS(), dir: dir, config: filepath.Join(dir, "xdproxy.yaml"),
		services: filepath.Join(dir, "services.yaml"), admin: filepath.Join(dir, "admin.sock")}
	writeFileAtomic(t, a.services, services)
	if sourceCfg == "" {
		sourceCfg = "services: {file: " + a.services + "}"
	}
	cfg := fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: node-1
interfaces:
  - {name: %s, xdpMode: native}
%s
clusterCIDR: 10.244.0.0/16
metricsAddress: 127.0.0.1:0
healthzAddress: 127.0.0.1:0
adminSocket: %s
stateDir: %s
bpffsDir: %s
localClients: {cgroup: %s}
`, nb.NIC(), sourceCfg, a.admin, filepath.Join(dir, "state"), privateBPFFS(t), nb.Cgroup())
	writeFileAtomic(t, a.config, cfg)
	a.start()
	t.Cleanup(func() { a.stop() })
	return a
}

func newNodeBed(t *testing.T) *testbed.NodeBed {
	t.Helper()
	needRoot(t)
	nb := testbed.NewNodeForTest(t, testbed.NodeOptions{})
	if err := nb.StartServers(); err != nil {
		t.Fatal(err)
	}
	return nb
}

// The node-shaped tests' services.
func nodeServices(nb *testbed.NodeBed) string {
	return nodeServiceFile(nb,
		nodeSvc{name: "local", clusterIP: "198.19.0.50", port: 80, eps: []nodeEP{{"pod-b", "node-1"}}},
		nodeSvc{name: "remote", clusterIP: "198.19.0.51", port: 80, eps: []nodeEP{{"n2-pod-a", "node-2"}}},
		nodeSvc{name: "bridged", clusterIP: "198.19.0.52", port: 80, eps: []nodeEP{{"pod-c", "node-1"}}},
		nodeSvc{name: "hairpin", clusterIP: "198.19.0.54", port: 80, eps: []nodeEP{{"pod-a", "node-1"}}},
		nodeSvc{name: "np", clusterIP: "198.19.0.55", port: 80, nodePort: 30091,
			eps: []nodeEP{{"pod-c", "node-1"}, {"n2-pod-a", "node-2"}}},
		nodeSvc{name: "np-local", clusterIP: "198.19.0.56", port: 80, nodePort: 30090, local: true,
			eps: []nodeEP{{"pod-b", "node-1"}, {"n2-pod-b", "node-2"}}},
		nodeSvc{name: "dns", clusterIP: "198.19.0.53", port: 53, proto: "UDP",
			eps: []nodeEP{{"pod-a", "node-1"}, {"pod-c", "node-1"}, {"n2-pod-a", "node-2"}}},
	)
}

// whoami asks url/whoami n times from a client and returns "name source"
// per answer.
func whoami(t *testing.T, nb *testbed.NodeBed, ns string, inCgroup bool, url string, n int) [][2]string {
	t.Helper()
	lines, err := onNode(nb, ns, inCgroup, "http", url+"/whoami", fmt.Sprint(n))
	if err != nil {
		t.Fatalf("%s from %s: %v (%v)", url, ns, err, lines)
	}
	var out [][2]string
	for _, l := range lines {
		name, src, _ := strings.Cut(l, " ")
		host, _, _ := strings.Cut(src, ":")
		out = append(out, [2]string{name, host})
	}
	return out
}

// TestLocalClients walks every way a client on the node reaches a
// service: pods (routed and bridged) and host processes, to cluster IPs
// with local and remote backends, NodePorts on the node's address and on
// 127.0.0.1, and a pod to its own service; with the client's own address
// at the backend where kube-proxy keeps it.
func TestLocalClients(t *testing.T) {
	nb := newNodeBed(t)
	a := newNodeAgent(t, nb, nodeServices(nb))
	podA, podC, node := nb.Pod("pod-a"), nb.Pod("pod-c"), nb.Node()
	cases := []struct {
		name     string
		ns       string
		url      string
		backends []string // any of these answers
		wantSrc  string   // the source the backend sees; "" not checked
		requests int
	}{
		{"routed pod to cluster IP, local backend", podA.NS, "http://198.19.0.50", []string{"pod-b"}, podA.Addr.String(), 5},
		{"routed pod to cluster IP, remote backend", podA.NS, "http://198.19.0.51", []string{"n2-pod-a"}, podA.Addr.String(), 5},
		{"bridged pod to cluster IP, remote backend", podC.NS, "http://198.19.0.51", []string{"n2-pod-a"}, podC.Addr.String(), 5},
		{"bridged pod to cluster IP, routed local backend", podC.NS, "http://198.19.0.50", []string{"pod-b"}, podC.Addr.String(), 5},
		{"routed pod to cluster IP, bridged local backend", podA.NS, "http://198.19.0.52", []string{"pod-c"}, podA.Addr.String(), 5},
		{"pod to its own service (hairpin)", podA.NS, "http://198.19.0.54", []string{"pod-a"}, "", 5},
		{"host to cluster IP, remote backend", node.NS, "http://198.19.0.51", []string{"n2-pod-a"}, node.Addr.String(), 5},
		{"host to cluster IP, local backend", node.NS, "http://198.19.0.50", []string{"pod-b"}, "", 5},
		{"host to NodePort on its address", node.NS, "http://" + node.Addr.String() + ":30091", []string{"pod-c", "n2-pod-a"}, "", 20},
		{"host to NodePort on localhost", node.NS, "http://127.0.0.1:30091", []string{"pod-c", "n2-pod-a"}, "", 20},
		{"pod to a NodePort of its node", podA.NS, "http://" + node.Addr.String() + ":30091", []string{"pod-c", "n2-pod-a"}, "", 20},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seen := map[string]bool{}
			for _, r := range whoami(t, nb, c.ns, true, c.url, c.requests) {
				if !strings.Contains(" "+strings.Join(c.backends, " ")+" ", " "+r[0]+" ") {
					t.Errorf("answered by %q, want one of %v", r[0], c.backends)
				}
				if c.wantSrc != "" && r[1] != c.wantSrc {
					t.Errorf("%s saw the client as %s, want %s", r[0], r[1], c.wantSrc)
				}
				seen[r[0]] = true
			}
			if len(seen) != len(c.backends) {
				t.Errorf("answered by %v of %v", seen, c.backends)
			}
		})
	}
	// A process outside the node's cgroup is no client of the node: its
	// connection to a cluster IP is not translated (the address routes
	// nowhere useful, so it fails).
	if lines, err := onNode(nb, podA.NS, false, "http", "http://198.19.0.51/whoami", "1"); err == nil {
		t.Errorf("a process outside the node's cgroup reached a cluster IP: %v", lines)
	}
	_ = a
}

// TestExternalTrafficPolicyLocal: an off-cluster client reaches a NodePort
// with externalTrafficPolicy Local; only the node's own pod answers, and
// it sees the client's address. Its replies leave through the kernel and
// come back through xdproxy to be translated.
func TestExternalTrafficPolicyLocal(t *testing.T) {
	nb := newNodeBed(t)
	a := newNodeAgent(t, nb, nodeServices(nb))
	client := nb.Client()
	for _, r := range whoami(t, nb, client.NS, false, "http://"+nb.Node().Addr.String()+":30090", 20) {
		if r[0] != "pod-b" || r[1] != client.Addr.String() {
			t.Fatalf("answered by %s seeing %s, want pod-b seeing the client %v\n%s", r[0], r[1], client.Addr, a.dump())
		}
	}
	x, _ := a.xdp()
	if x["EgressRedirected"] == 0 {
		t.Errorf("no reply went through the egress program: %v", x)
	}
}

// TestOffClusterToLocalBackend: an off-cluster client reaches a cluster IP
// (routed to the node) whose backend is a pod on the node; the flow is
// masqueraded (the client is outside the cluster CIDR) to the address
// whose replies the kernel routes back to xdproxy.
func TestOffClusterToLocalBackend(t *testing.T) {
	nb := newNodeBed(t)
	a := newNodeAgent(t, nb, nodeServices(nb))
	for _, url := range []string{"http://198.19.0.50", "http://198.19.0.52"} {
		for _, r := range whoami(t, nb, nb.ClientNS(), false, url, 10) {
			if r[1] != "169.254.42.2" {
				t.Fatalf("%s: %s saw %s, want the local SNAT address 169.254.42.2\n%s", url, r[0], r[1], a.dump())
			}
		}
	}
	// And through a NodePort with policy Cluster, to both kinds of pods.
	seen := map[string]bool{}
	for _, r := range whoami(t, nb, nb.ClientNS(), false, "http://"+nb.Node().Addr.String()+":30091", 30) {
		seen[r[0]] = true
	}
	if !seen["pod-c"] || !seen["n2-pod-a"] {
		t.Errorf("NodePort from off the cluster reached %v, want pod-c and n2-pod-a", seen)
	}
}

// TestPodDNSThroughClusterIP: 1,000 DNS-shaped queries, each from a new
// socket, from a pod through a UDP cluster IP with local and remote
// backends: none lost.
func TestPodDNSThroughClusterIP(t *testing.T) {
	nb := newNodeBed(t)
	a := newNodeAgent(t, nb, nodeServices(nb))
	lines, err := onNode(nb, nb.Pod("pod-b").NS, true, "udp", "198.19.0.53:53", "1000")
	if err != nil || len(lines) != 1 || lines[0] != "ok 1000" {
		t.Fatalf("1000 queries: %v %v\n%s", lines, err, a.dump())
	}
}

// TestPodToPodUnaffected measures pod-to-pod traffic, on the node and to
// node2, without and with xdproxy: throughput (iperf3) and latency (UDP
// echo round trips), reported, not asserted (the machine is shared).
func TestPodToPodUnaffected(t *testing.T) {
	if _, err := os.Stat("/usr/bin/iperf3"); err != nil {
		t.Fatal("iperf3 is not installed (make test installs it)")
	}
	nb := newNodeBed(t)
	podA, podB, n2 := nb.Pod("pod-a"), nb.Pod("pod-b"), nb.Pod("n2-pod-a")
	for _, server := range []testbed.Pod{podB, n2} {
		srv := nb.Command(server.NS, "iperf3", "-s", "-B", server.Addr.String())
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	}
	time.Sleep(300 * time.Millisecond)
	measure := func(label string) {
		for _, to := range []testbed.Pod{podB, n2} {
			out, err := nb.Exec(podA.NS, "iperf3", "-c", to.Addr.String(), "-t", "2", "-f", "m")
			rate := "?"
			if err == nil {
				for _, l := range strings.Split(string(out), "\n") {
					if strings.Contains(l, "receiver") {
						f := strings.Fields(l)
						for i, w := range f {
							if w == "Mbits/sec" {
								rate = f[i-1]
							}
						}
					}
				}
			}
			lines, err := onNode(nb, podA.NS, true, "udprtt", netip.AddrPortFrom(to.Addr, testbed.UDPPort).String(), "500")
			rtt := "?"
			if err == nil && len(lines) == 1 {
				rtt = strings.TrimPrefix(lines[0], "rtt ") + " µs"
			}
			t.Logf("%s: pod-a -> %s: %s Mbit/s, median UDP round trip %s", label, to.Name, rate, rtt)
		}
	}
	measure("without xdproxy")
	newNodeAgent(t, nb, nodeServices(nb))
	measure("with xdproxy")
}
