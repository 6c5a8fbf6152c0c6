package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// DataplaneOptions configure RunDataplane.
type DataplaneOptions struct {
	Services   int
	Proto      kernelrules.Proto
	CPU        int    // worker CPU, -1 unpinned
	CPUProfile string // write a CPU profile of the whole run here
	Conntrack  int    // conntrack capacity
}

// ReadyLine is what RunDataplane prints on stdout once the table is
// published.
const ReadyLine = "READY"

// RunDataplane runs xdproxy's dataplane engine in the calling process's
// network namespace (the benchmark's node namespace, entered with
// "ip netns exec") on n0 and n1, publishes the benchmark's services, prints
// ReadyLine and the setup time, and serves until SIGTERM or SIGINT.
func RunDataplane(o DataplaneOptions) error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return err
	}
	start := time.Now()
	if o.CPUProfile != "" {
		f, err := os.Create(o.CPUProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	sc := afxdp.DefaultConfig()
	sc.Mode = afxdp.Copy
	if o.Conntrack == 0 {
		o.Conntrack = 1 << 20
	}
	cfg := dataplane.EngineConfig{
		Interfaces: []dataplane.InterfaceConfig{
			{Name: topo.NodeInIface, Queues: []int{0}, CPUs: []int{o.CPU}, Mode: xdp.Native, Socket: sc},
			{Name: topo.NodeOutIface, Queues: []int{0}, CPUs: []int{o.CPU}, Mode: xdp.Native, Socket: sc},
		},
		BatchSize: 64,
		Conntrack: conntrack.Config{Capacity: o.Conntrack},
		SNATPorts: conntrack.DefaultSNATPorts,
		Log:       slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	e, err := dataplane.Start(cfg)
	if err != nil {
		return fmt.Errorf("starting the dataplane: %w", err)
	}
	defer e.Close()
	set := Services(o.Services, o.Proto)
	t := service.Compile(Model(set), service.CompileOptions{ClusterCIDRs: []netip.Prefix{topo.PodCIDR}})
	for _, p := range t.Problems() {
		fmt.Fprintln(os.Stderr, "service table problem:", p)
	}
	if err := e.Publish(t); err != nil {
		return fmt.Errorf("publishing %d services: %w", o.Services, err)
	}
	fmt.Printf("%s %d\n", ReadyLine, time.Since(start).Microseconds())
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// On the way out, the counters say where frames went.
	defer func() {
		var s dataplane.Snapshot
		for _, w := range e.Workers() {
			s.Add(w.Counters.Snapshot())
		}
		x, _ := e.XDPCounters()
		b, _ := json.Marshal(struct {
			Workers dataplane.Snapshot
			XDP     any
		}{s, x})
		fmt.Fprintf(os.Stderr, "xdproxy counters: %s\n", b)
	}()
	select {
	case <-ctx.Done():
		return nil
	case err := <-e.Errors():
		return err
	}
}
