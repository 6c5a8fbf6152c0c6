package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

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
	rc, err := restConfig(k)
	if err != nil {
		return fmt.Errorf("services.kubernetes: %w", err)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("services.kubernetes: %w", err)
	}
	minSync := k.MinSyncPeriod
	if minSync == 0 {
		minSync = -1 // kubesource: zero takes its default, negative means none
	}
	src, err := kubesource.NewForClient(client, kubesource.Config{
		NodeName: cfg.NodeName, NodeZone: cfg.NodeZone, NodeAddresses: node.Addresses, NodePortAddresses: cfg.NodePortAddresses,
		ProxyName: k.ProxyName, DefaultScheduler: cfg.Scheduler, MinSyncPeriod: minSync, MaxSyncPeriod: k.MaxSyncPeriod,
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
		DefaultScheduler: cfg.Scheduler, Logger: log, Metrics: m}, publish)
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

// The pod's service account, which rest.InClusterConfig reads too.
const (
	serviceAccountToken = "/var/run/secrets/kubernetes.io/serviceaccount/token"
	serviceAccountCA    = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
)

// restConfig is the API client's configuration: the kubeconfig's, or the
// pod's service account, with apiServer, when set, as the server. Without
// a kubeconfig, apiServer replaces the in-cluster address, the kubernetes
// Service's ClusterIP, which needs a proxy (this one) to reach the API
// server; the credentials stay the service account's.
func restConfig(k *config.Kubernetes) (*rest.Config, error) {
	var rc *rest.Config
	if k.APIServer != "" && k.Kubeconfig == "" {
		if _, err := os.Stat(serviceAccountToken); err != nil {
			return nil, fmt.Errorf("apiServer without kubeconfig needs the pod's service account token: %w", err)
		}
		rc = &rest.Config{Host: k.APIServer, BearerTokenFile: serviceAccountToken,
			TLSClientConfig: rest.TLSClientConfig{CAFile: serviceAccountCA}}
	} else {
		var err error
		if rc, err = kubesource.RESTConfig(k.Kubeconfig, k.QPS, k.Burst); err != nil {
			return nil, err
		}
		if k.APIServer != "" {
			rc.Host = k.APIServer
		}
	}
	rc.QPS, rc.Burst, rc.UserAgent = k.QPS, k.Burst, "xdproxy"
	return rc, nil
}
