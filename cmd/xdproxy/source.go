package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/control/filesource"
	"github.com/xdproxy/xdproxy/control/kubesource"
	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/dataplane/service"
)

// startSource starts the configured service source on its own goroutine.
// node is the node as the dataplane sees it; publish receives every model.
func startSource(ctx context.Context, cfg *config.Config, reg *prometheus.Registry, log *slog.Logger,
	node service.Node, publish func(*service.Model), errc chan<- error) error {
	m, err := metrics.New(reg)
	if err != nil {
		return err
	}
	if cfg.Services.File != "" {
		return startFileSource(ctx, cfg, log, node, m, publish, errc)
	}
	k := cfg.Services.Kubernetes
	var prefixes []netip.Prefix
	for _, s := range cfg.NodePortAddresses {
		prefixes = append(prefixes, netip.MustParsePrefix(s))
	}
	src, err := kubesource.New(kubesource.Config{
		Kubeconfig: k.Kubeconfig, QPS: k.QPS, Burst: k.Burst,
		NodeName: cfg.NodeName, NodeZone: cfg.NodeZone, NodeAddresses: node.Addresses, NodePortAddresses: prefixes,
		ProxyName: k.ProxyName, DefaultScheduler: scheduler(cfg.Scheduler), MinSyncPeriod: k.MinSyncPeriod.Duration, MaxSyncPeriod: k.MaxSyncPeriod.Duration,
		Logger: log, Metrics: m,
	}, publish)
	if err != nil {
		return fmt.Errorf("services.kubernetes: %w", err)
	}
	go func() {
		if err := src.Run(ctx); err != nil && ctx.Err() == nil {
			errc <- fmt.Errorf("kubernetes source: %w", err)
		}
	}()
	return nil
}

func startFileSource(ctx context.Context, cfg *config.Config, log *slog.Logger, node service.Node,
	m *metrics.Metrics, publish func(*service.Model), errc chan<- error) error {
	src, err := filesource.New(filesource.Config{Path: cfg.Services.File, Node: node,
		DefaultScheduler: scheduler(cfg.Scheduler), Logger: log, Metrics: m}, publish)
	if err != nil {
		return fmt.Errorf("services.file: %w", err)
	}
	go func() {
		if err := src.Run(ctx); err != nil && ctx.Err() == nil {
			errc <- fmt.Errorf("file source: %w", err)
		}
	}()
	return nil
}

// scheduler maps the config's scheduler name (validated) to the model's.
func scheduler(name string) service.Scheduler {
	switch name {
	case "roundrobin":
		return service.RoundRobin
	case "maglev":
		return service.Maglev
	}
	return service.Random
}
