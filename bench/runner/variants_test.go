package runner

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/xdproxy/xdproxy/bench/feed"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/topo"
)

func names(gs []group) []string {
	var out []string
	for _, g := range gs {
		var vs []string
		for _, v := range g {
			vs = append(vs, fmt.Sprintf("%s/%s/%d", v.feed, v.path, v.services))
		}
		out = append(out, strings.Join(vs, " "))
	}
	return out
}

// TestQuickGroups: the quick run is the NIC feed, xdproxy against the
// nftables shape and the I/O floor at 1 and 1,000 services, after the
// generator's limit; each service count's paths run together.
func TestQuickGroups(t *testing.T) {
	c := &Config{Quick: true, Feeds: []feed.Kind{feed.NIC}, Services: []int{1, 1000}}
	want := []string{
		"nic/xdp-drop-limit/0",
		"nic/kernel-nftables/1 nic/xdproxy-io-floor/1 nic/xdproxy/1",
		"nic/kernel-nftables/1000 nic/xdproxy-io-floor/1000 nic/xdproxy/1000",
	}
	if got := names(c.groups()); !slices.Equal(got, want) {
		t.Errorf("quick run:\n got %q\nwant %q", got, want)
	}
	if got := c.tcpPaths(1); !slices.Equal(got, []string{report.PathNFTables, report.PathXDProxy}) {
		t.Errorf("quick TCP paths %v", got)
	}
	// A path the quick run leaves out runs when named, alone if it
	// would disturb the others.
	c.Only = []string{report.PathBusyPoll, report.PathKernel}
	want = []string{"nic/xdp-drop-limit/0", "nic/kernel-no-rules/0", "nic/xdproxy-busypoll/1", "nic/xdproxy-busypoll/1000"}
	if got := names(c.groups()); !slices.Equal(got, want) {
		t.Errorf("quick run, only busy poll and no rules:\n got %q\nwant %q", got, want)
	}
}

// TestFullGroups: the full run adds plain forwarding, the iptables shape,
// busy polling and the real kube-proxy at up to 1,000 services, and the
// large service counts for the nftables shape and xdproxy; every feed
// asked for gets the whole set. Busy polling and the real kube-proxy run
// alone.
func TestFullGroups(t *testing.T) {
	c := &Config{Feeds: []feed.Kind{feed.NIC, feed.Pod}, Services: []int{1, 1000, 100000}}
	perFeed := func(f string) []string {
		return []string{
			f + "/xdp-drop-limit/0",
			f + "/kernel-no-rules/0 " + f + "/kernel-nftables/1 " + f + "/kernel-iptables/1 " + f + "/xdproxy-io-floor/1 " + f + "/xdproxy/1",
			f + "/kube-proxy-nftables/1", f + "/kube-proxy-iptables/1", f + "/xdproxy-busypoll/1",
			f + "/kernel-nftables/1000 " + f + "/kernel-iptables/1000 " + f + "/xdproxy-io-floor/1000 " + f + "/xdproxy/1000",
			f + "/kube-proxy-nftables/1000", f + "/kube-proxy-iptables/1000", f + "/xdproxy-busypoll/1000",
			f + "/kernel-nftables/100000 " + f + "/xdproxy-io-floor/100000 " + f + "/xdproxy/100000",
		}
	}
	want := append(perFeed("nic"), perFeed("pod")...)
	if got := names(c.groups()); !slices.Equal(got, want) {
		t.Errorf("full run:\n got %q\nwant %q", got, want)
	}
	if got := c.tcpPaths(1000); !slices.Equal(got, []string{report.PathNFTables, report.PathIPTables, report.PathXDProxy,
		report.PathKubeProxyNFTables, report.PathKubeProxyIPTables}) {
		t.Errorf("full TCP paths at 1000 services: %v", got)
	}
	if got := c.tcpPaths(100000); !slices.Equal(got, []string{report.PathNFTables, report.PathXDProxy}) {
		t.Errorf("full TCP paths at 100000 services: %v", got)
	}
	if c.profileServices() != 1000 {
		t.Errorf("profiled at %d services, want 1000", c.profileServices())
	}
	c.Services = []int{1, 10000}
	if c.profileServices() != 10000 {
		t.Errorf("profiled at %d services, want the most, 10000", c.profileServices())
	}
	// The VIPs of the kube-proxy paths stay clear of the API server's own
	// Service, the first address of the range.
	if KubeProxyVIPBase == VIPBase || !Services(1, "udp").ServiceCIDR.Contains(KubeProxyVIPBase) {
		t.Errorf("kube-proxy VIP base %v", KubeProxyVIPBase)
	}
}

func TestParseTraffic(t *testing.T) {
	got, err := ParseTraffic("1000, new")
	if err != nil || !slices.Equal(got, []Traffic{{Flows: 1000}, {New: true, Flows: NewFlowSpace}}) {
		t.Fatalf("ParseTraffic = %v, %v", got, err)
	}
	if got[0].Name() != report.TrafficLong || got[1].Name() != report.TrafficNew ||
		got[0].String() != "1000 long flows" || got[1].String() != "new flow per packet" {
		t.Errorf("names %q %q, labels %q %q", got[0].Name(), got[1].Name(), got[0], got[1])
	}
	for _, bad := range []string{"", "0", "old", "1000,", fmt.Sprint(NewFlowSpace + 1)} {
		if _, err := ParseTraffic(bad); err == nil {
			t.Errorf("ParseTraffic(%q) accepted", bad)
		}
	}
}

// TestNewFlowSpaceInPodCIDR: every source of the new-flow traffic is a
// pod address, so that no path masquerades it.
func TestNewFlowSpaceInPodCIDR(t *testing.T) {
	last := topo.FlowSource
	for range NewFlowSources - 1 {
		last = last.Next()
	}
	if !topo.PodCIDR.Contains(topo.FlowSource) || !topo.PodCIDR.Contains(last) {
		t.Errorf("new-flow sources %v-%v leave the pod CIDR %v", topo.FlowSource, last, topo.PodCIDR)
	}
}

// TestAim: where the generator's frames go for each path and traffic.
func TestAim(t *testing.T) {
	e := &env{set: Services(1000, "udp")}
	e.aim(1000, Traffic{Flows: 1000})
	if e.dst != VIPBase || e.dsts != 1000 || e.dport != UDPServicePort || e.newFlow {
		t.Errorf("1000 long flows over 1000 services: %v x%d :%d new %v", e.dst, e.dsts, e.dport, e.newFlow)
	}
	e.seq = 7
	e.aim(1000, Traffic{New: true, Flows: NewFlowSpace})
	if e.dsts != 1000 || e.flows != NewFlowSpace || !e.newFlow || e.seq != 0 {
		t.Errorf("new flows over 1000 services: x%d, %d flows, new %v, seq %d", e.dsts, e.flows, e.newFlow, e.seq)
	}
	e.aim(0, Traffic{Flows: 1000})
	if e.dst != topo.SinkAddrs[0] || e.dsts != 1 || e.dport != UDPEndpointPort {
		t.Errorf("no services: %v x%d :%d", e.dst, e.dsts, e.dport)
	}
	e.limit = true
	e.aim(0, Traffic{Flows: 1000})
	if e.dst != topo.NodeInAddr {
		t.Errorf("limit: %v", e.dst)
	}
}
