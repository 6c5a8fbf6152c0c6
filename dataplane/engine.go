package dataplane

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdproxy/xdproxy/dataplane/route"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// InterfaceConfig is one interface the engine attaches to.
type InterfaceConfig struct {
	Name   string
	Queues []int
	CPUs   []int // CPUs[i] pins the worker of Queues[i]
	Mode   xdp.Mode
	Socket afxdp.Config
}

// EngineConfig configures the whole dataplane of a node.
type EngineConfig struct {
	Interfaces []InterfaceConfig
	BatchSize  int
	BusyPoll   bool
	Conntrack  conntrack.Config
	// AffinityCapacity sizes the session-affinity table.
	AffinityCapacity int
	SNATPorts        conntrack.PortRange
	// SNATAddress4 overrides the masquerade source of IPv4 flows; zero
	// means the address of the interface the flow leaves through.
	SNATAddress4 packet.Addr
	// XDPTables sizes the XDP maps; MaxFlows is set from Conntrack.
	XDPTables xdp.Options
	Log       *slog.Logger
}

// Engine is the running dataplane: the XDP programs, one AF_XDP socket and
// one worker per configured queue, the route cache and the shared tables.
// The calling thread must be in the network namespace of the interfaces.
type Engine struct {
	cfg      EngineConfig
	log      *slog.Logger
	objs     *xdp.Objects
	atts     []*xdp.Attachment
	ports    []*Port
	workers  []*Worker
	routes   *route.Cache
	ct       *conntrack.Table
	aff      *service.Affinity
	services service.Current
	ifAddrs  map[int][]packet.Addr // IPv4 addresses of managed interfaces
	nodeAddr []packet.Addr

	publishMu     sync.Mutex
	wg            sync.WaitGroup
	errs          chan error
	stopReconcile chan struct{}
	programmed    bool // the XDP maps hold the current table's keys
}

// Start attaches to every interface and starts the workers. On error
// everything already set up is torn down again.
func Start(cfg EngineConfig) (e *Engine, err error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	e = &Engine{cfg: cfg, log: cfg.Log, ifAddrs: map[int][]packet.Addr{}, errs: make(chan error, 64)}
	defer func() {
		if err != nil {
			e.Close()
			e = nil
		}
	}()
	if e.ct, err = conntrack.New(cfg.Conntrack); err != nil {
		return nil, err
	}
	capAff := cfg.AffinityCapacity
	if capAff == 0 {
		capAff = 65536
	}
	e.aff = service.NewAffinity(capAff)
	e.services.Store(service.Compile(&service.Model{}, service.CompileOptions{}))

	var names []string
	for _, ic := range cfg.Interfaces {
		names = append(names, ic.Name)
	}
	if e.routes, err = route.New(route.Options{Interfaces: names, ErrorLog: func(err error) { e.log.Warn("route cache", "err", err) }}); err != nil {
		return nil, fmt.Errorf("route cache: %w", err)
	}
	// The flow map holds one reply tuple per DNAT-only connection; size it
	// like the connection table so that the kernel's LRU never evicts a
	// live flow's entry.
	xo := cfg.XDPTables
	xo.MaxFlows = e.ct.Capacity()
	if e.objs, err = xdp.Load(xo); err != nil {
		return nil, fmt.Errorf("loading the XDP program: %w", err)
	}
	for _, ic := range cfg.Interfaces {
		if err := e.attach(ic); err != nil {
			return nil, err
		}
	}
	if cfg.SNATAddress4.IsZero() && len(e.nodeAddr) == 0 {
		return nil, errors.New("no IPv4 address on any interface to masquerade to; set masquerade.address")
	}
	resolver := routeResolver{e.routes}
	k := 0
	for _, ic := range cfg.Interfaces {
		for qi := range ic.Queues {
			port := e.ports[k]
			k++
			proc := NewProcessor(ProcessorConfig{
				Services: &e.services, Conntrack: e.ct, Affinity: e.aff,
				SNATPorts: cfg.SNATPorts, SNATSource: e.snatSource, Seed: uint64(k) * 0x9e3779b97f4a7c15,
			})
			cpu := -1
			if qi < len(ic.CPUs) {
				cpu = ic.CPUs[qi]
			}
			flows := flowWriter{e.objs.NewFlowWriter(maxBatch)}
			w := NewWorker(WorkerConfig{CPU: cpu, BatchSize: cfg.BatchSize, BusyPoll: cfg.BusyPoll}, port, e.ports, proc, resolver, flows)
			e.workers = append(e.workers, w)
		}
	}
	e.stopReconcile = make(chan struct{})
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.reconcileFlows()
	}()
	for _, w := range e.workers {
		e.wg.Add(1)
		go func(w *Worker) {
			defer e.wg.Done()
			if err := w.Run(); err != nil {
				e.log.Error("worker stopped", "interface", w.port.Name, "queue", w.port.Queue, "err", err)
				e.errs <- err
			}
		}(w)
	}
	return e, nil
}

func (e *Engine) attach(ic InterfaceConfig) error {
	l, err := netlink.LinkByName(ic.Name)
	if err != nil {
		return fmt.Errorf("interface %q: %w", ic.Name, err)
	}
	ifindex := l.Attrs().Index
	addrs, err := netlink.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("interface %q addresses: %w", ic.Name, err)
	}
	for _, a := range addrs {
		if ip4 := a.IP.To4(); ip4 != nil && !a.IP.IsLinkLocalUnicast() {
			pa := packet.AddrFromSlice4(ip4)
			e.ifAddrs[ifindex] = append(e.ifAddrs[ifindex], pa)
			e.nodeAddr = append(e.nodeAddr, pa)
		}
	}
	att, err := e.objs.Attach(ifindex, ic.Mode)
	if err != nil {
		return fmt.Errorf("attaching XDP to %q: %w", ic.Name, err)
	}
	e.atts = append(e.atts, att)
	for _, q := range ic.Queues {
		sock, err := afxdp.Open(ifindex, q, ic.Socket)
		if err != nil {
			return fmt.Errorf("AF_XDP socket on %q queue %d: %w", ic.Name, q, err)
		}
		e.ports = append(e.ports, NewPort(ifindex, ic.Name, q, sock))
		if err := att.RegisterSocket(q, sock.FD()); err != nil {
			return fmt.Errorf("registering the socket of %q queue %d: %w", ic.Name, q, err)
		}
	}
	e.log.Info("attached", "interface", ic.Name, "xdpMode", att.Mode().String(), "queues", ic.Queues)
	return nil
}

// snatSource is the masquerade address for a flow to backend: the
// configured one, else the address of the interface the flow leaves by.
func (e *Engine) snatSource(backend packet.Addr) (packet.Addr, bool) {
	if backend.Is4() && !e.cfg.SNATAddress4.IsZero() {
		return e.cfg.SNATAddress4, true
	}
	if h, st := e.routes.Lookup(backend); st == route.Found || st == route.NeedsResolution {
		if as := e.ifAddrs[int(h.IfIndex)]; len(as) > 0 && backend.Is4() {
			return as[0], true
		}
	}
	if backend.Is4() && len(e.nodeAddr) > 0 {
		return e.nodeAddr[0], true
	}
	return packet.Addr{}, false
}

// NodeAddresses are the IPv4 addresses of the managed interfaces.
func (e *Engine) NodeAddresses() []packet.Addr { return e.nodeAddr }

// Services is the table holder the workers read.
func (e *Engine) Services() *service.Current { return &e.services }

// Conntrack is the connection table.
func (e *Engine) Conntrack() *conntrack.Table { return e.ct }

// Workers lists the workers.
func (e *Engine) Workers() []*Worker { return e.workers }

// Errors delivers fatal worker errors.
func (e *Engine) Errors() <-chan error { return e.errs }

// XDPCounters sums the XDP programs' counters.
func (e *Engine) XDPCounters() (xdp.Counters, error) { return e.objs.Counters() }

// Routes is the route cache.
func (e *Engine) Routes() *route.Cache { return e.routes }

// Publish makes t the table workers use and programs the XDP maps for it:
// the table is swapped first (one atomic store), then the maps gain new keys
// before losing stale ones, so no packet of a live service is handed to the
// kernel in between. UDP flows to endpoints that t no longer has are
// deleted, so that their next packet picks a live endpoint instead of being
// sent to a removed one until the flow times out.
func (e *Engine) Publish(t *service.Table) error {
	e.publishMu.Lock()
	defer e.publishMu.Unlock()
	old := e.services.Load()
	e.services.Store(t)
	// An incremental compile shares unchanged key lists with the previous
	// table; then the XDP maps already hold exactly these keys.
	unchanged := old != nil && e.programmed &&
		sameSlice(old.FrontendKeys(), t.FrontendKeys()) && sameSlice(old.BackendKeys(), t.BackendKeys()) &&
		sameSlice(old.VIPs(), t.VIPs())
	if !unchanged {
		if err := e.programXDP(t); err != nil {
			e.programmed = false
			return err
		}
		e.programmed = true
	}
	// Ask for the endpoints' neighbours now, so that the first packet of a
	// flow does not find its next hop unresolved (a lone UDP datagram
	// would be lost).
	seen := map[packet.Addr]bool{}
	for _, k := range t.BackendKeys() {
		if !seen[k.Addr] {
			seen[k.Addr] = true
			e.routes.Lookup(k.Addr)
		}
	}
	if old != nil {
		for _, k := range old.BackendKeys() {
			if k.Proto != packet.ProtoTCP && !t.IsBackend(k.Proto, k.Addr, k.Port) {
				if n := e.ct.DeleteByBackend(k.Addr, k.Port, k.Proto); n > 0 {
					e.log.Info("flows to removed endpoint deleted", "endpoint", fmt.Sprintf("%v:%d", k.Addr, k.Port), "proto", k.Proto.String(), "flows", n)
				}
			}
		}
	}
	return nil
}

func (e *Engine) programXDP(t *service.Table) error {
	conv := func(ks []service.Key) []xdp.Key {
		out := make([]xdp.Key, len(ks))
		for i, k := range ks {
			out[i] = xdp.Key{Addr: k.Addr, Port: k.Port, Proto: k.Proto}
		}
		return out
	}
	addrs := map[packet.Addr]xdp.Flags{}
	for _, a := range e.nodeAddr {
		addrs[a] |= xdp.FlagNode
	}
	if !e.cfg.SNATAddress4.IsZero() {
		addrs[e.cfg.SNATAddress4] |= xdp.FlagNode
	}
	for _, a := range t.VIPs() {
		addrs[a] |= xdp.FlagVIP
	}
	for _, k := range t.BackendKeys() {
		addrs[k.Addr] |= xdp.FlagBackend
	}
	return e.objs.SetTables(conv(t.FrontendKeys()), conv(t.BackendKeys()), addrs,
		xdp.PortRange{Lo: e.cfg.SNATPorts.First, Hi: e.cfg.SNATPorts.Last})
}

// Close stops the workers, detaches the programs and closes the sockets.
func (e *Engine) Close() error {
	for _, w := range e.workers {
		w.Stop()
	}
	if e.stopReconcile != nil {
		close(e.stopReconcile)
	}
	e.wg.Wait()
	var errs []error
	for _, a := range e.atts {
		errs = append(errs, a.Close())
	}
	for _, p := range e.ports {
		errs = append(errs, p.Sock.Close())
	}
	if e.objs != nil {
		errs = append(errs, e.objs.Close())
	}
	if e.routes != nil {
		errs = append(errs, e.routes.Close())
	}
	return errors.Join(errs...)
}

// routeResolver adapts the route cache to Resolver.
type routeResolver struct{ c *route.Cache }

func (r routeResolver) Resolve(dst packet.Addr) (NextHop, packet.Reason) {
	h, st := r.c.Lookup(dst)
	switch st {
	case route.Found:
		return NextHop{Ifindex: int(h.IfIndex), Src: h.SrcMAC, Dst: h.DstMAC}, packet.OK
	case route.NeedsResolution:
		return NextHop{}, packet.DropNeighbor
	}
	return NextHop{}, packet.DropNoRoute
}

// flowWriter adapts xdp.FlowWriter to FlowPublisher.
type flowWriter struct{ w *xdp.FlowWriter }

func (f flowWriter) Add(t packet.Tuple) bool {
	return f.w.Add(xdp.FlowKey(t))
}

func (f flowWriter) Flush() error { return f.w.Flush() }

// reconcileInterval is how often the XDP flow map is compared with the
// connection table.
const reconcileInterval = 10 * time.Second

// reconcileFlows deletes reply tuples from the XDP flow map whose flow the
// connection table no longer has (expired, evicted, deleted), so that a
// later direct connection with the same tuple reaches the kernel. The map
// is an LRU, so a missed deletion costs memory, never correctness of live
// flows.
func (e *Engine) reconcileFlows() {
	t := time.NewTicker(reconcileInterval)
	defer t.Stop()
	for {
		select {
		case <-e.stopReconcile:
			return
		case <-t.C:
		}
		if _, err := e.reconcileOnce(); err != nil {
			e.log.Warn("reconciling the XDP flow map", "err", err)
		}
	}
}

// reconcileOnce makes one pass and returns how many tuples it removed.
func (e *Engine) reconcileOnce() (int, error) {
	now := monotonicNow()
	var stale []xdp.FlowKey
	err := e.objs.ForEachFlow(func(k xdp.FlowKey) bool {
		if _, _, ok := e.ct.Lookup(packet.Tuple(k), now); !ok {
			stale = append(stale, k)
		}
		return true
	})
	if err == nil && len(stale) > 0 {
		err = e.objs.DeleteFlows(stale)
	}
	return len(stale), err
}

// sameSlice reports whether a and b are the same slice (not merely equal).
func sameSlice[T any](a, b []T) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}
