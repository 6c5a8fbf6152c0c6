package dataplane

import (
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// startEngine runs an in-process Engine in the testbed's node namespace.
func startEngine(t testing.TB, tb *testbed.Testbed) *Engine {
	return startEngineSized(t, tb, 65536)
}

// startEngineSized is startEngine with a connection table of flows entries
// and an XDP flow map twice that size.
func startEngineSized(t testing.TB, tb *testbed.Testbed, flows int) *Engine {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root (make test runs as root)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	sc := afxdp.DefaultConfig()
	names := []string{tb.NodeClientSide().Iface, tb.NodeLANSide().Iface}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	var e *Engine
	err := tb.Do(tb.NodeNS(), func() error {
		k, err := NewKernel(KernelOptions{Interfaces: names, Tables: xdp.Options{MaxFlows: 2 * flows}, Log: log})
		if err != nil {
			return err
		}
		e, err = Start(EngineConfig{
			Kernel: k,
			Interfaces: []InterfaceConfig{
				{Name: names[0], Mode: xdp.Native, Socket: sc},
				{Name: names[1], Mode: xdp.Native, Socket: sc},
			},
			ExceptionInterface: "xdpx0",
			Conntrack:          conntrack.Config{Capacity: flows},
			SNATPorts:          conntrack.PortRange{First: 61000, Last: 65535},
			Log:                log,
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

func webModel(backends int) *service.Model {
	m := &service.Model{Node: service.Node{Name: "node-1"}}
	var eps []service.Endpoint
	for i := 0; i < backends; i++ {
		eps = append(eps, service.Endpoint{Addr: packet.AddrFromNetip(testbed.BackendAddr(i)), Port: testbed.HTTPPort, Ready: true, Serving: true})
	}
	m.Ports = append(m.Ports, service.ServicePort{
		Name: service.PortName{Namespace: "default", Name: "web"}, Proto: packet.ProtoTCP,
		ClusterIPs: []packet.Addr{packet.MustParseAddr("198.19.0.10")}, Port: 80, Endpoints: eps})
	return m
}

// TestEngineForwardsHTTP sends real HTTP requests from the client namespace
// to a cluster IP through the XDP program, AF_XDP sockets and workers.
func TestEngineForwardsHTTP(t *testing.T) {
	tb := testbed.NewForTest(t, testbed.Options{})
	if err := tb.StartServers(); err != nil {
		t.Fatal(err)
	}
	e := startEngine(t, tb)
	if err := e.Publish(service.Compile(webModel(3), service.CompileOptions{})); err != nil {
		t.Fatal(err)
	}
	client := tb.HTTPClient(tb.ClientNS(), 3*time.Second)
	hits := map[string]int{}
	for i := 0; i < 30; i++ {
		resp, err := client.Get("http://198.19.0.10/")
		if err != nil {
			var s Snapshot
			for _, w := range e.Workers() {
				s.Add(w.Counters.Snapshot())
			}
			x, _ := e.XDPCounters()
			t.Fatalf("request %d: %v\nworkers %+v\nxdp %+v", i, err, s, x)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		hits[strings.TrimSpace(string(b))]++
	}
	t.Logf("hits: %v", hits)
	// The flows just made are all still tracked: reconciling the XDP flow
	// map must keep every one of their reply tuples.
	if removed, restored, err := e.reconcileOnce(); err != nil || removed != 0 || restored != 0 {
		t.Fatalf("reconcile removed %d live flows and restored %d (err %v)", removed, restored, err)
	}
	if len(hits) != 3 {
		t.Fatalf("requests reached %d backends, want 3: %v", len(hits), hits)
	}
}

// BenchmarkReconcilePass is one pass of the flow reconciler over a real XDP
// flow map and connection table holding a million live flows: what a
// periodic pass costs a node that busy, and what paces the passes
// (reconcileDelays).
func BenchmarkReconcilePass(b *testing.B) {
	const flows = 1 << 20
	tb := testbed.NewForTest(b, testbed.Options{})
	e := startEngineSized(b, tb, flows)
	now := monotonicNow()
	w := e.tables.NewFlowWriter(4096)
	for i := 0; i < flows; i++ {
		orig := packet.Tuple{Src: packet.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), SrcPort: 40000,
			Dst: packet.MustParseAddr("198.19.0.10"), DstPort: 80, Proto: packet.ProtoUDP}
		xlat := orig
		xlat.Dst, xlat.DstPort = packet.AddrFromNetip(testbed.BackendAddr(i%3)), testbed.HTTPPort
		if _, res := e.ct.Insert(orig, xlat, 0, 1, now); res != conntrack.Inserted {
			b.Fatalf("insert %d: %v", i, res)
		}
		if !w.Add(xdp.FlowKey(xlat.Reverse())) {
			if _, err := w.Flush(); err != nil {
				b.Fatal(err)
			}
			w.Add(xdp.FlowKey(xlat.Reverse()))
		}
	}
	if _, err := w.Flush(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if removed, restored, err := e.reconcileOnce(); err != nil || removed != 0 || restored != 0 {
			b.Fatalf("a pass over live flows removed %d and restored %d (%v)", removed, restored, err)
		}
	}
}
