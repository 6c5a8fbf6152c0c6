package config

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const good = `
nodeName: node-1
interfaces:
  - name: n0
    queues: [0, 1]
    cpus: [0, 1]
    xdpMode: native
services:
  file: /etc/xdproxy/services.yaml
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
masquerade:
  address: 198.18.1.1
  portRange: 40000-50000
conntrack:
  maxEntries: 100000
  udpTimeout: 45s
  tcpEstablishedTimeout: 3600
`

func TestParseGood(t *testing.T) {
	c, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.Interfaces[0].FrameSize != DefaultFrameSize || c.Interfaces[0].NumFrames != DefaultNumFrames {
		t.Errorf("defaults not applied: %+v", c.Interfaces[0])
	}
	if c.Conntrack.UDPUnreplied.Duration != 45*time.Second || c.Conntrack.TCPEstablished.Duration != time.Hour {
		t.Errorf("durations: %+v", c.Conntrack)
	}
	lo, hi, _ := c.PortRange()
	if lo != 40000 || hi != 50000 {
		t.Errorf("port range %d-%d", lo, hi)
	}
	cidrs, _ := c.ClusterCIDRs()
	if len(cidrs) != 2 {
		t.Errorf("cidrs %v", cidrs)
	}
}

// TestParseErrorsNameTheField checks that each bad value is reported with
// the path of its field.
func TestParseErrorsNameTheField(t *testing.T) {
	cases := []struct{ replace, with, want string }{
		{"cpus: [0, 1]", "cpus: [0]", "interfaces[0].cpus: 1 CPUs for 2 queues"},
		{"xdpMode: native", "xdpMode: turbo", `interfaces[0].xdpMode: "turbo"`},
		{"nodeName: node-1", "nodeName: \"\"", "nodeName: required"},
		{"portRange: 40000-50000", "portRange: 50000-40000", "masquerade.portRange"},
		{"address: 198.18.1.1", "address: 198.18.1", "masquerade.address"},
		{"clusterCIDR: 10.244.0.0/16,fd00:10:244::/56", "clusterCIDR: 10.244.0.0/33", "clusterCIDR"},
		{"maxEntries: 100000", "maxEntries: 10", "conntrack.maxEntries"},
		{"udpTimeout: 45s", "udpTimeout: soon", "not a duration"},
		{"  file: /etc/xdproxy/services.yaml", "  fiel: x", "unknown field"},
		{"    xdpMode: native", "    xdpMode: native\n    numFrames: 1000", "interfaces[0].numFrames: 1000 is not a power of two"},
	}
	for _, c := range cases {
		in := strings.Replace(good, c.replace, c.with, 1)
		if in == good {
			t.Fatalf("replacement %q not found", c.replace)
		}
		_, err := Parse([]byte(in))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q -> %q: error %v, want it to mention %q", c.replace, c.with, err, c.want)
		}
	}
}

func TestDeployExampleIsValid(t *testing.T) {
	if _, err := Load(filepath.Join("..", "..", "deploy", "xdproxy.yaml")); err != nil {
		t.Fatal(err)
	}
}
