package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/klog/v2"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
)

// loadConfig parses the flags of run and check and loads the config file
// they name, for this host.
func loadConfig(name string, args []string) (*config.Config, error) {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	path := fs.String("config", "", "path of the YAML config file")
	nodeName := fs.String("node-name", "", "this node's name, instead of the file's nodeName")
	_ = fs.Parse(args)
	if *path == "" {
		return nil, fmt.Errorf("%s: --config is required", name)
	}
	return config.LoadWith(*path, config.Options{NodeName: *nodeName})
}

func checkCmd(args []string) error {
	if _, err := loadConfig("check", args); err != nil {
		return err
	}
	fmt.Println("config ok")
	return nil
}

func runCmd(args []string) error {
	cfg, err := loadConfig("run", args)
	if err != nil {
		return err
	}
	host, err := config.ThisHost()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	slog.SetDefault(log)
	klog.SetSlogLogger(log) // client-go's informer logs into the same stream
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("raising the memlock limit: %w", err)
	}
	ecfg, err := engineConfig(cfg, host, log)
	if err != nil {
		return err
	}
	var names []string
	for _, in := range cfg.Interfaces {
		names = append(names, in.Name)
	}
	// The XDP flow table holds one reply tuple per tracked connection,
	// with room for the tuples of ended ones not yet deleted.
	xo := xdp.Options{MaxFrontends: cfg.XDPTables.MaxFrontends, MaxAddrs: cfg.XDPTables.MaxAddresses,
		MaxFlows: cfg.Conntrack.MaxEntries + cfg.Conntrack.MaxEntries/4}
	if ecfg.Kernel, err = dataplane.NewKernel(dataplane.KernelOptions{Interfaces: names, Tables: xo, Log: log}); err != nil {
		return err
	}
	engine, err := dataplane.Start(ecfg)
	if err != nil {
		return err
	}
	defer func() {
		if err := engine.Close(); err != nil {
			log.Warn("closing the dataplane", "err", err)
		}
		log.Info("stopped; XDP programs detached")
	}()

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(newDataplaneCollector(engine))

	opts := service.CompileOptions{ClusterCIDRs: cfg.ClusterCIDRs, MasqueradeAll: cfg.Masquerade.All}
	node := nodeInfo(cfg, engine)
	var lastSync atomic.Int64
	publish := func(m *service.Model) {
		start := time.Now()
		if m.Node.Name == "" {
			m.Node = node
		}
		t := service.CompileFrom(engine.Services().Load(), m, opts)
		for _, p := range t.Problems() {
			log.Warn("service table", "problem", p)
		}
		if err := engine.Publish(t); err != nil {
			log.Error("programming the XDP maps", "err", err)
			return
		}
		lastSync.Store(time.Now().Unix())
		log.Info("published service table", "generation", t.Generation(), "servicePorts", len(m.Ports),
			"frontends", t.Frontends(), "took", time.Since(start).Round(time.Microsecond))
	}
	srcErr := make(chan error, 1)
	if err := startSource(ctx, cfg, reg, log, node, publish, srcErr); err != nil {
		return err
	}

	servers, err := startHTTP(cfg, reg, &lastSync)
	if err != nil {
		return err
	}
	defer func() {
		for _, s := range servers {
			_ = s.Close()
		}
	}()
	admin, err := startAdmin(cfg.AdminSocket, engine)
	if err != nil {
		return err
	}
	defer admin.close()
	log.Info("xdproxy running", "node", cfg.NodeName, "workers", len(engine.Workers()))

	select {
	case <-ctx.Done():
		log.Info("signal received, shutting down")
		return nil
	case err := <-engine.Errors():
		return err
	case err := <-srcErr:
		return err
	}
}

// engineConfig maps the configuration onto the dataplane's settings.
// host gives the CPUs of interfaces that name none.
func engineConfig(cfg *config.Config, host config.Host, log *slog.Logger) (dataplane.EngineConfig, error) {
	ct := cfg.Conntrack
	e := dataplane.EngineConfig{
		BatchSize: cfg.BatchSize, BusyPoll: cfg.BusyPoll, Log: log,
		SNATPorts:          cfg.Masquerade.Ports,
		ReserveSNATPorts:   cfg.Masquerade.ReservePorts,
		ExceptionInterface: cfg.ExceptionInterface,
		Conntrack: conntrack.Config{Capacity: ct.MaxEntries, Timeouts: ct.Timeouts,
			FragmentCapacity: ct.FragmentMaxEntries, FragmentTimeout: ct.FragmentTimeout},
	}
	switch a := cfg.Masquerade.Address; {
	case a.Is4():
		e.SNATAddress4 = packet.AddrFromNetip(a)
	case a.Is6():
		return e, fmt.Errorf("masquerade.address: %s: the dataplane masquerades IPv6 flows to the egress interface's address only", a)
	}
	for _, in := range cfg.Interfaces {
		// The engine takes nil Queues as every queue, and pins the worker
		// of the i-th queue to CPUs[i%len(CPUs)], as the config means.
		cpus := in.CPUs
		if cpus == nil {
			cpus = host.CPUs // every CPU the process may run on
		}
		e.Interfaces = append(e.Interfaces, dataplane.InterfaceConfig{Name: in.Name, Queues: in.Queues, CPUs: cpus,
			Mode: in.XDPMode, Socket: in.Socket})
	}
	return e, nil
}

// nodeInfo is the node as the service table sees it: NodePorts listen on
// the managed interfaces' addresses inside nodePortAddresses.
func nodeInfo(cfg *config.Config, e *dataplane.Engine) service.Node {
	n := service.Node{Name: cfg.NodeName, Zone: cfg.NodeZone}
	for _, a := range e.NodeAddresses() {
		ok := len(cfg.NodePortAddresses) == 0
		for _, p := range cfg.NodePortAddresses {
			ok = ok || p.Contains(a.Netip())
		}
		if ok {
			n.Addresses = append(n.Addresses, a)
		}
	}
	return n
}

// startHTTP serves /metrics and the kube-proxy-style /healthz.
func startHTTP(cfg *config.Config, reg *prometheus.Registry, lastSync *atomic.Int64) ([]*http.Server, error) {
	metrics := http.NewServeMux()
	metrics.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	health := http.NewServeMux()
	healthz := func(w http.ResponseWriter, _ *http.Request) {
		last := lastSync.Load()
		w.Header().Set("Content-Type", "application/json")
		if last == 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintf(w, `{"lastUpdated": %q, "currentTime": %q}`+"\n",
			time.Unix(last, 0).UTC().Format(time.RFC3339), time.Now().UTC().Format(time.RFC3339))
	}
	health.HandleFunc("/healthz", healthz)
	health.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	var out []*http.Server
	for _, s := range []struct {
		addr netip.AddrPort
		h    http.Handler
	}{{cfg.MetricsAddress, metrics}, {cfg.HealthzAddress, health}} {
		ln, err := net.Listen("tcp", s.addr.String())
		if err != nil {
			return out, fmt.Errorf("listening on %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		out = append(out, srv)
	}
	return out, nil
}
