package agent

import (
	"log/slog"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
)

func parseTestConfig(t *testing.T, extra string) *config.Config {
	t.Helper()
	c, err := config.ParseWith([]byte("apiVersion: xdproxy.io/v1alpha1\nkind: XDProxyConfiguration\nnodeName: n\n"+extra),
		config.Options{Host: &config.Host{CPUs: []int{0, 1}}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestEngineConfig: the typed config reaches the engine as it is, and
// interfaces without cpus get the CPUs the process may use.
func TestEngineConfig(t *testing.T) {
	c := parseTestConfig(t, `interfaces:
  - {name: a, queues: [0, 1, 2], cpus: [1], xdpMode: generic, bindMode: copy}
  - {name: b}
services: {file: /x}
masquerade: {address: 198.18.0.1, portRange: 1000-2000, reservePorts: true}
conntrack: {maxEntries: 5000, udpTimeout: 7s, fragmentMaxEntries: 9}
exceptionInterface: exc0
`)
	e, err := engineConfig(c, config.Host{CPUs: []int{4, 5}}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	a, b := e.Interfaces[0], e.Interfaces[1]
	if !reflect.DeepEqual(a.Queues, []int{0, 1, 2}) || !reflect.DeepEqual(a.CPUs, []int{1}) || a.Mode != xdp.Generic ||
		a.Socket != c.Interfaces[0].Socket {
		t.Errorf("interface a: %+v", a)
	}
	if b.Queues != nil || !reflect.DeepEqual(b.CPUs, []int{4, 5}) {
		t.Errorf("interface b: queues %v (want nil: every queue), cpus %v (want the host's)", b.Queues, b.CPUs)
	}
	if e.SNATAddress4 != packet.MustParseAddr("198.18.0.1") || e.SNATPorts != c.Masquerade.Ports || !e.ReserveSNATPorts ||
		e.ExceptionInterface != "exc0" || e.Conntrack.Capacity != 5000 || e.Conntrack.Timeouts != c.Conntrack.Timeouts ||
		e.Conntrack.FragmentCapacity != 9 || e.BatchSize != 64 {
		t.Errorf("engine config %+v", e)
	}

	if e.NoLocalhostNodePorts {
		t.Error("localhost NodePorts off without nodePortAddresses")
	}
	for addrs, want := range map[string]bool{"[10.0.0.0/8]": true, "[10.0.0.0/8, 127.0.0.0/8]": false} {
		c := parseTestConfig(t, "interfaces: [{name: a}]\nservices: {file: /x}\nnodePortAddresses: "+addrs+"\n")
		if e, err := engineConfig(c, config.Host{}, slog.Default()); err != nil || e.NoLocalhostNodePorts != want {
			t.Errorf("nodePortAddresses %s: localhost NodePorts off %v, want %v (%v)", addrs, e.NoLocalhostNodePorts, want, err)
		}
	}

	c = parseTestConfig(t, "interfaces: [{name: a}]\nservices: {file: /x}\nmasquerade: {address: \"fd00::1\"}\n")
	if _, err := engineConfig(c, config.Host{}, slog.Default()); err == nil || !strings.HasPrefix(err.Error(), "masquerade.address: fd00::1") {
		t.Errorf("IPv6 masquerade address: %v", err)
	}
}

// TestRESTConfig: apiServer replaces the kubeconfig's server; the client
// limits come from the config.
func TestRESTConfig(t *testing.T) {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://kubeconfig.example:6443"}
	kc.AuthInfos["u"] = &clientcmdapi.AuthInfo{Token: "secret"}
	kc.Contexts["x"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	kc.CurrentContext = "x"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ apiServer, want string }{
		{"", "https://kubeconfig.example:6443"},
		{"https://10.0.0.1:6443", "https://10.0.0.1:6443"},
	} {
		rc, err := restConfig(&config.Kubernetes{Kubeconfig: path, APIServer: tc.apiServer, QPS: 7, Burst: 9})
		if err != nil {
			t.Fatal(err)
		}
		if rc.Host != tc.want || rc.QPS != 7 || rc.Burst != 9 || rc.BearerToken != "secret" {
			t.Errorf("apiServer %q: host %s, qps %v, burst %d, token %q", tc.apiServer, rc.Host, rc.QPS, rc.Burst, rc.BearerToken)
		}
	}
}
