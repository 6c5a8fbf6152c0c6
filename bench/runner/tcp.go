package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/bench/feed"
	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/tcpbench"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// ServeTCP listens on every address and serves tcpbench requests until
// SIGTERM.
func ServeTCP(addrs []string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	errc := make(chan error, len(addrs))
	for _, a := range addrs {
		ln, err := net.Listen("tcp", a)
		if err != nil {
			return err
		}
		go func() { errc <- tcpbench.Serve(ctx, ln) }()
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

// ClientTCP runs tcpbench.Run and prints its result as JSON.
func ClientTCP(o tcpbench.Options) error {
	r, err := tcpbench.Run(context.Background(), o)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(r)
}

// runTCP measures connections per second and latency through the VIP of
// the last of services TCP services on path, with the server in the sink
// namespace and the client in the generator namespace, both on the
// generator CPU.
func runTCP(cfg *Config, path string, services int) (res report.TCP, err error) {
	res = report.TCP{Path: path, Services: services, Concurrency: cfg.TCPConcurrency, Bucket: tcpbench.HistogramBucket}
	e, err := newEnv(cfg, feed.Pod, path, services, kernelrules.TCP)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.close()) }()
	if _, err := e.t.Exec(e.t.Gen, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=1024 65535"); err != nil {
		return res, err
	}
	cpu := strconv.Itoa(cfg.Plan.GenCPU)
	var listen []string
	for _, a := range topo.SinkAddrs {
		listen = append(listen, netip.AddrPortFrom(a, TCPEndpointPort).String())
	}
	srv := exec.Command("ip", "netns", "exec", e.t.Sink, "taskset", "-c", cpu, cfg.Self, "tcp-server", "--listen", strings.Join(listen, ","))
	srvErr := &tailBuffer{max: 4096}
	srv.Stderr = srvErr
	if err := srv.Start(); err != nil {
		return res, err
	}
	exited := make(chan struct{})
	go func() {
		_ = srv.Wait()
		close(exited)
	}()
	e.closers = append(e.closers, func() error {
		_ = srv.Process.Signal(syscall.SIGTERM)
		<-exited
		return nil
	})
	if err := waitListening(e.t.Sink, listen, exited, 10*time.Second); err != nil {
		return res, fmt.Errorf("tcp-server: %w: %s", err, srvErr.String())
	}
	// The last service: the one iptables' linear chain reaches last.
	target := netip.AddrPortFrom(e.set.VIP(e.set.Count-1), e.set.Port(e.set.Count-1)).String()
	client := func(d time.Duration) (tcpbench.Result, error) {
		cmd := exec.Command("ip", "netns", "exec", e.t.Gen, "taskset", "-c", cpu, cfg.Self, "tcp-client",
			"--target", target, "--duration", d.String(), "--concurrency", strconv.Itoa(cfg.TCPConcurrency))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		b, err := cmd.Output()
		if err != nil {
			return tcpbench.Result{}, fmt.Errorf("tcp-client: %w: %s", err, stderr.String())
		}
		var r tcpbench.Result
		return r, json.Unmarshal(b, &r)
	}
	warm, err := client(300 * time.Millisecond)
	if err != nil {
		return res, err
	}
	if warm.Connections == 0 {
		if c := e.stopXDProxy(); c != "" {
			return res, fmt.Errorf("no connection through %s completed in the 300ms warm-up (%d errors, first: %q); %s", target, warm.Errors, warm.FirstErr, c)
		}
		return res, fmt.Errorf("no connection through %s completed in the 300ms warm-up (%d errors, first: %q)", target, warm.Errors, warm.FirstErr)
	}
	p0, err := e.probe.Read()
	if err != nil {
		return res, err
	}
	r, err := client(cfg.TCPDuration)
	if err != nil {
		return res, err
	}
	p1, err := e.probe.Read()
	if err != nil {
		return res, err
	}
	res.CPS, res.Connections, res.Errors = r.CPS, r.Connections, r.Errors
	res.P50, res.P90, res.P99, res.Histogram = r.P50, r.P90, r.P99, r.Histogram
	if r.Connections > 0 {
		res.CostUs = float64(p1-p0) / float64(time.Microsecond) / float64(r.Connections)
	}
	if r.FirstErr != "" {
		res.Note = "first error: " + r.FirstErr
	}
	return res, nil
}

// waitListening dials every address from inside ns until all accept a
// connection.
func waitListening(ns string, addrs []string, exited <-chan struct{}, timeout time.Duration) error {
	// One deadline for all: an address tried after it passes gets one try.
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for _, a := range addrs {
		var last error
		err := wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) {
			select {
			case <-exited:
				return false, errors.New("exited")
			default:
			}
			last = testbed.DoIn(ns, func() error {
				c, err := net.DialTimeout("tcp", a, 200*time.Millisecond)
				if err == nil {
					c.Close()
				}
				return err
			})
			return last == nil, nil
		})
		if wait.Interrupted(err) {
			return fmt.Errorf("not listening on %s after %v: %w", a, timeout, last)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
