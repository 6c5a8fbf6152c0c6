package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/kubernetes"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/control/filesource"
	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/dataplane"
)

// Options are what Run needs besides the context.
type Options struct {
	Config *config.Config
	// Host gives the CPUs of interfaces whose config names none.
	Host    config.Host
	Version string
	Log     *slog.Logger
}

// Run runs xdproxy until ctx ends or something fatal happens (a worker
// cannot be pinned, the source fails for good). Leaving, it keeps the
// state the next process adopts (see the package documentation).
func Run(ctx context.Context, o Options) error {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	a, err := start(o)
	if err != nil {
		return err
	}
	defer a.close()

	src, err := a.startSource(ctx)
	if err != nil {
		return err
	}
	o.Log.Info("xdproxy running", "version", o.Version, "node", o.Config.NodeName, "workers", len(a.engine.Workers()))
	select {
	case <-ctx.Done():
		o.Log.Info("stopping; state kept for the next start")
		return nil
	case err := <-a.engine.Errors():
		return err
	case err := <-src:
		return err
	}
}

// agent is one running xdproxy.
type agent struct {
	cfg     *config.Config
	log     *slog.Logger
	version string

	engine   *dataplane.Engine
	proxy    *health.Proxy
	services *health.Services
	reg      *prometheus.Registry
	metrics  *metrics.Metrics
	pub      *publisher
	admin    *adminServer
	servers  []*http.Server
	// nodeState is the Node's state for /healthz; nil without an API
	// server (a static file has no Node).
	nodeState func() health.NodeState
}

func start(o Options) (a *agent, err error) {
	cfg := o.Config
	a = &agent{cfg: cfg, log: o.Log, version: o.Version, reg: prometheus.NewRegistry()}
	defer func() {
		if err != nil {
			a.close()
		}
	}()
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("raising the memlock limit: %w", err)
	}
	if a.engine, err = startEngine(cfg, o.Host, o.Log); err != nil {
		return nil, err
	}
	a.proxy = health.NewProxy(health.ProxyOptions{
		// kube-proxy allows twice its sync period.
		Timeout: 2 * syncPeriod(cfg),
		Node: func() health.NodeState {
			if a.nodeState == nil {
				return health.NodeState{Known: true}
			}
			return a.nodeState()
		},
		Ready: []health.Check{{Name: "interfaces", Err: a.engine.Healthy}},
		Live:  []health.Check{{Name: "workers", Err: a.workersAlive}},
	})
	a.services = health.NewServices(a.proxy, nodePortListenAddrs(cfg, a.engine), o.Log)
	if a.metrics, err = metrics.New(a.reg); err != nil {
		return nil, err
	}
	a.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	a.reg.MustRegister(newDataplaneCollector(a.engine, a.proxy, flowTableSize(cfg.Conntrack.MaxEntries)))
	if a.pub, err = newPublisher(a, a.reg); err != nil {
		return nil, err
	}
	if err := a.serveHTTP(); err != nil {
		return nil, err
	}
	if a.admin, err = startAdmin(cfg.AdminSocket, a); err != nil {
		return nil, err
	}
	// What the last process published, so that new connections keep
	// working until the source has synced.
	a.pub.restore()
	return a, nil
}

// syncPeriod is the longest the source waits between syncs.
func syncPeriod(cfg *config.Config) time.Duration {
	if k := cfg.Services.Kubernetes; k != nil && k.MaxSyncPeriod > 0 {
		return k.MaxSyncPeriod
	}
	return 30 * time.Second
}

// workerStuck is how long a worker may go without a turn of its loop (an
// idle one turns at least every 200 ms) before /livez fails.
const workerStuck = 10 * time.Second

func (a *agent) workersAlive() error {
	now := dataplane.MonotonicNow()
	var stuck []string
	for _, w := range a.engine.Workers() {
		if since := time.Duration(now - w.Alive()); since > workerStuck {
			stuck = append(stuck, fmt.Sprintf("the worker of %s queue %d has not gone round for %v",
				w.Port().Name, w.Port().Queue, since.Round(time.Second)))
		}
	}
	if len(stuck) > 0 {
		return errors.New(strings.Join(stuck, "; "))
	}
	return nil
}

// startSource starts the configured service source; its fatal error comes
// on the channel.
func (a *agent) startSource(ctx context.Context) (<-chan error, error) {
	errc := make(chan error, 1)
	cfg := a.cfg
	run := func(name string, r func(context.Context) error) {
		go func() {
			if err := r(ctx); err != nil && ctx.Err() == nil {
				errc <- fmt.Errorf("%s source: %w", name, err)
			}
		}()
	}
	if cfg.Services.File != "" {
		src, err := filesource.New(filesource.Config{Path: cfg.Services.File, Node: a.pub.node,
			DefaultScheduler: cfg.Scheduler, Logger: a.log, Metrics: a.metrics, Health: a.proxy}, a.pub.publish)
		if err != nil {
			return nil, fmt.Errorf("services.file: %w", err)
		}
		run("file", src.Run)
		return errc, nil
	}
	k := cfg.Services.Kubernetes
	rc, err := restConfig(k)
	if err != nil {
		return nil, fmt.Errorf("services.kubernetes: %w", err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("services.kubernetes: %w", err)
	}
	minSync := k.MinSyncPeriod
	if minSync == 0 {
		minSync = -1 // kubesource: zero takes its default, negative means none
	}
	src, err := kubesource.NewForClient(client, kubesource.Config{
		NodeName: cfg.NodeName, NodeZone: cfg.NodeZone, NodeAddresses: a.pub.node.Addresses,
		NodePortAddresses: cfg.NodePortAddresses, ProxyName: k.ProxyName, DefaultScheduler: cfg.Scheduler,
		MinSyncPeriod: minSync, MaxSyncPeriod: k.MaxSyncPeriod, Logger: a.log, Metrics: a.metrics, Health: a.proxy,
	}, a.pub.publish)
	if err != nil {
		return nil, fmt.Errorf("services.kubernetes: %w", err)
	}
	a.nodeState = src.NodeState
	run("kubernetes", src.Run)
	return errc, nil
}

// serveHTTP serves /metrics and the health endpoints.
func (a *agent) serveHTTP() error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{}))
	for _, s := range []struct {
		addr string
		h    http.Handler
	}{{a.cfg.MetricsAddress.String(), mux}, {a.cfg.HealthzAddress.String(), a.proxy.Handler()}} {
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return fmt.Errorf("listening on %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		a.servers = append(a.servers, srv)
	}
	return nil
}

func (a *agent) close() {
	var errs []error
	if a.admin != nil {
		a.admin.close()
	}
	for _, s := range a.servers {
		errs = append(errs, s.Close())
	}
	if a.services != nil {
		a.services.Close()
	}
	if a.pub != nil {
		a.pub.close()
	}
	if a.engine != nil {
		errs = append(errs, a.engine.Close())
	}
	if err := errors.Join(errs...); err != nil {
		a.log.Warn("stopping", "err", err)
	}
}
