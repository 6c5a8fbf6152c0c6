// Command xdproxy-demo is `make demo`: it builds a throw-away node of
// network namespaces — a node with a 4-queue NIC on a LAN, pods on it
// behind routed veths and a bridge, a second node with remote pods, an
// off-cluster client — runs the xdproxy binary on the node with a static
// service file, and sends real traffic through service VIPs: HTTP and UDP
// from the off-cluster client and through a NodePort (xdproxy's AF_XDP
// path), from a pod on the node and from the node itself (the socket
// programs), and iperf3. It prints which backend answered, the address the
// backend saw, xdproxy's counters and the forwarding rate. Everything it
// made is removed when it ends.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// services are the demo's services, as kubectl would apply them:
// endpoints on this node (node-1) and on node2.
const services = `# The demo's services, as kubectl would apply them.
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: NodePort
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 80, protocol: TCP, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: demo
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 80, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.10], nodeName: node-1, conditions: {ready: true}}
- {addresses: [10.244.1.130], nodeName: node-1, conditions: {ready: true}}
- {addresses: [10.244.2.10], nodeName: node-2, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: demo}
spec:
  clusterIP: 198.19.0.20
  ports: [{name: dns, port: 53, targetPort: 53, protocol: UDP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dns-1
  namespace: demo
  labels: {kubernetes.io/service-name: dns}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}]
endpoints:
- {addresses: [10.244.1.11], nodeName: node-1, conditions: {ready: true}}
- {addresses: [10.244.2.10], nodeName: node-2, conditions: {ready: true}}
- {addresses: [10.244.2.11], nodeName: node-2, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: iperf, namespace: demo}
spec:
  clusterIP: 198.19.0.30
  ports:
  - {name: ctl, port: 5201, targetPort: 5201, protocol: TCP}
  - {name: data, port: 5201, targetPort: 5201, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: iperf-1
  namespace: demo
  labels: {kubernetes.io/service-name: iperf}
addressType: IPv4
ports:
- {name: ctl, port: 5201, protocol: TCP}
- {name: data, port: 5201, protocol: UDP}
endpoints:
- {addresses: [10.244.2.11], nodeName: node-2, conditions: {ready: true}}
`

func main() {
	testbed.ServeIfRequested() // the backend servers are this program run again
	bin := flag.String("bin", "bin", "folder with the xdproxy binary")
	requests := flag.Int("requests", 30, "HTTP requests and UDP datagrams to send")
	flag.Parse()
	if err := run(*bin, *requests); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) { fmt.Printf("\n==> "+format+"\n", args...) }

func run(bin string, requests int) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("run as root: the demo creates network namespaces and attaches XDP programs")
	}
	xdproxy, err := filepath.Abs(filepath.Join(bin, "xdproxy"))
	if err != nil {
		return err
	}
	if _, err := testbed.CleanupStale(); err != nil {
		fmt.Println("note: cleaning up an earlier run:", err)
	}
	step("creating the node: eth0 (4 queues) on a LAN with an off-cluster client 198.18.0.100 and node2 198.18.0.20;\n" +
		"    pods pod-a 10.244.1.10 and pod-b 10.244.1.11 behind routed veths, pod-c 10.244.1.130 behind the cni0 bridge;\n" +
		"    node2's pods n2-pod-a 10.244.2.10 and n2-pod-b 10.244.2.11")
	nb, err := testbed.NewNode(testbed.NodeOptions{})
	if err != nil {
		return err
	}
	defer func() {
		step("cleaning up")
		nb.Close()
	}()
	// Leave the node clean on Ctrl-C too, and when the output is piped
	// into something that stops reading (head).
	signal.Ignore(syscall.SIGPIPE)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	var demoDir atomic.Pointer[string] // once it exists
	go func() {
		<-sig
		nb.Close()
		if d := demoDir.Load(); d != nil {
			removeDemoDir(*d)
		}
		os.Exit(130)
	}()

	step("starting real servers in every pod (HTTP :80, UDP echo :53) and iperf3 in n2-pod-b")
	if err := nb.StartServers(); err != nil {
		return err
	}
	iperf := nb.Command(nb.Pod("n2-pod-b").NS, "iperf3", "-s", "-1")
	if err := iperf.Start(); err != nil {
		return fmt.Errorf("iperf3: %w", err)
	}
	defer iperf.Process.Kill()

	dir, err := os.MkdirTemp("", "xdproxy-demo")
	if err != nil {
		return err
	}
	demoDir.Store(&dir)
	defer removeDemoDir(dir)
	// A bpffs of the demo's own for the pinned programs, gone with it.
	bpffs := filepath.Join(dir, "bpffs")
	if err := os.Mkdir(bpffs, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("bpf", bpffs, "bpf", 0, ""); err != nil {
		return fmt.Errorf("mounting a bpffs: %w", err)
	}
	svcFile := filepath.Join(dir, "services.yaml")
	admin := filepath.Join(dir, "admin.sock")
	cfg := fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: node-1
interfaces:
  - {name: eth0, xdpMode: native}   # every queue, workers on every CPU
services:
  file: %s
clusterCIDR: 10.244.0.0/16
metricsAddress: 127.0.0.1:10249
healthzAddress: 127.0.0.1:10256
adminSocket: %s
stateDir: %s
bpffsDir: %s
localClients: {cgroup: %s}   # the demo node's cgroup: its pods and host processes
`, svcFile, admin, filepath.Join(dir, "state"), filepath.Join(bpffs, "xdproxy"), nb.Cgroup())
	cfgFile := filepath.Join(dir, "xdproxy.yaml")
	if err := os.WriteFile(svcFile, []byte(services), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		return err
	}
	step("giving the connection table huge pages, as the DaemonSet's init container does: %s mount-state-dir --config %s", xdproxy, cfgFile)
	mounted, err := exec.Command(xdproxy, "mount-state-dir", "--config", cfgFile).CombinedOutput()
	if err != nil {
		return fmt.Errorf("xdproxy mount-state-dir: %v: %s", err, mounted)
	}
	fmt.Print(indent(string(mounted)))
	step("running xdproxy on the node: %s run --config %s", xdproxy, cfgFile)
	fmt.Print(indent(cfg))
	var logBuf bytes.Buffer
	agent := exec.Command(xdproxy, "run", "--config", cfgFile)
	agent.Stdout, agent.Stderr = &logBuf, &logBuf
	if err := nb.Start(nb.NodeNS(), agent); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- agent.Wait() }()
	defer func() {
		_ = agent.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			step("xdproxy stopped (exit: %v); its log:", errString(err))
		case <-time.After(10 * time.Second):
			_ = agent.Process.Kill()
			step("xdproxy did not stop in 10s; killed. Its log:")
		}
		fmt.Print(indent(logBuf.String()))
	}()
	if err := waitReady(admin, exited); err != nil {
		fmt.Print(indent(logBuf.String()))
		return err
	}
	raw, _ := adminGet(admin, "interfaces")
	step("served interfaces (xdproxy admin interfaces)")
	fmt.Print(indent(raw))

	curl := func(who string, inNode bool, ns, url string) error {
		step("%d HTTP requests from %s to %s with curl (a new connection each); backend and the client address it saw:", requests, who, url)
		hits := map[string]int{}
		for range requests {
			cmd := exec.Command("curl", "-sS", "--max-time", "3", url+"/whoami")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := nb.Start
			if inNode {
				start = nb.StartInCgroup // a pod or process of the node
			}
			if err := start(ns, cmd); err != nil {
				return err
			}
			if err := cmd.Wait(); err != nil {
				return fmt.Errorf("curl from %s: %v: %s", who, err, out.String())
			}
			name, src, _ := strings.Cut(strings.TrimSpace(out.String()), " ")
			host, _, _ := strings.Cut(src, ":")
			hits[name+" (saw "+host+")"]++
		}
		printHits(hits)
		return nil
	}
	client, node, podB := nb.Client(), nb.Node(), nb.Pod("pod-b")
	for _, c := range []struct {
		who    string
		inNode bool
		ns     string
		url    string
	}{
		{"the off-cluster client", false, client.NS, "http://198.19.0.10"},
		{"the off-cluster client", false, client.NS, "http://" + node.Addr.String() + ":30080"},
		{"pod-b, a pod on the node", true, podB.NS, "http://198.19.0.10"},
		{"the node itself", true, node.NS, "http://198.19.0.10"},
	} {
		if err := curl(c.who, c.inNode, c.ns, c.url); err != nil {
			return err
		}
	}

	step("%d UDP datagrams from the off-cluster client to 198.19.0.20:53 (each from a new source port)", requests)
	hits := map[string]int{}
	for i := range requests {
		c, err := nb.Dial(context.Background(), client.NS, "udp", "198.19.0.20:53")
		if err != nil {
			return err
		}
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		fmt.Fprintf(c, "hello-%d", i)
		buf := make([]byte, 256)
		n, err := c.Read(buf)
		c.Close()
		if err != nil {
			return fmt.Errorf("udp reply: %w", err)
		}
		name, _, _ := strings.Cut(string(buf[:n]), " ")
		hits[name]++
	}
	printHits(hits)

	step("iperf3 UDP from the off-cluster client through the VIP for 3 s (64-byte datagrams, unlimited rate): the forwarding rate")
	before := counters(admin)
	start := time.Now()
	out, err := nb.Exec(client.NS, "iperf3", "-c", "198.19.0.30", "-u", "-b", "0", "-l", "64", "-t", "3", "--connect-timeout", "3000")
	elapsed := time.Since(start)
	after := counters(admin)
	if err != nil {
		fmt.Print(indent(string(out)))
		return fmt.Errorf("iperf3: %w", err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if strings.Contains(l, "receiver") || strings.Contains(l, "sender") {
			fmt.Println("   ", strings.TrimSpace(l))
		}
	}
	fwd := after.Workers.Forwarded - before.Workers.Forwarded
	fmt.Printf("    xdproxy forwarded %d frames in %.1f s: %.0f packets/s (both directions)\n",
		fwd, elapsed.Seconds(), float64(fwd)/elapsed.Seconds())

	step("xdproxy's counters (xdproxy admin stats)")
	raw, _ = adminGet(admin, "stats")
	fmt.Print(indent(raw))
	step("tracked connections (first lines of xdproxy admin conntrack)")
	raw, _ = adminGet(admin, "conntrack")
	ls := strings.Split(raw, "\n")
	if len(ls) > 16 {
		ls = append(ls[:16], "  ...")
	}
	fmt.Print(indent(strings.Join(ls, "\n") + "\n"))
	return nil
}

type stats struct {
	Workers struct{ Forwarded, RxFrames uint64 } `json:"workers"`
	Table   struct{ Frontends int }              `json:"table"`
}

func counters(admin string) stats {
	var s stats
	raw, err := adminGet(admin, "stats")
	if err == nil {
		_ = json.Unmarshal([]byte(raw), &s)
	}
	return s
}

func waitReady(admin string, exited chan error) error {
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		select {
		case err := <-exited:
			return false, fmt.Errorf("xdproxy exited: %v", errString(err))
		default:
		}
		return counters(admin).Table.Frontends > 0, nil
	})
	if wait.Interrupted(err) {
		return fmt.Errorf("xdproxy did not publish its services in 20 s")
	}
	return err
}

func adminGet(sock, what string) (string, error) {
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
	resp, err := c.Get("http://xdproxy/" + what)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, err = b.ReadFrom(resp.Body)
	return b.String(), err
}

func printHits(hits map[string]int) {
	var names []string
	for n := range hits {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Printf("    %-10s %3d %s\n", n, hits[n], strings.Repeat("#", hits[n]))
	}
}

func indent(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
		b.WriteString("    " + l + "\n")
	}
	return b.String()
}

func errString(err error) string {
	if err == nil {
		return "0"
	}
	return err.Error()
}

// removeDemoDir removes the demo's directory, unmounting what the demo
// mounted in it first (its bpffs, the state directory's tmpfs), or the
// mount points would stay behind.
func removeDemoDir(dir string) {
	for _, m := range []string{"state", "bpffs"} {
		_ = unix.Unmount(filepath.Join(dir, m), unix.MNT_DETACH)
	}
	_ = os.RemoveAll(dir)
}
