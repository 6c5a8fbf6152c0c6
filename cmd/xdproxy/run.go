package main

import (
	"context"
	"errors"
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
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

func checkCmd(args []string) error {
	_, path := configFlag("check", args)
	if *path == "" {
		return errors.New("check: --config is required")
	}
	if _, err := config.Load(*path); err != nil {
		return err
	}
	fmt.Println("config ok")
	return nil
}

func runCmd(args []string) error {
	_, path := configFlag("run", args)
	if *path == "" {
		return errors.New("run: --config is required")
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	slog.SetDefault(log)
	klog.SetSlogLogger(log) // client-go's informer logs into the same stream
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("raising the memlock limit: %w", err)
	}
	ecfg, err := engineConfig(cfg, log)
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

	cidrs, _ := cfg.ClusterCIDRs()
	opts := service.CompileOptions{ClusterCIDRs: cidrs, MasqueradeAll: cfg.Masquerade.All}
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

// engineConfig maps the config file onto the dataplane's settings.
func engineConfig(cfg *config.Config, log *slog.Logger) (dataplane.EngineConfig, error) {
	lo, hi, _ := cfg.PortRange()
	ct := cfg.Conntrack
	e := dataplane.EngineConfig{
		BatchSize: cfg.BatchSize, BusyPoll: cfg.BusyPoll, Log: log,
		SNATPorts:          conntrack.PortRange{First: lo, Last: hi},
		ExceptionInterface: "xdpx0",
		Conntrack: conntrack.Config{
			Capacity: ct.MaxEntries, FragmentCapacity: ct.FragmentTableMaxLen, FragmentTimeout: ct.FragmentTimeout.Duration,
			Timeouts: conntrack.Timeouts{
				TCPSynSent: ct.TCPSynSent.Duration, TCPSynRecv: ct.TCPSynRecv.Duration, TCPEstablished: ct.TCPEstablished.Duration,
				TCPFinWait: ct.TCPFinWait.Duration, TCPCloseWait: ct.TCPCloseWait.Duration, TCPLastAck: ct.TCPLastAck.Duration,
				TCPTimeWait: ct.TCPTimeWait.Duration, TCPClose: ct.TCPClose.Duration,
				UDPUnreplied: ct.UDPUnreplied.Duration, UDPReplied: ct.UDPReplied.Duration, ICMPEcho: ct.ICMP.Duration,
			},
		},
	}
	if cfg.Masquerade.Address != "" {
		a := netip.MustParseAddr(cfg.Masquerade.Address) // validated by config
		if a.Is4() {
			e.SNATAddress4 = packet.AddrFromNetip(a)
		}
	}
	for _, in := range cfg.Interfaces {
		mode := map[string]xdp.Mode{"auto": xdp.Auto, "native": xdp.Native, "generic": xdp.Generic}[in.XDPMode]
		bind := map[string]afxdp.BindMode{"auto": afxdp.Auto, "copy": afxdp.Copy, "zerocopy": afxdp.ZeroCopy}[in.BindMode]
		sc := afxdp.Config{NumFrames: in.NumFrames, FrameSize: in.FrameSize, FillRingSize: in.FillRingSize,
			CompletionRingSize: in.CompletionRingSize, RxRingSize: in.RxRingSize, TxRingSize: in.TxRingSize, Mode: bind, NeedWakeup: true}
		if err := sc.Validate(); err != nil {
			return e, fmt.Errorf("interfaces[%s]: %w", in.Name, err)
		}
		e.Interfaces = append(e.Interfaces, dataplane.InterfaceConfig{Name: in.Name, Queues: in.Queues, CPUs: in.CPUs, Mode: mode, Socket: sc})
	}
	return e, nil
}

// nodeInfo is the node as the service table sees it: NodePorts listen on
// the managed interfaces' addresses inside nodePortAddresses.
func nodeInfo(cfg *config.Config, e *dataplane.Engine) service.Node {
	n := service.Node{Name: cfg.NodeName, Zone: cfg.NodeZone}
	var prefixes []netip.Prefix
	for _, s := range cfg.NodePortAddresses {
		prefixes = append(prefixes, netip.MustParsePrefix(s))
	}
	for _, a := range e.NodeAddresses() {
		ok := len(prefixes) == 0
		for _, p := range prefixes {
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
		addr string
		h    http.Handler
	}{{cfg.MetricsAddress, metrics}, {cfg.HealthzAddress, health}} {
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return out, fmt.Errorf("listening on %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		out = append(out, srv)
	}
	return out, nil
}
