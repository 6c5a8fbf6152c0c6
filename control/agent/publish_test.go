package agent

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestFitLeavesOutOnlyTheOversizedPort: one service port with more
// frontends than the XDP frontend table holds is left out, logged once and
// counted; every other port is published.
func TestFitLeavesOutOnlyTheOversizedPort(t *testing.T) {
	var logs bytes.Buffer
	cfg := &config.Config{XDPTables: config.XDPTables{MaxFrontends: 10}}
	a := &agent{cfg: cfg, log: slog.New(slog.NewTextHandler(&logs, nil))}
	p := &publisher{a: a, rejected: map[service.PortName]string{}, problems: map[string]bool{},
		rejectedTotal: prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})}
	big := service.ServicePort{Name: service.PortName{Namespace: "d", Name: "big"}, Proto: packet.ProtoTCP,
		ClusterIPs: []packet.Addr{packet.MustParseAddr("198.19.0.1")}, Port: 80}
	for i := range 20 {
		big.ExternalIPs = append(big.ExternalIPs, packet.AddrFrom4([4]byte{203, 0, 113, byte(i + 1)}))
	}
	small := service.ServicePort{Name: service.PortName{Namespace: "d", Name: "small"}, Proto: packet.ProtoTCP,
		ClusterIPs: []packet.Addr{packet.MustParseAddr("198.19.0.2")}, Port: 80}
	m := &service.Model{Node: service.Node{Name: "n"}, Ports: []service.ServicePort{big, small}}
	for range 3 { // three publishes: one log line, one count
		t2 := p.fit(m, service.Compile(m, service.CompileOptions{}))
		if got := len(t2.FrontendKeys()); got != 1 {
			t.Fatalf("%d frontends after fitting, want the small port's 1", got)
		}
		if t2.Lookup(packet.ProtoTCP, packet.MustParseAddr("198.19.0.2"), 80) == nil {
			t.Fatal("the small port was left out too")
		}
	}
	if got := testutil.ToFloat64(p.rejectedTotal); got != 1 {
		t.Errorf("rejected counted %v times, want once", got)
	}
	if n := strings.Count(logs.String(), "service port left out"); n != 1 || !strings.Contains(logs.String(), "d/big") {
		t.Errorf("logged %d times:\n%s", n, logs.String())
	}
	// A table that fits is published as it is.
	ok := &service.Model{Node: service.Node{Name: "n"}, Ports: []service.ServicePort{small}}
	tbl := service.Compile(ok, service.CompileOptions{})
	if p.fit(ok, tbl) != tbl {
		t.Error("a table that fits was recompiled")
	}
}
