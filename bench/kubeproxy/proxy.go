package kubeproxy

import (
	"context"
	"errors"
	"fmt"
	"github.com/xdproxy/xdproxy/internal/kubetest"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
)

// Options configure Start.
type Options struct {
	Mode Mode
	// Namespace is the network namespace kube-proxy programs (the
	// benchmark's node).
	Namespace string
	// Services are created through the API before kube-proxy starts, so
	// that its first sync programs all of them.
	Services    kernelrules.ServiceSet
	ClusterCIDR netip.Prefix
	NodeName    string
	NodeAddr    netip.Addr
	Bins        Binaries
	// CPU is where the control plane and kube-proxy run, away from the
	// forwarding CPU: the paths without a control plane have none
	// competing with the forwarding threads either. Negative: anywhere.
	CPU int
	// Timeout bounds waiting for kube-proxy's rules (default 3 minutes).
	Timeout time.Duration
}

// Proxy is a running control plane and kube-proxy.
type Proxy struct {
	opts    Options
	dir     string
	cluster *kubetest.Cluster
	stopFwd func() error
	proc    *kubetest.Process
	config  string
	// Applied is how long creating the services through the API took;
	// Programmed how long kube-proxy took from its start until its rules
	// held every service.
	Applied, Programmed time.Duration
}

// Start runs the control plane, creates the node and the services,
// starts kube-proxy in opts.Namespace and returns once kube-proxy's rules
// hold every service with its endpoints. On error nothing is left behind.
func Start(o Options) (_ *Proxy, err error) {
	if o.Timeout == 0 {
		o.Timeout = 3 * time.Minute
	}
	if err := o.Services.Validate(); err != nil {
		return nil, err
	}
	p := &Proxy{opts: o}
	track(p, true)
	defer func() {
		if err != nil {
			err = errors.Join(err, p.Close())
		}
	}()
	if p.dir, err = os.MkdirTemp("", "xdproxy-bench-kube-"); err != nil {
		return nil, err
	}
	if p.cluster, err = StartCluster(p.dir, o.Services.ServiceCIDR, o.CPU); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
	defer cancel()
	if err := createNode(ctx, p.cluster.Client(), o.NodeName, o.NodeAddr.String()); err != nil {
		return nil, err
	}
	began := time.Now()
	if err := Apply(ctx, p.cluster.Client(), o.Services, o.NodeName); err != nil {
		return nil, err
	}
	p.Applied = time.Since(began)

	ln, err := testbed.ForwardInto(o.Namespace, strings.TrimPrefix(p.cluster.Server(), "https://"))
	if err != nil {
		return nil, err
	}
	p.stopFwd = ln.Close
	kubeconfig := filepath.Join(p.dir, "kubeconfig")
	if err := p.cluster.WriteKubeconfig(kubeconfig, "https://"+ln.Addr().String()); err != nil {
		return nil, err
	}
	// A fresh namespace has these ports to itself.
	cfg, err := Config{
		Mode: o.Mode, ClusterCIDR: o.ClusterCIDR, NodeName: o.NodeName, Kubeconfig: kubeconfig,
		MetricsAddr: "127.0.0.1:10249", HealthzAddr: "127.0.0.1:10256",
	}.YAML()
	if err != nil {
		return nil, err
	}
	p.config = filepath.Join(p.dir, "kube-proxy.yaml")
	if err := os.WriteFile(p.config, cfg, 0o644); err != nil {
		return nil, err
	}
	began = time.Now()
	argv := pinned(o.CPU, "ip", "netns", "exec", o.Namespace, o.Bins.KubeProxy, "--config="+p.config, "--v=1")
	p.proc, err = kubetest.StartProcess("kube-proxy", argv[0], argv[1:], filepath.Join(p.dir, "kube-proxy.log"))
	if err != nil {
		return nil, err
	}
	for {
		out, err := p.rules()
		n := 0
		if err == nil {
			n = Programmed(o.Mode, out, o.Services)
		}
		switch {
		case n == o.Services.Count:
			p.Programmed = time.Since(began)
			return p, nil
		case p.proc.Exited():
			return nil, fmt.Errorf("kube-proxy exited (%v): %s", p.proc.Err(), p.proc.LogTail(3000))
		case time.Since(began) > o.Timeout:
			return nil, fmt.Errorf("kube-proxy programmed %d of %d services in %v (last error %v): %s", n, o.Services.Count, o.Timeout, err, p.proc.LogTail(3000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// rules is the part of the namespace's ruleset that holds the services.
func (p *Proxy) rules() (string, error) {
	args := []string{"netns", "exec", p.opts.Namespace, "iptables-save", "-t", "nat"}
	if p.opts.Mode == NFTables {
		args = []string{"netns", "exec", p.opts.Namespace, "nft", "list", "map", "ip", "kube-proxy", "service-ips"}
	}
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(args[3:], " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

var (
	// -A KUBE-SERVICES -d 198.19.0.2/32 -p udp -m comment ... --dport 80 -j KUBE-SVC-...
	iptablesService = regexp.MustCompile(`(?m)^-A KUBE-SERVICES -d ([0-9.]+)/32 -p (udp|tcp) .*--dport (\d+) -j KUBE-SVC-`)
	// 198.19.0.2 . udp . 80 : goto service-...
	nftService = regexp.MustCompile(`([0-9.]+) \. (udp|tcp) \. (\d+) : goto service-`)
)

// Programmed counts the services of set that kube-proxy's rules (out of
// iptables-save -t nat, or nft list map ip kube-proxy service-ips) send
// to their endpoints. kube-proxy writes these entries only for services
// with endpoints, so a service that is counted has its endpoint chain too.
func Programmed(mode Mode, out string, set kernelrules.ServiceSet) int {
	re := iptablesService
	if mode == NFTables {
		re = nftService
	}
	want := make(map[string]bool, set.Count)
	for i := range set.Count {
		want[set.VIP(i).String()+" "+strconv.Itoa(int(set.Port(i)))] = true
	}
	n := 0
	for _, m := range re.FindAllStringSubmatch(out, -1) {
		k := m[1] + " " + m[3]
		if m[2] == string(set.Proto) && want[k] {
			n++
			delete(want, k)
		}
	}
	return n
}

// Log is the end of kube-proxy's log.
func (p *Proxy) Log() string {
	if p.proc == nil {
		return ""
	}
	return p.proc.LogTail(3000)
}

// Close stops kube-proxy and removes its rules (kube-proxy --cleanup),
// stops the API server and etcd and removes their files. It reports rules
// that survived the cleanup.
func (p *Proxy) Close() error {
	track(p, false)
	var errs []error
	if p.proc != nil {
		p.proc.Stop(10 * time.Second)
		out, err := exec.Command("ip", "netns", "exec", p.opts.Namespace, p.opts.Bins.KubeProxy, "--cleanup", "--config="+p.config).CombinedOutput()
		if left, lerr := p.rules(); lerr == nil && Programmed(p.opts.Mode, left, p.opts.Services) > 0 {
			errs = append(errs, fmt.Errorf("kube-proxy --cleanup (%v) left its rules behind: %s", err, strings.TrimSpace(string(out))))
		}
		p.proc = nil
	}
	if p.stopFwd != nil {
		errs = append(errs, p.stopFwd())
		p.stopFwd = nil
	}
	if p.cluster != nil {
		p.cluster.Close()
		p.cluster = nil
	}
	if p.dir != "" {
		errs = append(errs, os.RemoveAll(p.dir))
		p.dir = ""
	}
	return errors.Join(errs...)
}

// live are the proxies not yet closed, for CloseAll.
var live struct {
	sync.Mutex
	set map[*Proxy]bool
}

func track(p *Proxy, on bool) {
	live.Lock()
	defer live.Unlock()
	if live.set == nil {
		live.set = map[*Proxy]bool{}
	}
	if on {
		live.set[p] = true
	} else {
		delete(live.set, p)
	}
}

// CloseAll closes every proxy not yet closed: for an interrupted run,
// whose control plane would otherwise be killed without its files
// removed.
func CloseAll() {
	live.Lock()
	ps := make([]*Proxy, 0, len(live.set))
	for p := range live.set {
		ps = append(ps, p)
	}
	live.Unlock()
	for _, p := range ps {
		_ = p.Close()
	}
}
