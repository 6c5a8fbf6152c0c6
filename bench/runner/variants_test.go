package runner

import (
	"fmt"
	"slices"
	"testing"

	"github.com/xdproxy/xdproxy/bench/report"
)

func kubeVariants(c *Config) []string {
	var out []string
	for _, v := range c.variants() {
		if report.IsKubeProxy(v.path) {
			out = append(out, fmt.Sprintf("%s/%d/%v", v.path, v.services, v.flows))
		}
	}
	return out
}

// TestKubeProxyVariants: the real kube-proxy runs in full runs at up to
// KubeProxyMaxServices services, with every flow count, and stays out of
// the quick run unless asked for.
func TestKubeProxyVariants(t *testing.T) {
	full := &Config{Services: []int{1, 1000, 10000, 100000}, Flows: []int{1, 100000}}
	want := []string{
		"kube-proxy-iptables/1/[1 100000]", "kube-proxy-iptables/1000/[1 100000]",
		"kube-proxy-nftables/1/[1 100000]", "kube-proxy-nftables/1000/[1 100000]",
	}
	if got := kubeVariants(full); !slices.Equal(got, want) {
		t.Errorf("full run: %v, want %v", got, want)
	}
	quick := &Config{Quick: true, Services: []int{1, 10000}, Flows: []int{1, 100000}}
	if got := kubeVariants(quick); len(got) != 0 {
		t.Errorf("quick run: %v, want none", got)
	}
	quick.Only = []string{report.PathKubeProxyNFTables}
	if got := kubeVariants(quick); !slices.Equal(got, []string{"kube-proxy-nftables/1/[1 100000]"}) {
		t.Errorf("quick run, only nftables: %v", got)
	}
	// The VIPs of the kube-proxy paths stay clear of the API server's own
	// Service, the first address of the range.
	if KubeProxyVIPBase == VIPBase || !Services(1, "udp").ServiceCIDR.Contains(KubeProxyVIPBase) {
		t.Errorf("kube-proxy VIP base %v", KubeProxyVIPBase)
	}
}
