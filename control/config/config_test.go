package config

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// testHost is a two-CPU machine, as in the messages of the README.
var testHost = Host{CPUs: []int{0, 1}, OnlineCPUs: []int{0, 1}}

// file writes a configuration: the version, a node name, one interface
// (iface, "{name: eth0}" when empty), the services section (services,
// a file when empty) and extra top-level fields.
func file(iface, services, extra string) string {
	if iface == "" {
		iface = "{name: eth0}"
	}
	if services == "" {
		services = "{file: /etc/xdproxy/services.yaml}"
	}
	return fmt.Sprintf("apiVersion: xdproxy.io/v1alpha1\nkind: XDProxyConfiguration\nnodeName: node-1\n"+
		"interfaces:\n  - %s\nservices: %s\n%s", iface, services, extra)
}

// TestParseDefaults pins every default of a minimal file.
func TestParseDefaults(t *testing.T) {
	c, err := ParseWith([]byte(file("", "", "")), Options{Host: &testHost})
	if err != nil {
		t.Fatal(err)
	}
	// kube-proxy's: netfilter's, with its two overrides.
	timeouts := conntrack.DefaultTimeouts
	timeouts.TCPEstablished = 24 * time.Hour
	timeouts.TCPCloseWait = time.Hour
	want := &Config{
		NodeName: "node-1",
		Interfaces: []Interface{{
			Name: "eth0", XDPMode: xdp.Auto, BindMode: afxdp.Auto,
			Socket: afxdp.Config{NumFrames: 4096, FrameSize: 2048, FillRingSize: 2048, CompletionRingSize: 2048,
				RxRingSize: 2048, TxRingSize: 2048, Mode: afxdp.Auto, NeedWakeup: true},
		}},
		ExceptionInterface: "xdpx0",
		Services:           Services{File: "/etc/xdproxy/services.yaml"},
		Masquerade:         Masquerade{Ports: conntrack.PortRange{First: 61000, Last: 65535}},
		Conntrack:          Conntrack{MaxEntries: 262144, Timeouts: timeouts, SYNGuard: true},
		Scheduler:          service.Random,
		MetricsAddress:     netip.MustParseAddrPort("127.0.0.1:10249"),
		HealthzAddress:     netip.MustParseAddrPort("0.0.0.0:10256"),
		AdminSocket:        "/run/xdproxy/admin.sock",
		StateDir:           "/run/xdproxy",
		BPFFSDir:           "/sys/fs/bpf/xdproxy",
		LocalClients:       LocalClients{Enabled: true},
		BatchSize:          64,
		XDPTables:          XDPTables{MaxFrontends: 65536, MaxAddresses: 65536},
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("defaults:\n got %+v\nwant %+v", c, want)
	}
	if c.Interfaces[0].Queues != nil || c.Interfaces[0].CPUs != nil {
		t.Errorf("queues %v, cpus %v: want nil (every queue, every CPU)", c.Interfaces[0].Queues, c.Interfaces[0].CPUs)
	}

	c, err = ParseWith([]byte(file("", "{kubernetes: {}}", "")), Options{Host: &testHost})
	if err != nil {
		t.Fatal(err)
	}
	wantK := &Kubernetes{QPS: 5, Burst: 10, MinSyncPeriod: time.Second, MaxSyncPeriod: 30 * time.Second, ProxyName: "xdproxy"}
	if !reflect.DeepEqual(c.Services.Kubernetes, wantK) {
		t.Errorf("kubernetes defaults: got %+v, want %+v", c.Services.Kubernetes, wantK)
	}
}

// TestParseFields sets each field and checks the typed value.
func TestParseFields(t *testing.T) {
	cases := []struct {
		name                   string
		iface, services, extra string
		check                  func(*Config) any // returns the value compared with want
		want                   any
	}{
		{name: "nodeZone", extra: "nodeZone: zone-a",
			check: func(c *Config) any { return c.NodeZone }, want: "zone-a"},
		{name: "a number for a string", extra: "nodeZone: 1",
			check: func(c *Config) any { return c.NodeZone }, want: "1"},
		{name: "queues", iface: "{name: eth0, queues: [0, 3]}",
			check: func(c *Config) any { return c.Interfaces[0].Queues }, want: []int{0, 3}},
		{name: "queues null is every queue", iface: "{name: eth0, queues: null}",
			check: func(c *Config) any { return c.Interfaces[0].Queues }, want: []int(nil)},
		{name: "fewer cpus than queues", iface: "{name: eth0, queues: [0, 1, 2], cpus: [1]}",
			check: func(c *Config) any { return c.Interfaces[0].CPUs }, want: []int{1}},
		{name: "xdpMode native", iface: "{name: eth0, xdpMode: native}",
			check: func(c *Config) any { return c.Interfaces[0].XDPMode }, want: xdp.Native},
		{name: "xdpMode generic", iface: "{name: eth0, xdpMode: generic}",
			check: func(c *Config) any { return c.Interfaces[0].XDPMode }, want: xdp.Generic},
		{name: "bindMode copy", iface: "{name: eth0, bindMode: copy}",
			check: func(c *Config) any { return [2]afxdp.BindMode{c.Interfaces[0].BindMode, c.Interfaces[0].Socket.Mode} },
			want:  [2]afxdp.BindMode{afxdp.Copy, afxdp.Copy}},
		{name: "bindMode zerocopy", iface: "{name: eth0, bindMode: zerocopy}",
			check: func(c *Config) any { return c.Interfaces[0].Socket.Mode }, want: afxdp.ZeroCopy},
		{name: "socket sizes",
			iface: "{name: eth0, frameSize: 4096, numFrames: 8192, rxRingSize: 512, txRingSize: 1024, fillRingSize: 4096, completionRingSize: 8192}",
			check: func(c *Config) any { return c.Interfaces[0].Socket },
			want: afxdp.Config{NumFrames: 8192, FrameSize: 4096, RxRingSize: 512, TxRingSize: 1024, FillRingSize: 4096,
				CompletionRingSize: 8192, Mode: afxdp.Auto, NeedWakeup: true}},
		{name: "two interfaces", iface: "{name: eth0, frameSize: 4096}\n  - {name: eth1, frameSize: 4096}",
			check: func(c *Config) any { return []string{c.Interfaces[0].Name, c.Interfaces[1].Name} }, want: []string{"eth0", "eth1"}},
		{name: "exceptionInterface", extra: "exceptionInterface: xdpx9",
			check: func(c *Config) any { return c.ExceptionInterface }, want: "xdpx9"},
		{name: "kubernetes", services: `{kubernetes: {kubeconfig: /k, apiServer: "https://10.0.0.1:6443", qps: 20, burst: 40, minSyncPeriod: 0, maxSyncPeriod: 2m, proxyName: other}}`,
			check: func(c *Config) any { return *c.Services.Kubernetes },
			want: Kubernetes{Kubeconfig: "/k", APIServer: "https://10.0.0.1:6443", QPS: 20, Burst: 40,
				MaxSyncPeriod: 2 * time.Minute, ProxyName: "other"}},
		{name: "apiServer IPv6 with a slash", services: `{kubernetes: {apiServer: "https://[fd00::1]:6443/"}}`,
			check: func(c *Config) any { return c.Services.Kubernetes.APIServer }, want: "https://[fd00::1]:6443"},
		{name: "apiServer by name", services: `{kubernetes: {apiServer: "https://api.example.com:443"}}`,
			check: func(c *Config) any { return c.Services.Kubernetes.APIServer }, want: "https://api.example.com:443"},
		{name: "clusterCIDR dual-stack, masked", extra: "clusterCIDR: 10.244.1.0/16, fd00:10:244::1/56",
			check: func(c *Config) any { return c.ClusterCIDRs },
			want:  []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:10:244::/56")}},
		{name: "nodePortAddresses", extra: "nodePortAddresses: [192.168.1.7/24, \"fd00::/64\"]",
			check: func(c *Config) any { return c.NodePortAddresses },
			want:  []netip.Prefix{netip.MustParsePrefix("192.168.1.0/24"), netip.MustParsePrefix("fd00::/64")}},
		{name: "masquerade", extra: "masquerade: {address: 198.18.1.1, portRange: 40000-50000, all: true, reservePorts: true}",
			check: func(c *Config) any { return c.Masquerade },
			want: Masquerade{Address: netip.MustParseAddr("198.18.1.1"), Ports: conntrack.PortRange{First: 40000, Last: 50000},
				All: true, ReservePorts: true}},
		{name: "masquerade address v4-mapped", extra: "masquerade: {address: \"::ffff:198.18.1.1\"}",
			check: func(c *Config) any { return c.Masquerade.Address }, want: netip.MustParseAddr("198.18.1.1")},
		{name: "masquerade address IPv6", extra: "masquerade: {address: \"fd00::1\"}",
			check: func(c *Config) any { return c.Masquerade.Address }, want: netip.MustParseAddr("fd00::1")},
		{name: "masquerade port range exactly 64 ports", extra: "masquerade: {portRange: 1-64}",
			check: func(c *Config) any { return c.Masquerade.Ports }, want: conntrack.PortRange{First: 1, Last: 64}},
		{name: "conntrack sizes", extra: "conntrack: {maxEntries: 100000, fragmentTimeout: 10s, fragmentMaxEntries: 100}",
			check: func(c *Config) any {
				return [3]any{c.Conntrack.MaxEntries, c.Conntrack.FragmentTimeout, c.Conntrack.FragmentMaxEntries}
			},
			want: [3]any{100000, 10 * time.Second, 100}},
		{name: "SYN guard on by default", extra: "",
			check: func(c *Config) any { return c.Conntrack.SYNGuard }, want: true},
		{name: "SYN guard off", extra: "conntrack: {synGuard: false}",
			check: func(c *Config) any { return c.Conntrack.SYNGuard }, want: false},
		{name: "conntrack timeouts, strings and seconds",
			extra: "conntrack:\n  tcpSynSentTimeout: 1s\n  tcpSynRecvTimeout: 2s\n  tcpEstablishedTimeout: 3600\n  tcpFinWaitTimeout: 4s\n" +
				"  tcpCloseWaitTimeout: 5s\n  tcpLastAckTimeout: 6s\n  tcpTimeWaitTimeout: 7s\n  tcpCloseTimeout: 8s\n" +
				"  udpTimeout: 45s\n  udpStreamTimeout: 1.5\n  icmpTimeout: 1m30s\n",
			check: func(c *Config) any { return c.Conntrack.Timeouts },
			want: conntrack.Timeouts{TCPSynSent: time.Second, TCPSynRecv: 2 * time.Second, TCPEstablished: time.Hour,
				TCPFinWait: 4 * time.Second, TCPCloseWait: 5 * time.Second, TCPLastAck: 6 * time.Second,
				TCPTimeWait: 7 * time.Second, TCPClose: 8 * time.Second, UDPUnreplied: 45 * time.Second,
				TCPUnacknowledged: conntrack.DefaultTimeouts.TCPUnacknowledged,
				UDPReplied:        1500 * time.Millisecond, ICMPEcho: 90 * time.Second, Other: conntrack.DefaultTimeouts.Other}},
		{name: "scheduler maglev", extra: "scheduler: maglev",
			check: func(c *Config) any { return c.Scheduler }, want: service.Maglev},
		{name: "scheduler roundrobin", extra: "scheduler: roundrobin",
			check: func(c *Config) any { return c.Scheduler }, want: service.RoundRobin},
		{name: "addresses", extra: "metricsAddress: \"[::1]:9000\"\nhealthzAddress: 127.0.0.1:0",
			check: func(c *Config) any { return [2]netip.AddrPort{c.MetricsAddress, c.HealthzAddress} },
			want:  [2]netip.AddrPort{netip.MustParseAddrPort("[::1]:9000"), netip.MustParseAddrPort("127.0.0.1:0")}},
		{name: "paths, cleaned", extra: "adminSocket: /tmp/a.sock\nstateDir: /var/lib/xdproxy/\nbpffsDir: /sys/fs/bpf/x//y",
			check: func(c *Config) any { return [3]string{c.AdminSocket, c.StateDir, c.BPFFSDir} },
			want:  [3]string{"/tmp/a.sock", "/var/lib/xdproxy", "/sys/fs/bpf/x/y"}},
		{name: "busyPoll and batchSize", extra: "busyPoll: true\nbatchSize: 256",
			check: func(c *Config) any { return [2]any{c.BusyPoll, c.BatchSize} }, want: [2]any{true, 256}},
		{name: "xdpTables", extra: "xdpTables: {maxFrontends: 1000, maxAddresses: 2000}",
			check: func(c *Config) any { return c.XDPTables }, want: XDPTables{MaxFrontends: 1000, MaxAddresses: 2000}},
		{name: "benchmark I/O floor", extra: "benchmark: {ioFloor: true, ioFloorPeer: 198.18.1.11}",
			check: func(c *Config) any { return c.Benchmark },
			want:  Benchmark{IOFloor: true, IOFloorPeer: netip.MustParseAddr("198.18.1.11")}},
		{name: "benchmark I/O floor, v4-mapped peer", extra: "benchmark: {ioFloor: true, ioFloorPeer: \"::ffff:198.18.1.11\"}",
			check: func(c *Config) any { return c.Benchmark.IOFloorPeer }, want: netip.MustParseAddr("198.18.1.11")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := file(tc.iface, tc.services, tc.extra)
			c, err := ParseWith([]byte(in), Options{Host: &testHost})
			if err != nil {
				t.Fatalf("%v\n%s", err, in)
			}
			if got := tc.check(c); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %#v, want %#v", got, tc.want)
			}
		})
	}
}

// TestParseErrorsNameTheField checks each wrong value's message, with the
// path of its field.
func TestParseErrorsNameTheField(t *testing.T) {
	long := "/run/" + strings.Repeat("x", 100) + ".sock"
	cases := []struct {
		name                   string
		iface, services, extra string
		host                   *Host // testHost when nil
		want                   []string
	}{
		// Decoding: names and types.
		{name: "unknown top-level field", extra: "fiel: x", want: []string{"fiel: unknown field"}},
		{name: "unknown nested fields, all of them", services: "{file: /x, fiel: y}", extra: "xdpTables: {maxBackends: 10}",
			want: []string{"services.fiel: unknown field", "xdpTables.maxBackends: unknown field"}},
		{name: "unknown interface field", iface: "{name: eth0, queus: [0]}", want: []string{"interfaces[0].queus: unknown field"}},
		{name: "a string for a queue", iface: `{name: eth0, queues: [0, "a"]}`, want: []string{`interfaces[0].queues[1]: "a", want an integer`}},
		{name: "a fraction for an integer", extra: "batchSize: 1.5", want: []string{"batchSize: 1.5, want an integer"}},
		{name: "a number for a boolean", extra: "busyPoll: 3", want: []string{"busyPoll: 3, want true or false"}},
		{name: "a mapping for a list", extra: "nodePortAddresses: {a: b}", want: []string{"nodePortAddresses: a mapping, want a list"}},
		{name: "a list for a mapping", services: "[a]", want: []string{"services: a list, want a mapping of fields"}},
		{name: "a list for a string", extra: "nodeZone: [a]", want: []string{"nodeZone: a list, want a string"}},
		{name: "a string for a number", services: "{kubernetes: {qps: fast}}", want: []string{`services.kubernetes.qps: "fast", want a number`}},
		{name: "not a duration", extra: "conntrack: {udpTimeout: soon}",
			want: []string{`conntrack.udpTimeout: "soon" is not a duration; want one like 30s or 1m30s, or a number of seconds`}},
		{name: "a list for a duration", extra: "conntrack: {udpTimeout: [1]}",
			want: []string{`conntrack.udpTimeout: a list is not a duration; want one like 30s or 1m30s, or a number of seconds`}},

		// Node.
		{name: "nodeZone not a label value", extra: "nodeZone: \"a b\"",
			want: []string{`nodeZone: "a b" is not a zone label value: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')`}},

		// Interfaces.
		{name: "name missing", iface: "{queues: [0]}", want: []string{"interfaces[0].name: required"}},
		{name: "name too long", iface: "{name: a-very-long-ifname}", want: []string{`interfaces[0].name: "a-very-long-ifname" is longer than 15 characters`}},
		{name: "name with a slash", iface: "{name: eth/0}", want: []string{`interfaces[0].name: "eth/0" is not a valid interface name`}},
		{name: "name listed twice", iface: "{name: eth0}\n  - {name: eth0}", want: []string{`interfaces[1].name: "eth0" listed twice`}},
		{name: "queues empty", iface: "{name: eth0, queues: []}", want: []string{"interfaces[0].queues: empty; leave it out to serve every RX queue"}},
		{name: "queue listed twice", iface: "{name: eth0, queues: [0, 1, 0]}", want: []string{"interfaces[0].queues[2]: queue 0 listed twice"}},
		{name: "queues out of range", iface: "{name: eth0, queues: [-1, 1024]}",
			want: []string{"interfaces[0].queues[0]: -1 out of range 0-1023", "interfaces[0].queues[1]: 1024 out of range 0-1023"}},
		{name: "cpus empty", iface: "{name: eth0, cpus: []}", want: []string{"interfaces[0].cpus: empty; leave it out to use every CPU xdproxy may run on"}},
		{name: "cpu does not exist", iface: "{name: eth0, queues: [0, 1], cpus: [0, 7]}",
			want: []string{"interfaces[0].cpus[1]: CPU 7 does not exist (this machine has CPUs 0-1)"}},
		{name: "cpu outside the affinity", iface: "{name: eth0, cpus: [3]}", host: &Host{CPUs: []int{0, 1, 4}, OnlineCPUs: []int{0, 1, 2, 3, 4}},
			want: []string{"interfaces[0].cpus[0]: CPU 3 is outside this process's CPU affinity (it may run on CPUs 0-1,4)"}},
		{name: "cpu negative", iface: "{name: eth0, cpus: [-1]}", want: []string{"interfaces[0].cpus[0]: -1 is not a CPU number"}},
		{name: "xdpMode", iface: "{name: eth0, xdpMode: turbo}", want: []string{`interfaces[0].xdpMode: "turbo": want native, generic or auto`}},
		{name: "bindMode", iface: "{name: eth0, bindMode: zero-copy}", want: []string{`interfaces[0].bindMode: "zero-copy": want copy, zerocopy or auto`}},
		{name: "numFrames", iface: "{name: eth0, numFrames: 1000}",
			want: []string{"interfaces[0].numFrames: 1000 must be a power of two between 1 and 1048576"}},
		{name: "frameSize", iface: "{name: eth0, frameSize: 1000}", want: []string{"interfaces[0].frameSize: 1000 must be 2048 or 4096"}},
		{name: "frameSize 0 is not the default", iface: "{name: eth0, frameSize: 0}", want: []string{"interfaces[0].frameSize: 0 must be 2048 or 4096"}},
		{name: "ring larger than numFrames", iface: "{name: eth0, rxRingSize: 8192}", want: []string{"interfaces[0].rxRingSize: 8192 exceeds numFrames 4096"}},
		{name: "every socket problem at once", iface: "{name: eth0, numFrames: 1000, frameSize: 1, rxRingSize: 8192, txRingSize: 3, fillRingSize: 0, completionRingSize: 5}",
			want: []string{
				"interfaces[0].numFrames: 1000 must be a power of two between 1 and 1048576",
				"interfaces[0].frameSize: 1 must be 2048 or 4096",
				"interfaces[0].fillRingSize: 0 must be a power of two",
				"interfaces[0].completionRingSize: 5 must be a power of two",
				"interfaces[0].txRingSize: 3 must be a power of two",
			}},
		{name: "frame sizes differ", iface: "{name: eth0}\n  - {name: eth1, frameSize: 4096}",
			want: []string{"interfaces[1].frameSize: 4096 differs from interfaces[0].frameSize 2048; every interface must use the same frame size"}},
		{name: "exceptionInterface is an interface", extra: "exceptionInterface: eth0",
			want: []string{`exceptionInterface: "eth0" is also interfaces[0].name; name a device xdproxy may create`}},
		{name: "exceptionInterface too long", extra: "exceptionInterface: xdproxy-exception",
			want: []string{`exceptionInterface: "xdproxy-exception" is longer than 15 characters`}},

		// Services.
		{name: "no source", services: "{}", want: []string{"services: set either file or kubernetes"}},
		{name: "two sources", services: "{file: /x, kubernetes: {}}", want: []string{"services: set only one of file and kubernetes"}},
		{name: "apiServer http", services: `{kubernetes: {apiServer: "http://10.0.0.1:6443"}}`,
			want: []string{`services.kubernetes.apiServer: "http://10.0.0.1:6443": want https://host:port`}},
		{name: "apiServer without a port", services: `{kubernetes: {apiServer: "https://10.0.0.1"}}`,
			want: []string{`services.kubernetes.apiServer: "https://10.0.0.1": want https://host:port`}},
		{name: "apiServer with a path", services: `{kubernetes: {apiServer: "https://10.0.0.1:6443/api"}}`,
			want: []string{`services.kubernetes.apiServer: "https://10.0.0.1:6443/api": want https://host:port`}},
		{name: "apiServer port 0", services: `{kubernetes: {apiServer: "https://h:0"}}`,
			want: []string{`services.kubernetes.apiServer: "https://h:0": want https://host:port`}},
		{name: "client limits", services: "{kubernetes: {qps: 0, burst: 0}}",
			want: []string{"services.kubernetes.qps: 0 must be positive", "services.kubernetes.burst: 0 must be at least 1"}},
		{name: "sync periods", services: "{kubernetes: {minSyncPeriod: -1s, maxSyncPeriod: 0}}",
			want: []string{"services.kubernetes.minSyncPeriod: -1s must not be negative", "services.kubernetes.maxSyncPeriod: 0s must be positive"}},
		{name: "min above max", services: "{kubernetes: {minSyncPeriod: 1m, maxSyncPeriod: 10s}}",
			want: []string{"services.kubernetes.minSyncPeriod: 1m0s is longer than maxSyncPeriod 10s"}},
		{name: "proxyName", services: "{kubernetes: {proxyName: \"x y\"}}",
			want: []string{`services.kubernetes.proxyName: "x y" is not a label value: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')`}},

		// Addresses.
		{name: "clusterCIDR", extra: "clusterCIDR: 10.244.0.0/16,10.244.0.0/33", want: []string{`clusterCIDR: "10.244.0.0/33" is not a CIDR`}},
		{name: "nodePortAddresses", extra: "nodePortAddresses: [10.0.0.0/8, 10.0.0.1]", want: []string{`nodePortAddresses[1]: "10.0.0.1" is not a CIDR`}},
		{name: "masquerade address", extra: "masquerade: {address: 198.18.1}", want: []string{`masquerade.address: "198.18.1" is not an IP address`}},
		{name: "masquerade address with a zone", extra: "masquerade: {address: \"fe80::1%eth0\"}", want: []string{`masquerade.address: "fe80::1%eth0" is not an IP address`}},
		{name: "portRange reversed", extra: "masquerade: {portRange: 50000-40000}",
			want: []string{`masquerade.portRange: "50000-40000": want min-max with 1 <= min <= max <= 65535`}},
		{name: "portRange port 0", extra: "masquerade: {portRange: 0-100}",
			want: []string{`masquerade.portRange: "0-100": want min-max with 1 <= min <= max <= 65535`}},
		{name: "portRange one port", extra: "masquerade: {portRange: 40000}", want: []string{`masquerade.portRange: "40000": want min-max`}},
		{name: "portRange small", extra: "masquerade: {portRange: 40000-40010}", want: []string{`masquerade.portRange: "40000-40010" holds fewer than 64 ports`}},

		// Conntrack.
		{name: "maxEntries small", extra: "conntrack: {maxEntries: 10}", want: []string{"conntrack.maxEntries: 10 is below the minimum of 1024"}},
		{name: "maxEntries large", extra: "conntrack: {maxEntries: 536870912}", want: []string{"conntrack.maxEntries: 536870912 is above the maximum of 268435456"}},
		{name: "timeouts not positive", extra: "conntrack: {udpTimeout: 0, tcpCloseTimeout: -5s, fragmentTimeout: 0}",
			want: []string{"conntrack.tcpCloseTimeout: -5s must be positive", "conntrack.udpTimeout: 0s must be positive", "conntrack.fragmentTimeout: 0s must be positive"}},
		{name: "fragmentMaxEntries", extra: "conntrack: {fragmentMaxEntries: 0}", want: []string{"conntrack.fragmentMaxEntries: 0 must be at least 1"}},

		// The rest.
		{name: "scheduler", extra: "scheduler: fastest", want: []string{`scheduler: "fastest": want random, roundrobin or maglev`}},
		{name: "metricsAddress", extra: "metricsAddress: localhost:10249",
			want: []string{`metricsAddress: "localhost:10249" is not host:port (ParseAddr("localhost"): unable to parse IP)`}},
		{name: "same address twice", extra: "metricsAddress: 0.0.0.0:10256", want: []string{"healthzAddress: 0.0.0.0:10256 is also metricsAddress"}},
		{name: "adminSocket too long", extra: "adminSocket: " + long,
			want: []string{fmt.Sprintf("adminSocket: %q is 110 bytes long; a unix socket path holds at most 107", long)}},
		{name: "stateDir relative", extra: "stateDir: run/xdproxy", want: []string{`stateDir: "run/xdproxy" is not an absolute path`}},
		{name: "bpffsDir relative", extra: "bpffsDir: bpf", want: []string{`bpffsDir: "bpf" is not an absolute path`}},
		{name: "localClients cgroup relative", extra: "localClients: {cgroup: unified}", want: []string{`localClients.cgroup: "unified" is not an absolute path`}},
		{name: "localClients cgroup while off", extra: "localClients: {enabled: false, cgroup: /sys/fs/cgroup}", want: []string{`localClients.cgroup: set while localClients.enabled is false`}},
		{name: "batchSize", extra: "batchSize: 0", want: []string{"batchSize: 0 out of range 1-1024"}},
		{name: "batchSize large", extra: "batchSize: 2000", want: []string{"batchSize: 2000 out of range 1-1024"}},
		{name: "xdpTables", extra: "xdpTables: {maxFrontends: 0, maxAddresses: 16777217}",
			want: []string{"xdpTables.maxFrontends: 0 out of range 1-16777216", "xdpTables.maxAddresses: 16777217 out of range 1-16777216"}},
		{name: "benchmark I/O floor without a peer", extra: "benchmark: {ioFloor: true}",
			want: []string{"benchmark.ioFloorPeer: required with ioFloor: the address whose next hop every frame goes to"}},
		{name: "benchmark I/O floor peer not an address", extra: "benchmark: {ioFloor: true, ioFloorPeer: sink}",
			want: []string{`benchmark.ioFloorPeer: "sink" is not an IP address`}},
		{name: "benchmark peer without the I/O floor", extra: "benchmark: {ioFloorPeer: 198.18.1.11}",
			want: []string{"benchmark.ioFloorPeer: set while benchmark.ioFloor is false"}},
		{name: "benchmark unknown field", extra: "benchmark: {ioFloorPeers: 198.18.1.11}",
			want: []string{"benchmark.ioFloorPeers: unknown field"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := testHost
			if tc.host != nil {
				h = *tc.host
			}
			in := file(tc.iface, tc.services, tc.extra)
			_, err := ParseWith([]byte(in), Options{Host: &h})
			checkErrors(t, err, tc.want, in)
		})
	}
}

// checkErrors wants err to be an Errors listing exactly want.
func checkErrors(t *testing.T, err error, want []string, in string) {
	t.Helper()
	var errs Errors
	if !errors.As(err, &errs) {
		t.Fatalf("error %v (%T), want config.Errors %q\n%s", err, err, want, in)
	}
	var got []string
	for _, e := range errs {
		got = append(got, e.Error())
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("errors:\n got %q\nwant %q\n%s", got, want, in)
	}
}

// TestParseWholeFileErrors covers what file() cannot write: the version,
// missing sections, and several problems reported together.
func TestParseWholeFileErrors(t *testing.T) {
	const version = "apiVersion: xdproxy.io/v1alpha1\nkind: XDProxyConfiguration\n"
	cases := []struct {
		name, in string
		want     []string
	}{
		{"empty file", "", []string{"apiVersion: required; want xdproxy.io/v1alpha1", "kind: required; want XDProxyConfiguration"}},
		{"no version", "nodeName: n\ninterfaces: [{name: eth0}]\nservices: {file: /x}\n",
			[]string{"apiVersion: required; want xdproxy.io/v1alpha1", "kind: required; want XDProxyConfiguration"}},
		{"another version, its fields not checked", "apiVersion: xdproxy.io/v2\nkind: XDProxyConfiguration\nnewField: 1\n",
			[]string{`apiVersion: "xdproxy.io/v2" is not supported; want xdproxy.io/v1alpha1`}},
		{"kube-proxy's kind", "apiVersion: xdproxy.io/v1alpha1\nkind: KubeProxyConfiguration\n",
			[]string{`kind: "KubeProxyConfiguration" is not supported; want XDProxyConfiguration`}},
		{"a number for the version", "apiVersion: 1\nkind: XDProxyConfiguration\n",
			[]string{`apiVersion: 1 is not supported; want xdproxy.io/v1alpha1`}},
		{"nothing else", version, []string{"nodeName: required", "interfaces: at least one interface is required", "services: set either file or kubernetes"}},
		{"node name from an unsubstituted template", version + "nodeName: ${NODE_NAME}\ninterfaces: [{name: eth0}]\nservices: {file: /x}\n",
			[]string{`nodeName: "${NODE_NAME}" is not a node name: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')`}},
		{"several problems, in file order", version + "nodeName: n\ninterfaces:\n  - {name: eth0, queues: [0, 0], cpus: [0, 9]}\n" +
			"services: {file: /x}\nmasquerade: {portRange: 1-2}\nscheduler: x\n",
			[]string{
				"interfaces[0].queues[1]: queue 0 listed twice",
				"interfaces[0].cpus[1]: CPU 9 does not exist (this machine has CPUs 0-1)",
				`masquerade.portRange: "1-2" holds fewer than 64 ports`,
				`scheduler: "x": want random, roundrobin or maglev`,
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseWith([]byte(tc.in), Options{Host: &testHost})
			checkErrors(t, err, tc.want, tc.in)
		})
	}
}

func TestParseNotYAML(t *testing.T) {
	for in, want := range map[string]string{
		"a: [":                           "decoding: yaml: line 1: did not find expected node content",
		"- a\n- b\n":                     "decoding: the file is a list, want a mapping of fields",
		"apiVersion: a\napiVersion: b\n": `decoding: yaml: unmarshal errors:` + "\n" + `  line 2: key "apiVersion" already set in map`,
	} {
		_, err := ParseWith([]byte(in), Options{Host: &testHost})
		if err == nil || err.Error() != want {
			t.Errorf("%q: error %q, want %q", in, err, want)
		}
	}
}

// TestNodeNameOption: Options.NodeName replaces the file's nodeName, or
// supplies it, and is validated like it.
func TestNodeNameOption(t *testing.T) {
	noName := strings.Replace(file("", "", ""), "nodeName: node-1\n", "", 1)
	for _, in := range []string{file("", "", ""), noName} {
		c, err := ParseWith([]byte(in), Options{Host: &testHost, NodeName: "node-7"})
		if err != nil || c.NodeName != "node-7" {
			t.Errorf("NodeName option: %+v, %v\n%s", c, err, in)
		}
	}
	_, err := ParseWith([]byte(noName), Options{Host: &testHost})
	checkErrors(t, err, []string{"nodeName: required"}, noName)
	_, err = ParseWith([]byte(noName), Options{Host: &testHost, NodeName: "Node_7"})
	if err == nil || !strings.HasPrefix(err.Error(), `nodeName: "Node_7" is not a node name`) {
		t.Errorf("bad NodeName option: %v", err)
	}
}

func TestErrorsMessage(t *testing.T) {
	one := Errors{{"batchSize", "0 out of range 1-1024"}}
	if got := one.Error(); got != "batchSize: 0 out of range 1-1024" {
		t.Errorf("one problem: %q", got)
	}
	two := append(one, FieldError{"scheduler", `"x": want random, roundrobin or maglev`})
	if got, want := two.Error(), "2 problems:\n\tbatchSize: 0 out of range 1-1024\n\tscheduler: \"x\": want random, roundrobin or maglev"; got != want {
		t.Errorf("two problems: %q, want %q", got, want)
	}
}

// TestLoad: Load names the file and keeps the field errors reachable.
func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "xdproxy.yaml")
	if err := os.WriteFile(path, []byte(file("", "", "batchSize: 0")), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Load(path)
	var errs Errors
	if err == nil || !strings.HasPrefix(err.Error(), path+": batchSize: ") || !errors.As(err, &errs) || errs[0].Field != "batchSize" {
		t.Errorf("Load: %v", err)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load of a missing file: %v", err)
	}
}

// TestParseThisHost runs Parse against the real machine: CPU 0 is usable
// in any test environment, and a CPU past the kernel's limit never is.
func TestParseThisHost(t *testing.T) {
	h, err := ThisHost()
	if err != nil {
		t.Fatal(err)
	}
	if len(h.CPUs) == 0 {
		t.Fatal("ThisHost: no usable CPUs")
	}
	if _, err := Parse([]byte(file(fmt.Sprintf("{name: eth0, cpus: [%d]}", h.CPUs[0]), "", ""))); err != nil {
		t.Error(err)
	}
	_, err = Parse([]byte(file("{name: eth0, cpus: [4095]}", "", "")))
	if err == nil || !strings.Contains(err.Error(), "interfaces[0].cpus[0]: CPU 4095 does not exist") {
		t.Errorf("CPU 4095: %v", err)
	}
}

func TestWorkerCPU(t *testing.T) {
	usable := []int{0, 1}
	cases := []struct {
		cpus []int
		n    int
		want int
	}{
		{[]int{2, 3}, 0, 2}, {[]int{2, 3}, 1, 3}, // one CPU per queue, as before
		{[]int{5}, 3, 5},                      // every worker on one CPU
		{[]int{2, 3}, 2, 2},                   // more queues than CPUs: wrap around
		{nil, 0, 0}, {nil, 1, 1}, {nil, 2, 0}, // every usable CPU
	}
	for _, c := range cases {
		in := Interface{CPUs: c.cpus}
		if got := in.WorkerCPU(c.n, usable); got != c.want {
			t.Errorf("CPUs %v, queue #%d: CPU %d, want %d", c.cpus, c.n, got, c.want)
		}
	}
	if got := (&Interface{}).WorkerCPU(0, nil); got != -1 {
		t.Errorf("no CPUs at all: %d, want -1", got)
	}
}

// TestDefaultPortsAvoidEphemeralPorts: the default SNAT ports are above
// Linux's stock ip_local_port_range, so they need no reservation.
func TestDefaultPortsAvoidEphemeralPorts(t *testing.T) {
	if stock := conntrack.DefaultSNATPorts; DefaultPorts.First <= stock.Last || DefaultPorts.Validate() != nil {
		t.Errorf("DefaultPorts %v overlap Linux's ephemeral ports %v", DefaultPorts, stock)
	}
}
