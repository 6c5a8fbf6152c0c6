// Command xdproxy-demo is `make demo`: it builds a throw-away topology of
// network namespaces (a client, a node, three backends with real servers),
// runs the xdproxy binary on the node with a static service file, sends
// real HTTP, UDP and iperf3 traffic through a service VIP and prints what
// happened: which backend answered, xdproxy's counters, the forwarding
// rate. Everything it made is removed when it ends.
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
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

const services = `# The demo's services, as kubectl would apply them.
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 80, protocol: TCP}]
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
- {addresses: [198.18.1.11], conditions: {ready: true}}
- {addresses: [198.18.1.12], conditions: {ready: true}}
- {addresses: [198.18.1.13], conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: demo}
spec:
  clusterIP: 198.19.0.20
  ports: [{name: udp, port: 53, targetPort: 53, protocol: UDP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: echo-1
  namespace: demo
  labels: {kubernetes.io/service-name: echo}
addressType: IPv4
ports: [{name: udp, port: 53, protocol: UDP}]
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}}
- {addresses: [198.18.1.12], conditions: {ready: true}}
- {addresses: [198.18.1.13], conditions: {ready: true}}
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
- {addresses: [198.18.1.11], conditions: {ready: true}}
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
	step("creating namespaces: client 198.18.0.2 -> node (xdproxy) -> 3 backends 198.18.1.11-13")
	tb, err := testbed.New(testbed.Options{})
	if err != nil {
		return err
	}
	defer func() {
		step("cleaning up")
		tb.Close()
	}()
	// Leave the node clean on Ctrl-C too.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() { <-sig; tb.Close(); os.Exit(130) }()

	step("starting real servers in the backend namespaces (HTTP :80, UDP echo :53, iperf3 on backend-0)")
	if err := tb.StartServers(); err != nil {
		return err
	}
	iperf := tb.Command(tb.BackendNS(0), "iperf3", "-s", "-1")
	if err := iperf.Start(); err != nil {
		return fmt.Errorf("iperf3: %w", err)
	}
	defer iperf.Process.Kill()

	dir, err := os.MkdirTemp("", "xdproxy-demo")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	svcFile := filepath.Join(dir, "services.yaml")
	admin := filepath.Join(dir, "admin.sock")
	cfg := fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: node-1
interfaces:
  - {name: n0, queues: [0], cpus: [1], xdpMode: native}
  - {name: n1, queues: [0], cpus: [1], xdpMode: native}
services:
  file: %s
clusterCIDR: 198.18.0.0/24
metricsAddress: 127.0.0.1:10249
healthzAddress: 127.0.0.1:10256
adminSocket: %s
`, svcFile, admin)
	cfgFile := filepath.Join(dir, "xdproxy.yaml")
	if err := os.WriteFile(svcFile, []byte(services), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		return err
	}
	step("running xdproxy on the node: %s run --config %s", xdproxy, cfgFile)
	fmt.Print(indent(cfg))
	var logBuf bytes.Buffer
	agent := tb.Command(tb.NodeNS(), xdproxy, "run", "--config", cfgFile)
	agent.Stdout, agent.Stderr = &logBuf, &logBuf
	if err := agent.Start(); err != nil {
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

	step("%d HTTP requests from the client to http://198.19.0.10/ with curl (a new connection each)", requests)
	hits := map[string]int{}
	for i := 0; i < requests; i++ {
		out, err := tb.Exec(tb.ClientNS(), "curl", "-sS", "--max-time", "3", "http://198.19.0.10/")
		if err != nil {
			return fmt.Errorf("curl: %v: %s", err, out)
		}
		hits[strings.TrimSpace(string(out))]++
	}
	printHits(hits)

	step("%d UDP datagrams to 198.19.0.20:53 (each from a new source port)", requests)
	hits = map[string]int{}
	for i := 0; i < requests; i++ {
		c, err := tb.Dial(context.Background(), tb.ClientNS(), "udp", "198.19.0.20:53")
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

	step("iperf3 UDP through the VIP for 3 s (64-byte datagrams, unlimited rate): the forwarding rate")
	before := counters(admin)
	start := time.Now()
	out, err := tb.Exec(tb.ClientNS(), "iperf3", "-c", "198.19.0.30", "-u", "-b", "0", "-l", "64", "-t", "3", "--connect-timeout", "3000")
	elapsed := time.Since(start)
	after := counters(admin)
	if err != nil {
		fmt.Print(indent(string(out)))
		return fmt.Errorf("iperf3: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	for _, l := range lines {
		if strings.Contains(l, "receiver") || strings.Contains(l, "sender") {
			fmt.Println("   ", strings.TrimSpace(l))
		}
	}
	fwd := after.Workers.Forwarded - before.Workers.Forwarded
	fmt.Printf("    xdproxy forwarded %d frames in %.1f s: %.0f packets/s (both directions, one worker CPU)\n",
		fwd, elapsed.Seconds(), float64(fwd)/elapsed.Seconds())

	step("xdproxy's counters (xdproxy admin stats)")
	raw, _ := adminGet(admin, "stats")
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
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("xdproxy exited: %v", errString(err))
		default:
		}
		if counters(admin).Table.Frontends > 0 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("xdproxy did not publish its services in 20 s")
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
