package kubeproxy

import (
	"fmt"
	"net/netip"
)

// Mode is kube-proxy's proxy mode.
type Mode string

// The modes the benchmark measures.
const (
	IPTables Mode = "iptables"
	NFTables Mode = "nftables"
)

// Config is what the benchmark sets in kube-proxy's configuration file;
// everything else keeps kube-proxy's defaults.
type Config struct {
	Mode Mode
	// ClusterCIDR is the pod range: clients inside it are not
	// masqueraded, as for the benchmark's other paths.
	ClusterCIDR netip.Prefix
	NodeName    string
	Kubeconfig  string
	// MetricsAddr and HealthzAddr are host:port in the node namespace.
	MetricsAddr, HealthzAddr string
}

// Validate reports a configuration kube-proxy would reject or the
// benchmark cannot use.
func (c Config) Validate() error {
	switch {
	case c.Mode != IPTables && c.Mode != NFTables:
		return fmt.Errorf("kubeproxy: mode %q, want iptables or nftables", c.Mode)
	case !c.ClusterCIDR.IsValid():
		return fmt.Errorf("kubeproxy: a cluster CIDR is required")
	case c.NodeName == "" || c.Kubeconfig == "":
		return fmt.Errorf("kubeproxy: node name and kubeconfig are required")
	case c.MetricsAddr == "" || c.HealthzAddr == "":
		return fmt.Errorf("kubeproxy: metrics and healthz addresses are required")
	}
	return nil
}

// YAML is the KubeProxyConfiguration file. The conntrack settings are
// zero so that kube-proxy leaves the global nf_conntrack_max and the
// timeouts alone (a namespace cannot change the first; the second would
// make its runs differ from the kernel paths').
func (c Config) YAML() ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
clusterCIDR: %s
detectLocalMode: ClusterCIDR
hostnameOverride: %s
metricsBindAddress: %s
healthzBindAddress: %s
clientConnection:
  kubeconfig: %s
  qps: 50
  burst: 100
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
  udpTimeout: 0s
  udpStreamTimeout: 0s
iptables:
  minSyncPeriod: 1s
  syncPeriod: 30s
nftables:
  minSyncPeriod: 1s
  syncPeriod: 30s
`, c.Mode, c.ClusterCIDR, c.NodeName, c.MetricsAddr, c.HealthzAddr, c.Kubeconfig), nil
}
