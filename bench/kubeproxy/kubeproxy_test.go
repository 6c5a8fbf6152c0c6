package kubeproxy

import (
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
)

func testConfig() Config {
	return Config{
		Mode: NFTables, ClusterCIDR: netip.MustParsePrefix("198.18.0.0/24"), NodeName: "bench-node",
		Kubeconfig: "/tmp/kc", MetricsAddr: "127.0.0.1:10249", HealthzAddr: "127.0.0.1:10256",
	}
}

func TestConfigYAML(t *testing.T) {
	b, err := testConfig().YAML()
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := yaml.Unmarshal(b, &got); err != nil {
		t.Fatalf("%v:\n%s", err, b)
	}
	want := map[string]any{
		"kind": "KubeProxyConfiguration", "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
		"mode": "nftables", "clusterCIDR": "198.18.0.0/24", "hostnameOverride": "bench-node",
		"metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if kc := got["clientConnection"].(map[string]any)["kubeconfig"]; kc != "/tmp/kc" {
		t.Errorf("kubeconfig %v", kc)
	}
	// Zero conntrack settings: kube-proxy then leaves the sysctls alone.
	ct := got["conntrack"].(map[string]any)
	for _, k := range []string{"maxPerCore", "min"} {
		if ct[k] != float64(0) {
			t.Errorf("conntrack.%s = %v, want 0", k, ct[k])
		}
	}
	for _, k := range []string{"tcpEstablishedTimeout", "tcpCloseWaitTimeout", "udpTimeout", "udpStreamTimeout"} {
		if ct[k] != "0s" {
			t.Errorf("conntrack.%s = %v, want 0s", k, ct[k])
		}
	}
}

func TestConfigRejects(t *testing.T) {
	for name, mut := range map[string]func(*Config){
		"mode":    func(c *Config) { c.Mode = "ipvs" },
		"cidr":    func(c *Config) { c.ClusterCIDR = netip.Prefix{} },
		"node":    func(c *Config) { c.NodeName = "" },
		"metrics": func(c *Config) { c.MetricsAddr = "" },
	} {
		c := testConfig()
		mut(&c)
		if _, err := c.YAML(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func testSet(n int, proto kernelrules.Proto) kernelrules.ServiceSet {
	return kernelrules.ServiceSet{
		Count: n, Proto: proto, VIPBase: netip.MustParseAddr("198.19.0.2"), BasePort: 80,
		Endpoints:   []netip.AddrPort{netip.MustParseAddrPort("198.18.1.2:9")},
		ClusterCIDR: netip.MustParsePrefix("198.18.0.0/24"), ServiceCIDR: netip.MustParsePrefix("198.19.0.0/16"),
	}
}

func TestProgrammed(t *testing.T) {
	set := testSet(3, kernelrules.UDP)
	ipt := `*nat
-A KUBE-SERVICES -d 198.19.0.2/32 -p udp -m comment --comment "bench/svc-0:p cluster IP" -m udp --dport 80 -j KUBE-SVC-AAAA
-A KUBE-SERVICES -d 198.19.0.3/32 -p udp -m comment --comment "bench/svc-1:p cluster IP" -m udp --dport 80 -j KUBE-SVC-BBBB
-A KUBE-SERVICES -d 198.19.0.3/32 -p udp -m comment --comment "again" -m udp --dport 80 -j KUBE-SVC-BBBB
-A KUBE-SERVICES -d 198.19.0.4/32 -p tcp -m comment --comment "wrong proto" -m tcp --dport 80 -j KUBE-SVC-CCCC
-A KUBE-SERVICES -d 198.19.0.1/32 -p tcp -m comment --comment "default/kubernetes:https cluster IP" -m tcp --dport 443 -j KUBE-SVC-DDDD
-A KUBE-SVC-AAAA ! -s 198.18.0.0/24 -d 198.19.0.2/32 -p udp -m udp --dport 80 -j KUBE-MARK-MASQ
`
	if n := Programmed(IPTables, ipt, set); n != 2 {
		t.Errorf("iptables: %d programmed, want 2", n)
	}
	nft := `table ip kube-proxy {
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 198.19.0.2 . udp . 80 : goto service-AAAA-bench/svc-0/udp/p,
			     198.19.0.3 . udp . 80 : goto service-BBBB-bench/svc-1/udp/p,
			     198.19.0.4 . udp . 81 : goto service-CCCC-bench/svc-2/udp/p,
			     198.19.0.4 . udp . 80 : goto service-CCCC-bench/svc-2/udp/p }
	}
}`
	if n := Programmed(NFTables, nft, set); n != 3 {
		t.Errorf("nftables: %d programmed, want 3", n)
	}
	if n := Programmed(NFTables, nft, testSet(3, kernelrules.TCP)); n != 0 {
		t.Errorf("nftables, tcp set: %d programmed, want 0", n)
	}
}

// TestKubeProxy runs the real control plane and kube-proxy in both modes
// in a namespace of its own, with three services, and checks that the
// rules appear and that Close removes them. It needs root and the
// binaries `make kube-tools` builds.
func TestKubeProxy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	bins, err := FindBinaries()
	if err != nil {
		t.Skip(err)
	}
	for _, mode := range []Mode{NFTables, IPTables} {
		t.Run(string(mode), func(t *testing.T) {
			ns := "xdpb-kp-" + string(mode) + "-" + strings.ReplaceAll(time.Now().Format("150405.000"), ".", "")
			if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
			if out, err := exec.Command("ip", "-n", ns, "link", "set", "lo", "up").CombinedOutput(); err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			set := testSet(3, kernelrules.UDP)
			p, err := Start(Options{
				Mode: mode, Namespace: ns, Services: set, ClusterCIDR: set.ClusterCIDR,
				NodeName: "bench-node", NodeAddr: netip.MustParseAddr("198.18.0.1"), Bins: bins, CPU: -1, Timeout: time.Minute,
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("applied in %v, programmed in %v", p.Applied, p.Programmed)
			proxy := *p
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			out, err := proxy.rules()
			if err == nil && Programmed(mode, out, set) != 0 {
				t.Fatalf("rules left after Close:\n%s", out)
			}
		})
	}
}

// TestFindBinariesMissing: without the binaries the error names each one
// and says how to build them, on one line (it goes into the report).
func TestFindBinariesMissing(t *testing.T) {
	t.Setenv("XDPROXY_KUBE_BIN", t.TempDir())
	_, err := FindBinaries()
	if err == nil {
		t.Fatal("no error for an empty directory")
	}
	msg := err.Error()
	for _, want := range []string{"etcd, kube-apiserver, kube-proxy missing", "make kube-tools"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error %q spans lines", msg)
	}
}
