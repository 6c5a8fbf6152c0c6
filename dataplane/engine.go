package dataplane

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// InterfaceConfig is one interface the engine serves.
type InterfaceConfig struct {
	Name string
	// Queues lists the receive queues to serve, one worker each. Nil
	// serves every queue the interface has, and follows changes of its
	// channel count.
	Queues []int
	// CPUs pins the workers: the worker of the i-th served queue runs on
	// CPUs[i%len(CPUs)]. Empty leaves them unpinned.
	CPUs   []int
	Mode   xdp.Mode
	Socket afxdp.Config
}

// EngineConfig configures the whole dataplane of a node.
type EngineConfig struct {
	// Kernel is how the engine reaches the kernel (NewKernel for the real
	// one). The engine owns it from Start on and closes it.
	Kernel     Kernel
	Interfaces []InterfaceConfig
	// ExceptionInterface names the veth pair through which frames that
	// reached a worker but are the kernel's after all are handed to the
	// kernel's stack. Empty means none: such frames are dropped and
	// counted (drop_no_kernel_path).
	ExceptionInterface string
	BatchSize          int
	BusyPoll           bool
	Conntrack          conntrack.Config
	// AffinityCapacity sizes the session-affinity table.
	AffinityCapacity int
	SNATPorts        conntrack.PortRange
	// ReserveSNATPorts lets SNATPorts overlap the kernel's ephemeral port
	// range by reserving them (ip_local_reserved_ports). Without it an
	// overlap is an error: a masqueraded flow and a connection of the
	// node's own could then have the same reply tuple.
	ReserveSNATPorts bool
	// SNATAddress4 overrides the masquerade source of IPv4 flows; zero
	// means the address of the interface the flow leaves through.
	SNATAddress4 packet.Addr
	// LocalClientsCgroup, when set, is the cgroup v2 under which clients
	// on the node (pods, host processes) have their service connections
	// translated at the socket (Kernel.LocalClients); the node's root
	// cgroup covers every one.
	LocalClientsCgroup string
	// NoLocalhostNodePorts keeps local clients' NodePorts off 127.0.0.1:
	// kube-proxy serves them there only while nodePortAddresses is unset
	// or includes the loopback address.
	NoLocalhostNodePorts bool
	// StateDir, when set, holds the connection table and the
	// session-affinity table as files mapped into memory
	// (conntrack.state, affinity.state; put it on a tmpfs): the next
	// process adopts them, so connections keep their translation and
	// clients their backend across a restart.
	StateDir string
	// KeepState makes Close leave the XDP programs attached (pinned) and
	// the connection table's state file in place, for the next process
	// to adopt: a restart or an upgrade then breaks no connection. Without
	// it Close detaches everything.
	KeepState bool
	// LinkCheckInterval is how often interfaces are looked at again
	// without a netlink event (a NIC's channel count changes without
	// one); 0 means 2 seconds.
	LinkCheckInterval time.Duration
	Log               *slog.Logger
	// IOFloor, when set, runs every worker in the I/O floor benchmarking
	// mode (see IOFloor): frames are forwarded between the interfaces
	// untranslated. Never on a node with real traffic.
	IOFloor *IOFloor
	// SYNGuard tunes the SYN guard against floods of new connections.
	SYNGuard SYNGuardConfig
}

// Engine is the running dataplane: the XDP programs, one AF_XDP socket and
// one worker per served queue, the exception link and the shared tables.
// It follows its interfaces: a queue added by ethtool -L gets a socket and
// a worker, an interface deleted and created again is attached again.
type Engine struct {
	cfg      EngineConfig
	log      *slog.Logger
	k        Kernel
	tables   Tables
	ct       *conntrack.Table
	aff      *service.Affinity
	services service.Current

	egress atomic.Pointer[egress]
	addrs  atomic.Pointer[nodeAddrs]
	// kernelMAC is the MAC of the exception link's kernel end: the
	// destination of every frame handed to the kernel.
	kernelMAC net.HardwareAddr

	nicMu sync.Mutex // serialises reconciling, SetChannels and Close
	nics  []*nic
	seq   uint64 // workers made, seeds their random sources
	// seedBase makes every process's random backend choices its own.
	seedBase uint64
	closing  bool

	publishMu  sync.Mutex
	programmed bool // the XDP maps hold the current table's keys

	// gone carries the reply tuples of flows that left conntrack to the
	// janitor, which deletes them from the XDP flow table.
	gone        chan xdp.FlowKey
	goneDropped atomic.Uint64 // tuples the full channel lost (the reconciler deletes them)
	// reconcileNow asks the flow reconciler for a pass now rather than at
	// its next tick: tuples were lost, or the flow table refused one.
	reconcileNow chan struct{}
	// flowEntries, flowRemoved, flowRestored and flowPassTook: what the
	// reconciler's passes found in the XDP flow map, and how long the last
	// one took (FlowTableStats).
	flowEntries, flowPassTook atomic.Int64
	flowRemoved, flowRestored atomic.Uint64
	// inFlowMap is reconcileOnce's set of the tuples in the flow map,
	// reused from pass to pass; reconcileMu keeps passes one at a time
	// (the reconciler's, and tests').
	reconcileMu sync.Mutex
	inFlowMap   flowSet
	synGuardOn  atomic.Bool
	// snatPortsProblem says why the SNAT ports are no longer safe from
	// the node's own connections ("" when they are): watchSNATPorts keeps
	// it, Healthy reports it.
	snatPortsProblem atomic.Pointer[string]
	// overrun wakes the SYN guard when an insert found the connection
	// table full (conntrack's OnOverrun).
	overrun chan struct{}

	closeOnce sync.Once
	closeErr  error
	wg        sync.WaitGroup
	errs      chan error
	stop      chan struct{}
	kick      chan struct{}
	stopWatch func()
}

// nic is one configured interface and what the engine made on it.
type nic struct {
	cfg     InterfaceConfig
	link    Link       // as attached; Index 0 while not attached
	att     Attachment // nil while not attached
	egress  Attachment // the egress program; nil without an exception link
	ports   []*Port    // in queue order
	workers []*Worker  // workers[i] receives on ports[i]
	problem string     // why it is not fully served; "" when it is
	// exception marks xdproxy's end of the exception link: its socket is
	// where frames for the kernel leave, and where the replies of local
	// backends arrive.
	exception bool
}

// nodeAddrs are the addresses of the served interfaces, for masquerading
// and for telling VIPs from node addresses.
type nodeAddrs struct {
	byIfindex  map[int][]packet.Addr // IPv4 only
	byIfindex6 map[int][]packet.Addr // IPv6 only (link-local ones are not in Link.Addrs)
	v4, v6     []packet.Addr
	all        map[packet.Addr]bool
}

// Start attaches to every interface and starts the workers. A configured
// interface that does not exist, or an explicit queue list that leaves
// one of its queues unserved, is an error. On error everything already
// set up is torn down again.
func Start(cfg EngineConfig) (_ *Engine, err error) {
	if cfg.Kernel == nil {
		return nil, errors.New("dataplane: no Kernel")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.LinkCheckInterval <= 0 {
		cfg.LinkCheckInterval = 2 * time.Second
	}
	e := &Engine{cfg: cfg, log: cfg.Log, k: cfg.Kernel, tables: cfg.Kernel.Tables(),
		errs: make(chan error, 64), stop: make(chan struct{}), kick: make(chan struct{}, 1),
		gone: make(chan xdp.FlowKey, goneQueue), reconcileNow: make(chan struct{}, 1), seedBase: rand.Uint64(),
		overrun: make(chan struct{}, 1)}
	cfg.Conntrack.OnRemove = e.flowGone
	cfg.Conntrack.OnOverrun = e.tableOverrun
	if cfg.StateDir != "" {
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			return nil, fmt.Errorf("state directory: %w", err)
		}
		cfg.Conntrack.StatePath = filepath.Join(cfg.StateDir, conntrackStateFile)
	}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.ct, err = conntrack.New(cfg.Conntrack); err != nil {
		return nil, err
	}
	if cfg.StateDir != "" {
		info := e.ct.Restored()
		e.log.Info("connection table", "state", info.String(), "hugePages", info.HugePages)
		m, _ := conntrack.StateDirMountOf(cfg.StateDir)
		switch {
		case !conntrack.OnTmpfs(cfg.StateDir):
			e.log.Warn("the connection table's state file is not on a tmpfs: the kernel writes the table back to "+
				"disk as it changes; mount a tmpfs with huge pages there first (xdproxy mount-state-dir)",
				"stateDir", cfg.StateDir, "mount", m.String())
		case !info.HugePages:
			e.log.Warn("the connection table's state file is on 4 KiB pages: new flows and lookups pay TLB misses "+
				"(about twice the cost of an insert); mount a tmpfs with huge pages there first (xdproxy mount-state-dir)",
				"stateDir", cfg.StateDir, "mount", m.String())
		}
	}
	capAff := cfg.AffinityCapacity
	if capAff == 0 {
		capAff = 65536
	}
	if cfg.StateDir != "" {
		var res service.AffinityRestore
		if e.aff, res, err = service.OpenAffinity(filepath.Join(cfg.StateDir, affinityStateFile), capAff); err != nil {
			return nil, err
		}
		e.log.Info("session affinity table", "adopted", res.Adopted, "reason", res.Reason)
	} else {
		e.aff = service.NewAffinity(capAff)
	}
	if err := e.checkSNATPorts(); err != nil {
		return nil, err
	}
	e.services.Store(service.Compile(&service.Model{}, service.CompileOptions{}))
	e.addrs.Store(&nodeAddrs{byIfindex: map[int][]packet.Addr{}, byIfindex6: map[int][]packet.Addr{}, all: map[packet.Addr]bool{}})

	frameSize := 0
	for _, ic := range cfg.Interfaces {
		if frameSize != 0 && ic.Socket.FrameSize != frameSize {
			return nil, fmt.Errorf("interface %s: frame size %d differs from %d; every interface must use the same",
				ic.Name, ic.Socket.FrameSize, frameSize)
		}
		frameSize = ic.Socket.FrameSize
		e.nics = append(e.nics, &nic{cfg: ic})
	}
	if cfg.ExceptionInterface != "" && len(cfg.Interfaces) > 0 {
		if err := e.openKernelPort(cfg.ExceptionInterface, cfg.Interfaces[0].Socket); err != nil {
			return nil, err
		}
	}
	e.nicMu.Lock()
	e.reconcileLocked()
	var problems []string
	for _, n := range e.nics {
		if n.problem != "" {
			problems = append(problems, n.cfg.Name+": "+n.problem)
		}
	}
	e.nicMu.Unlock()
	if len(problems) > 0 {
		return nil, errors.New(strings.Join(problems, "; "))
	}
	if cfg.SNATAddress4.IsZero() && len(e.addrs.Load().v4) == 0 {
		return nil, errors.New("no IPv4 address on any interface to masquerade to; set masquerade.address")
	}
	if cfg.LocalClientsCgroup != "" {
		lc := e.k.LocalClients()
		if lc == nil {
			return nil, errors.New("local clients: the kernel was made without them")
		}
		if err := lc.Attach(cfg.LocalClientsCgroup); err != nil {
			return nil, fmt.Errorf("local clients: attaching to %s: %w", cfg.LocalClientsCgroup, err)
		}
		e.log.Info("translating local clients' connections at the socket", "cgroup", cfg.LocalClientsCgroup)
	}
	if e.stopWatch, err = e.k.WatchLinks(e.kickReconcile); err != nil {
		return nil, err
	}
	e.wg.Add(3)
	if !cfg.SYNGuard.Disabled {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.guardSYNs()
		}()
	}
	go func() {
		defer e.wg.Done()
		e.followLinks()
	}()
	go func() {
		defer e.wg.Done()
		e.deleteGoneFlows()
	}()
	go func() {
		defer e.wg.Done()
		e.reconcileFlows()
	}()
	if cfg.SNATPorts.First != 0 {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.watchSNATPorts()
		}()
	}
	return e, nil
}

// The state files in EngineConfig.StateDir.
const (
	conntrackStateFile = "conntrack.state"
	affinityStateFile  = "affinity.state"
)

// RemoveState deletes the state files of dir (xdproxy cleanup).
// reservedPortsFile, in the state directory, holds the SNAT port range
// xdproxy added to net.ipv4.ip_local_reserved_ports ("first-last").
const reservedPortsFile = "reserved-ports"

// ReleaseReservedPorts takes the SNAT ports xdproxy reserved (as recorded
// in dir) out of net.ipv4.ip_local_reserved_ports of the current network
// namespace, and forgets them (xdproxy cleanup).
func ReleaseReservedPorts(dir string) error {
	name := filepath.Join(dir, reservedPortsFile)
	b, err := os.ReadFile(name)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var r conntrack.PortRange
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d-%d", &r.First, &r.Last); err != nil {
		return fmt.Errorf("%s: %q: %w", name, b, err)
	}
	if _, err := unreservePorts(r); err != nil {
		return fmt.Errorf("releasing the reserved SNAT ports %d-%d: %w", r.First, r.Last, err)
	}
	return os.Remove(name)
}

func RemoveState(dir string) error {
	return errors.Join(conntrack.RemoveState(filepath.Join(dir, conntrackStateFile)),
		os.Remove(filepath.Join(dir, affinityStateFile)))
}

// checkSNATPorts makes sure the SNAT ports are no ports the kernel gives
// the node's own connections.
func (e *Engine) checkSNATPorts() error {
	r := e.cfg.SNATPorts
	if r.First == 0 {
		return nil
	}
	eph, err := e.k.LocalPortRange()
	if err != nil {
		return fmt.Errorf("reading the ephemeral port range: %w", err)
	}
	if r.Last < eph.First || r.First > eph.Last {
		return nil
	}
	if !e.cfg.ReserveSNATPorts {
		return fmt.Errorf("masquerade.portRange %d-%d overlaps net.ipv4.ip_local_port_range %d-%d, where the node's "+
			"own connections take their ports: choose SNAT ports outside it (the default 61000-65535 is), or set "+
			"masquerade.reservePorts to reserve them with net.ipv4.ip_local_reserved_ports",
			r.First, r.Last, eph.First, eph.Last)
	}
	if _, err := e.reserveSNATPorts(); err != nil {
		return err
	}
	e.log.Info("SNAT ports reserved from the kernel's ephemeral range", "snat", fmt.Sprintf("%d-%d", r.First, r.Last),
		"ephemeral", fmt.Sprintf("%d-%d", eph.First, eph.Last))
	return nil
}

// reserveSNATPorts adds the SNAT ports to net.ipv4.ip_local_reserved_ports
// and, when it added them (not when the list held them already: that
// entry is the operator's), records that in StateDir, so that xdproxy
// cleanup takes out exactly what xdproxy put in.
func (e *Engine) reserveSNATPorts() (added bool, err error) {
	r := e.cfg.SNATPorts
	added, err = e.k.ReservePorts(r)
	if err != nil {
		return false, fmt.Errorf("reserving SNAT ports %d-%d: %w", r.First, r.Last, err)
	}
	if added && e.cfg.StateDir != "" {
		if err := os.WriteFile(filepath.Join(e.cfg.StateDir, reservedPortsFile), fmt.Appendf(nil, "%d-%d\n", r.First, r.Last), 0o600); err != nil {
			return added, fmt.Errorf("recording the reserved SNAT ports: %w", err)
		}
	}
	return added, nil
}

// snatPortsCheckInterval is how often watchSNATPorts looks at the node's
// port sysctls again.
const snatPortsCheckInterval = 30 * time.Second

// watchSNATPorts checks the SNAT ports against the node's ephemeral range
// again every snatPortsCheckInterval: checkSNATPorts did at start, but an
// operator or another agent may widen net.ipv4.ip_local_port_range or
// rewrite net.ipv4.ip_local_reserved_ports later, and the node's own
// connections could then take SNAT ports, whose replies xdproxy would
// take for its flows'.
func (e *Engine) watchSNATPorts() {
	t := time.NewTicker(snatPortsCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
			e.recheckSNATPorts()
		}
	}
}

// recheckSNATPorts is one check of watchSNATPorts. With
// masquerade.reservePorts it reserves the ports again if someone took them
// out of the reserved list; otherwise an overlap can only be reported (the
// ephemeral range is the operator's): Healthy fails, with both ranges,
// until it is gone.
func (e *Engine) recheckSNATPorts() {
	problem := e.snatPortsConflict()
	old := ""
	if p := e.snatPortsProblem.Swap(&problem); p != nil {
		old = *p
	}
	switch {
	case problem != "" && problem != old:
		e.log.Error("SNAT ports unsafe", "problem", problem)
	case problem == "" && old != "":
		e.log.Info("SNAT ports safe again", "snat", fmt.Sprintf("%d-%d", e.cfg.SNATPorts.First, e.cfg.SNATPorts.Last))
	}
}

func (e *Engine) snatPortsConflict() string {
	r := e.cfg.SNATPorts
	eph, err := e.k.LocalPortRange()
	if err != nil {
		return fmt.Sprintf("reading the ephemeral port range: %v", err)
	}
	if r.Last < eph.First || r.First > eph.Last {
		return ""
	}
	if !e.cfg.ReserveSNATPorts {
		return fmt.Sprintf("masquerade.portRange %d-%d now overlaps net.ipv4.ip_local_port_range %d-%d (changed since "+
			"xdproxy started): the node's own connections may take SNAT ports", r.First, r.Last, eph.First, eph.Last)
	}
	inside := conntrack.PortRange{First: max(r.First, eph.First), Last: min(r.Last, eph.Last)}
	reserved, err := e.k.ReservedPorts()
	if err != nil {
		return fmt.Sprintf("reading the reserved ports: %v", err)
	}
	if portsCovered(reserved, inside) {
		return ""
	}
	if _, err := e.reserveSNATPorts(); err != nil {
		return fmt.Sprintf("SNAT ports %d-%d are in net.ipv4.ip_local_port_range %d-%d and not reserved: %v",
			r.First, r.Last, eph.First, eph.Last, err)
	}
	// Either the ephemeral range grew over them since the start, or
	// someone rewrote the reserved list.
	e.log.Warn("SNAT ports were in the ephemeral range without a reservation; reserved them",
		"snat", fmt.Sprintf("%d-%d", r.First, r.Last), "ephemeral", fmt.Sprintf("%d-%d", eph.First, eph.Last))
	return ""
}

// portsCovered reports whether every port of r is in one of the ranges.
func portsCovered(ranges []conntrack.PortRange, r conntrack.PortRange) bool {
	for p := int(r.First); p <= int(r.Last); p++ {
		in := false
		for _, q := range ranges {
			if uint16(p) >= q.First && uint16(p) <= q.Last {
				// Skip to the end of this range at once.
				p, in = int(q.Last), true
				break
			}
		}
		if !in {
			return false
		}
	}
	return true
}

// openKernelPort sets up the exception link and serves xdproxy's end of
// it like an interface of one queue.
func (e *Engine) openKernelPort(name string, sc afxdp.Config) error {
	ke, xe, err := e.k.ExceptionLink(name)
	if err != nil {
		return err
	}
	if err := e.k.SetEgressRedirect(ke.Index); err != nil {
		return err
	}
	e.kernelMAC = ke.MAC
	var cpus []int
	if len(e.cfg.Interfaces) > 0 {
		cpus = e.cfg.Interfaces[0].CPUs
	}
	e.nics = append(e.nics, &nic{exception: true,
		cfg: InterfaceConfig{Name: xe.Name, Queues: []int{0}, CPUs: cpus, Mode: xdp.Native, Socket: sc}})
	e.log.Info("exception link ready", "kernelEnd", ke.Name, "xdproxyEnd", xe.Name)
	return nil
}

func (e *Engine) kickReconcile() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// followLinks reconciles the interfaces on every link event and every
// LinkCheckInterval.
func (e *Engine) followLinks() {
	t := time.NewTicker(e.cfg.LinkCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-e.kick:
		case <-t.C:
		}
		e.nicMu.Lock()
		if !e.closing {
			e.reconcileLocked()
		}
		e.nicMu.Unlock()
	}
}

// reconcileLocked brings every interface to what its config asks for and
// the kernel now has. Called with nicMu held.
func (e *Engine) reconcileLocked() {
	var started []*Worker
	var closed []*Port
	changed := false
	for _, n := range e.nics {
		s, c, ch := e.reconcileNIC(n)
		started = append(started, s...)
		closed = append(closed, c...)
		changed = changed || ch
	}
	if !changed {
		return
	}
	e.publishLinks()
	for _, p := range closed {
		if err := p.close(); err != nil {
			e.log.Warn("closing socket", "interface", p.Name, "queue", p.Queue, "err", err)
		}
	}
	for _, w := range started {
		e.runWorker(w)
	}
	// Register the sockets only now that their workers keep their fill
	// rings full.
	for _, n := range e.nics {
		for _, p := range n.ports {
			if !slices.ContainsFunc(started, func(w *Worker) bool { return w.port == p }) {
				continue
			}
			if err := n.att.RegisterSocket(p.Queue, p.Sock.FD()); err != nil {
				n.problem = fmt.Sprintf("registering the socket of queue %d: %v", p.Queue, err)
				e.log.Error("interface not served", "interface", n.cfg.Name, "problem", n.problem)
			}
		}
	}
}

// reconcileNIC attaches to, re-attaches to or detaches from one
// interface and opens or closes sockets for its queues. It returns the
// new workers (not started yet), the ports to close once the egress
// snapshot no longer has them, and whether anything changed.
func (e *Engine) reconcileNIC(n *nic) (started []*Worker, closed []*Port, changed bool) {
	l, err := e.k.Link(n.cfg.Name)
	if err != nil && n.exception {
		// Someone deleted it: make it again.
		var ke Link
		if ke, l, err = e.k.ExceptionLink(e.cfg.ExceptionInterface); err == nil {
			e.kernelMAC = ke.MAC
			err = e.k.SetEgressRedirect(ke.Index)
		}
	}
	if err != nil {
		if n.att != nil {
			e.log.Warn("interface gone; detaching", "interface", n.cfg.Name, "err", err)
			closed = e.detach(n, false)
			changed = true
		}
		n.problem = err.Error()
		return nil, closed, changed
	}
	if n.att != nil && l.Index != n.link.Index {
		e.log.Info("interface created again; attaching to the new one", "interface", n.cfg.Name,
			"oldIndex", n.link.Index, "newIndex", l.Index)
		closed = e.detach(n, false)
		changed = true
	}
	want, problem := wantedQueues(n.cfg.Queues, l.Queues)
	if !n.exception {
		problem = joinProblem(problem, mtuProblem(l.MTU, n.cfg.Socket.FrameSize))
	}
	if n.att == nil {
		att, err := e.k.Attach(l.Index, n.cfg.Mode)
		if err != nil {
			n.problem = fmt.Sprintf("attaching XDP: %v", err)
			e.log.Error("interface not served", "interface", n.cfg.Name, "problem", n.problem)
			return nil, closed, changed
		}
		n.att = att
		e.log.Info("attached", "interface", n.cfg.Name, "ifindex", l.Index, "xdpMode", att.Mode().String(),
			"adopted", att.Adopted())
		changed = true
		if !n.exception && e.cfg.ExceptionInterface != "" {
			if n.egress, err = e.k.AttachEgress(l.Index); err != nil {
				problem = joinProblem(problem, fmt.Sprintf("attaching the egress program: %v", err))
			}
		}
	}
	if !slices.Equal(n.link.Addrs, l.Addrs) || n.link.Index != l.Index {
		changed = true
	}
	n.link = l
	// Queues no longer there (the channel count went down).
	keep := n.ports[:0]
	keepW := n.workers[:0]
	for i, p := range n.ports {
		if slices.Contains(want, p.Queue) {
			keep = append(keep, p)
			keepW = append(keepW, n.workers[i])
			continue
		}
		e.stopPort(n, n.workers[i], p)
		closed = append(closed, p)
		changed = true
	}
	n.ports, n.workers = keep, keepW
	for _, q := range want {
		if slices.ContainsFunc(n.ports, func(p *Port) bool { return p.Queue == q }) {
			continue
		}
		sock, err := e.k.OpenSocket(l.Index, q, n.cfg.Socket)
		if err != nil {
			problem = joinProblem(problem, fmt.Sprintf("queue %d: %v", q, err))
			continue
		}
		p := NewPort(l, q, sock, n.cfg.Socket.FrameSize)
		w := e.newWorker(n, p, len(n.ports))
		n.ports = append(n.ports, p)
		n.workers = append(n.workers, w)
		started = append(started, w)
		changed = true
	}
	slices.SortFunc(n.ports, func(a, b *Port) int { return a.Queue - b.Queue })
	slices.SortFunc(n.workers, func(a, b *Worker) int { return a.port.Queue - b.port.Queue })
	if problem != n.problem {
		if problem != "" {
			e.log.Error("interface not fully served", "interface", n.cfg.Name, "problem", problem)
		} else if n.problem != "" {
			e.log.Info("interface served again", "interface", n.cfg.Name, "queues", l.Queues)
		}
	}
	n.problem = problem
	if changed {
		e.log.Info("serving", "interface", n.cfg.Name, "ifindex", l.Index, "queues", len(n.ports), "of", l.Queues)
	}
	return started, closed, changed
}

// wantedQueues is the queues to serve on an interface with n queues, and
// what is wrong if that leaves some unserved.
func wantedQueues(configured []int, n int) ([]int, string) {
	if configured == nil {
		q := make([]int, n)
		for i := range q {
			q[i] = i
		}
		return q, ""
	}
	var want, missing []int
	var problem string
	for _, q := range configured {
		if q < n {
			want = append(want, q)
		} else {
			problem = joinProblem(problem, fmt.Sprintf("queue %d does not exist (the interface has %d)", q, n))
		}
	}
	for q := range n {
		if !slices.Contains(configured, q) {
			missing = append(missing, q)
		}
	}
	if len(missing) > 0 {
		problem = joinProblem(problem, fmt.Sprintf("queues %v of %d are not served: frames hashed to them would "+
			"never meet xdproxy; list every queue or leave queues out to serve them all", missing, n))
	}
	return want, problem
}

// xdpHeadroom is the room the kernel keeps before a frame it copies into
// a UMEM frame (XDP_PACKET_HEADROOM).
const xdpHeadroom = 256

// mtuProblem says why an interface with this MTU loses frames into UMEM
// frames of frameSize bytes: the kernel cannot place a frame longer than
// a UMEM frame less its headroom and drops it, silently for the sender.
// Empty when the largest frame (Ethernet and a VLAN tag on top of the MTU)
// fits, or the MTU is unknown.
func mtuProblem(mtu, frameSize int) string {
	const ethVLANHeader = 18
	room := frameSize - xdpHeadroom
	if mtu == 0 || mtu+ethVLANHeader <= room {
		return ""
	}
	return fmt.Sprintf("MTU %d: its longest frames (%d bytes) do not fit a %d-byte UMEM frame after the kernel's %d-byte headroom and would be lost; lower the MTU to %d or set frameSize 4096 (MTU up to %d)",
		mtu, mtu+ethVLANHeader, frameSize, xdpHeadroom, room-ethVLANHeader, 4096-xdpHeadroom-ethVLANHeader)
}

func joinProblem(a, b string) string {
	if a == "" {
		return b
	}
	if b == "" {
		return a
	}
	return a + "; " + b
}

// stopPort stops the worker of p and takes its socket out of the XDP
// program. The caller closes p once the egress snapshot lost it.
func (e *Engine) stopPort(n *nic, w *Worker, p *Port) {
	w.Stop()
	if n.att != nil {
		if err := n.att.UnregisterSocket(p.Queue); err != nil {
			e.log.Warn("unregistering socket", "interface", p.Name, "queue", p.Queue, "err", err)
		}
	}
}

// detach stops everything on n and detaches its program (keep: lets go of
// it, attached, for the next process); it returns the ports to close.
func (e *Engine) detach(n *nic, keep bool) []*Port {
	for i, p := range n.ports {
		e.stopPort(n, n.workers[i], p)
	}
	closed := n.ports
	for _, a := range []Attachment{n.att, n.egress} {
		if a == nil {
			continue
		}
		release := a.Detach
		if keep {
			release = a.Close
		}
		if err := release(); err != nil {
			e.log.Warn("detaching", "interface", n.cfg.Name, "err", err)
		}
	}
	n.att, n.egress, n.ports, n.workers, n.link = nil, nil, nil, nil, Link{}
	return closed
}

// newWorker makes the worker for port p, the i-th served queue of n.
func (e *Engine) newWorker(n *nic, p *Port, i int) *Worker {
	e.seq++
	proc := NewProcessor(ProcessorConfig{
		Services: &e.services, Conntrack: e.ct, Affinity: e.aff,
		SNATPorts: e.cfg.SNATPorts, SNATSource: e.snatSource, Seed: e.seedBase + e.seq*0x9e3779b97f4a7c15,
	})
	cpu := -1
	if len(n.cfg.CPUs) > 0 {
		cpu = n.cfg.CPUs[i%len(n.cfg.CPUs)]
	}
	return NewWorker(WorkerConfig{CPU: cpu, BatchSize: e.cfg.BatchSize, BusyPoll: e.cfg.BusyPoll, IOFloor: e.cfg.IOFloor,
		FlowTableRefused: e.reconcileSoon},
		p, &e.egress, proc, e.ct, e.k.Resolver(), e.tables.NewFlowWriter(maxBatch))
}

func (e *Engine) runWorker(w *Worker) {
	go func() {
		if err := w.Run(); err != nil {
			e.log.Error("worker stopped", "interface", w.port.Name, "queue", w.port.Queue, "err", err)
			select {
			case e.errs <- err:
			default:
			}
		}
	}()
}

// publishLinks publishes the egress snapshot and the node addresses of
// the interfaces as they are now.
func (e *Engine) publishLinks() {
	eg := &egress{kernelMAC: e.kernelMAC}
	na := &nodeAddrs{byIfindex: map[int][]packet.Addr{}, byIfindex6: map[int][]packet.Addr{}, all: map[packet.Addr]bool{}}
	for _, n := range e.nics {
		if n.exception {
			if len(n.ports) > 0 {
				eg.kernel = n.ports[0]
			}
			continue
		}
		if len(n.ports) > 0 {
			eg.ifaces = append(eg.ifaces, egressIface{ifindex: n.link.Index, ports: slices.Clone(n.ports)})
		}
		for _, a := range n.link.Addrs {
			na.all[a] = true
			if a.Is4() {
				na.byIfindex[n.link.Index] = append(na.byIfindex[n.link.Index], a)
				na.v4 = append(na.v4, a)
			} else {
				na.byIfindex6[n.link.Index] = append(na.byIfindex6[n.link.Index], a)
				na.v6 = append(na.v6, a)
			}
		}
	}
	e.egress.Store(eg)
	e.addrs.Store(na)
}

// snatSource is the masquerade address for a flow to backend: the
// configured one, else the address of the interface the flow leaves by.
func (e *Engine) snatSource(backend packet.Addr) (packet.Addr, bool) {
	if !backend.Is4() {
		return e.snatSource6(backend)
	}
	h, r := e.k.Resolver().Resolve(backend)
	if r == packet.OK && h.ViaKernel {
		// A backend on this node: its replies must come back to
		// xdproxy, not to the node's own stack.
		return LocalSNATAddress, true
	}
	if !e.cfg.SNATAddress4.IsZero() {
		return e.cfg.SNATAddress4, true
	}
	na := e.addrs.Load()
	if r == packet.OK || r == packet.DropNeighbor {
		if as := na.byIfindex[h.Ifindex]; len(as) > 0 {
			return as[0], true
		}
	}
	if len(na.v4) > 0 {
		return na.v4[0], true
	}
	return packet.Addr{}, false
}

// snatSource6 is snatSource for an IPv6 backend: the IPv6 address of the
// interface the flow leaves by, else any of the node's. A backend on this
// node has none: LocalSNATAddress is IPv4, so such flows find no source
// (drop_no_snat_port).
func (e *Engine) snatSource6(backend packet.Addr) (packet.Addr, bool) {
	h, r := e.k.Resolver().Resolve(backend)
	if r == packet.OK && h.ViaKernel {
		return packet.Addr{}, false
	}
	na := e.addrs.Load()
	if r == packet.OK || r == packet.DropNeighbor {
		if as := na.byIfindex6[h.Ifindex]; len(as) > 0 {
			return as[0], true
		}
	}
	if len(na.v6) > 0 {
		return na.v6[0], true
	}
	return packet.Addr{}, false
}

// NodeAddresses are the addresses of the served interfaces.
func (e *Engine) NodeAddresses() []packet.Addr {
	var out []packet.Addr
	for a := range e.addrs.Load().all {
		out = append(out, a)
	}
	slices.SortFunc(out, func(a, b packet.Addr) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// Services is the table holder the workers read.
func (e *Engine) Services() *service.Current { return &e.services }

// Conntrack is the connection table.
func (e *Engine) Conntrack() *conntrack.Table { return e.ct }

// Workers lists the running workers.
func (e *Engine) Workers() []*Worker {
	e.nicMu.Lock()
	defer e.nicMu.Unlock()
	var out []*Worker
	for _, n := range e.nics {
		out = append(out, n.workers...)
	}
	return out
}

// Errors delivers fatal worker errors.
func (e *Engine) Errors() <-chan error { return e.errs }

// XDPCounters sums the XDP programs' counters.
func (e *Engine) XDPCounters() (xdp.Counters, error) { return e.tables.Counters() }

// LocalClientCounters reads the socket programs' counters; ok is false
// when local clients are not translated at the socket.
func (e *Engine) LocalClientCounters() (c socklb.Counters, ok bool, err error) {
	lc := e.k.LocalClients()
	if lc == nil || e.cfg.LocalClientsCgroup == "" {
		return c, false, nil
	}
	c, err = lc.Counters()
	return c, err == nil, err
}

// InterfaceStatus says how one configured interface is served.
type InterfaceStatus struct {
	Name    string `json:"name"`
	Ifindex int    `json:"ifindex"`
	// Queues is the number of receive queues the interface has now.
	Queues int `json:"queues"`
	// Served lists the queues that have a socket and a worker.
	Served []int  `json:"served"`
	Mode   string `json:"xdpMode,omitempty"`
	// Problem says why the interface is not fully served; empty when it
	// is.
	Problem string `json:"problem,omitempty"`
}

// Interfaces reports every configured interface.
func (e *Engine) Interfaces() []InterfaceStatus {
	e.nicMu.Lock()
	defer e.nicMu.Unlock()
	var out []InterfaceStatus
	for _, n := range e.nics {
		s := InterfaceStatus{Name: n.cfg.Name, Ifindex: n.link.Index, Queues: n.link.Queues, Problem: n.problem}
		if n.att != nil {
			s.Mode = n.att.Mode().String()
		} else if s.Problem == "" {
			s.Problem = "not attached"
		}
		for _, p := range n.ports {
			s.Served = append(s.Served, p.Queue)
		}
		out = append(out, s)
	}
	return out
}

// Healthy returns nil when every configured interface has every queue
// served and the SNAT ports are still out of the node's ephemeral range
// (or reserved), and otherwise says what is wrong.
func (e *Engine) Healthy() error {
	var problems []string
	for _, s := range e.Interfaces() {
		if s.Problem != "" {
			problems = append(problems, s.Name+": "+s.Problem)
		}
	}
	if p := e.snatPortsProblem.Load(); p != nil && *p != "" {
		problems = append(problems, *p)
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// SetChannels changes the number of receive queues of a served interface
// (ethtool -L). The kernel refuses to remove a queue while an AF_XDP socket
// is bound to it, so the engine first lets go of the queues that are going
// away, then asks for the change, then serves what the interface has.
func (e *Engine) SetChannels(name string, queues int) error {
	if queues < 1 {
		return fmt.Errorf("%d queues: want at least 1", queues)
	}
	e.nicMu.Lock()
	defer e.nicMu.Unlock()
	i := slices.IndexFunc(e.nics, func(n *nic) bool { return n.cfg.Name == name })
	if i < 0 {
		return fmt.Errorf("%s is not a served interface", name)
	}
	n := e.nics[i]
	if n.cfg.Queues != nil {
		return fmt.Errorf("%s serves the queues its config lists (%v); leave queues out of the config to follow the channel count", name, n.cfg.Queues)
	}
	var closed []*Port
	keep, keepW := n.ports[:0], n.workers[:0]
	for j, p := range n.ports {
		if p.Queue < queues {
			keep = append(keep, p)
			keepW = append(keepW, n.workers[j])
			continue
		}
		e.stopPort(n, n.workers[j], p)
		closed = append(closed, p)
	}
	n.ports, n.workers = keep, keepW
	e.publishLinks()
	for _, p := range closed {
		p.close()
	}
	err := e.k.SetChannels(name, queues)
	e.reconcileLocked()
	return err
}

// Publish makes t the table workers use and programs the XDP maps for it.
// When programming fails the workers keep the previous table, the error
// says why, and the next Publish programs the maps in full:
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
		sameSlice(old.FrontendKeys(), t.FrontendKeys()) && sameSlice(old.VIPs(), t.VIPs())
	if !unchanged {
		err := e.programXDP(t)
		if err == nil {
			err = e.programLocalClients(t)
		}
		if err != nil {
			// The workers go back to the table the kernel's maps were
			// last fully programmed for; the caller retries, and the
			// next Publish programs the maps in full again.
			e.services.Store(old)
			e.programmed = false
			return err
		}
		e.programmed = true
	}
	// Ask for the endpoints' neighbours now, so that the first packet of a
	// flow does not find its next hop unresolved (a lone UDP datagram
	// would be lost).
	seen := map[packet.Addr]bool{}
	res := e.k.Resolver()
	for _, k := range t.BackendKeys() {
		if !seen[k.Addr] {
			seen[k.Addr] = true
			res.Resolve(k.Addr)
		}
	}
	if old != nil {
		// All the removed endpoints in one scan of the connection table:
		// a scan each (50 ms in a 1 Mi-entry table) made a Publish that
		// removed a thousand hold the lock for a minute.
		var gone map[conntrack.Backend]int
		var order []conntrack.Backend // the log lines follow the table's order
		for _, k := range old.BackendKeys() {
			if k.Proto != packet.ProtoTCP && !t.IsBackend(k.Proto, k.Addr, k.Port) {
				if gone == nil {
					gone = map[conntrack.Backend]int{}
				}
				b := conntrack.Backend{Addr: k.Addr, Port: k.Port, Proto: k.Proto}
				gone[b] = 0
				order = append(order, b)
			}
		}
		if e.ct.DeleteByBackends(gone) > 0 {
			for _, k := range order {
				if n := gone[k]; n > 0 {
					e.log.Info("flows to removed endpoint deleted", "endpoint", fmt.Sprintf("%v:%d", k.Addr, k.Port), "proto", k.Proto.String(), "flows", n)
				}
			}
		}
	}
	return nil
}

// programLocalClients gives the socket programs every TCP and UDP
// frontend with the backends the table gives local-origin traffic (pods and
// the node: traffic policies apply as kube-proxy applies them to them),
// plus 127.0.0.1 for every IPv4 NodePort, as kube-proxy's iptables mode
// allows (unless NoLocalhostNodePorts).
func (e *Engine) programLocalClients(t *service.Table) error {
	if e.cfg.LocalClientsCgroup == "" {
		return nil
	}
	var out []socklb.Frontend
	localhost := map[[2]uint16]bool{}
	add := func(addr packet.Addr, port uint16, fe *service.Frontend) {
		f := socklb.Frontend{Addr: addr, Port: port, Proto: fe.Port.Proto, ServiceID: fe.Port.ID,
			AffinityTimeout: fe.Port.AffinityTimeout}
		switch fe.Verdict(true) {
		case service.Forward:
			for _, b := range fe.Backends(true) {
				f.Backends = append(f.Backends, socklb.Backend{Addr: b.Addr, Port: b.Port})
			}
		case service.Reject:
			f.Reject = true
		}
		out = append(out, f)
	}
	for _, k := range t.FrontendKeys() {
		if k.Proto != packet.ProtoTCP && k.Proto != packet.ProtoUDP {
			continue
		}
		fe := t.Lookup(k.Proto, k.Addr, k.Port)
		if fe == nil {
			continue
		}
		add(k.Addr, k.Port, fe)
		if fe.Kind == service.NodePort && k.Addr.Is4() && !e.cfg.NoLocalhostNodePorts && !localhost[[2]uint16{k.Port, uint16(k.Proto)}] {
			localhost[[2]uint16{k.Port, uint16(k.Proto)}] = true
			add(localhostAddr, k.Port, fe)
		}
	}
	if err := e.k.LocalClients().SetFrontends(out); err != nil {
		return fmt.Errorf("local clients: %w", err)
	}
	return nil
}

var localhostAddr = packet.MustParseAddr("127.0.0.1")

func (e *Engine) programXDP(t *service.Table) error {
	fes := t.FrontendKeys()
	keys := make([]xdp.Key, len(fes))
	for i, k := range fes {
		keys[i] = xdp.Key{Addr: k.Addr, Port: k.Port, Proto: k.Proto}
	}
	// A node address is never a VIP: the node's own traffic to it is the
	// kernel's, fragments included.
	node := e.addrs.Load().all
	var vips []packet.Addr
	for _, a := range t.VIPs() {
		if !node[a] && a != e.cfg.SNATAddress4 && a != LocalSNATAddress {
			vips = append(vips, a)
		}
	}
	return e.tables.SetTables(keys, vips)
}

// Close stops the workers, detaches the programs and closes the sockets
// and the Kernel. The exception link stays for the next run. Close may be
// called more than once.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() { e.closeErr = e.close() })
	return e.closeErr
}

func (e *Engine) close() error {
	e.nicMu.Lock()
	e.closing = true
	var closed []*Port
	for _, n := range e.nics {
		closed = append(closed, e.detach(n, e.cfg.KeepState)...)
	}
	e.nicMu.Unlock()
	if e.stopWatch != nil {
		e.stopWatch()
	}
	close(e.stop)
	e.wg.Wait()
	var errs []error
	for _, p := range closed {
		errs = append(errs, p.close())
	}
	if lc := e.k.LocalClients(); lc != nil && e.cfg.LocalClientsCgroup != "" && !e.cfg.KeepState {
		errs = append(errs, lc.Detach())
	}
	if e.ct != nil {
		errs = append(errs, e.ct.Close())
	}
	if e.aff != nil {
		errs = append(errs, e.aff.Close())
	}
	if e.cfg.StateDir != "" && !e.cfg.KeepState {
		if err := RemoveState(e.cfg.StateDir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, e.k.Close())
	return errors.Join(errs...)
}

// flowGone is conntrack's OnRemove: it runs on whichever goroutine removed
// the flow (a worker's sweep or insert), so it only queues the tuple.
func (e *Engine) flowGone(_, reply packet.Tuple) {
	select {
	case e.gone <- xdp.FlowKey(reply):
	default:
		// More flows end than the janitor keeps up with (a flood being
		// early-dropped): the reconciler deletes what was lost, soon.
		e.goneDropped.Add(1)
		select {
		case e.reconcileNow <- struct{}{}:
		default:
		}
	}
}

// goneQueue bounds the tuples of ended flows waiting for deletion.
const goneQueue = 1 << 16

// deleteGoneFlows deletes the reply tuples of ended flows from the XDP flow
// table, in batches, so that a later connection with the same tuple that is
// not xdproxy's (the node's own, a client talking to a pod directly)
// reaches the kernel. A tuple that a new flow took meanwhile is kept.
func (e *Engine) deleteGoneFlows() {
	const most = 256
	batch := make([]xdp.FlowKey, 0, most)
	for {
		select {
		case <-e.stop:
			return
		case k := <-e.gone:
			batch = append(batch[:0], k)
		}
	more:
		for len(batch) < most {
			select {
			case k := <-e.gone:
				batch = append(batch, k)
			default:
				break more
			}
		}
		now := monotonicNow()
		keep := batch[:0]
		for _, k := range batch {
			if _, _, live := e.ct.Lookup(packet.Tuple(k), now); !live {
				keep = append(keep, k)
			}
		}
		if _, _, err := e.deleteGoneTuples(keep); err != nil {
			e.log.Warn("deleting ended flows from the XDP flow table", "err", err)
		}
	}
}

// deleteGoneTuples deletes reply tuples whose flow the caller found gone
// from the XDP flow map, then writes back those that a new flow took
// meanwhile. A worker may insert a flow with the same reply tuple, and
// write the tuple, between the caller's lookup and the delete: without
// the second look, the delete would leave a live flow without its tuple,
// its replies going to the kernel, until the reconciler's next pass. It
// returns how many it wrote back, and whether the delete happened.
func (e *Engine) deleteGoneTuples(keys []xdp.FlowKey) (back int, deleted bool, err error) {
	if len(keys) == 0 {
		return 0, true, nil
	}
	if err := e.tables.DeleteFlows(keys); err != nil {
		return 0, false, err
	}
	now := monotonicNow()
	var live []xdp.FlowKey
	for _, k := range keys {
		if _, _, ok := e.ct.Lookup(packet.Tuple(k), now); ok {
			live = append(live, k)
		}
	}
	if len(live) == 0 {
		return 0, true, nil
	}
	w := e.tables.NewFlowWriter(len(live))
	for _, k := range live {
		w.Add(k)
	}
	n, err := w.Flush()
	if err != nil {
		err = fmt.Errorf("writing back %d tuples that new flows took: %w", len(live), err)
	}
	return n, true, err
}

// The flow reconciler's pace. A pass reads the whole XDP flow map and
// looks every tuple up in the connection table: most of a second of CPU
// at a million flows. It is a safety net (the workers and the janitor keep
// the map right, and a refused write or a lost deletion asks for a pass at
// once), so its cost is bounded by its own duration rather than run on a
// fixed clock: the next periodic pass comes reconcileDuty times the last
// pass's duration later (at most 1% of a core), never sooner than
// reconcileInterval nor later than reconcileIntervalMax; a pass asked for
// early waits at least a second and ten times the last pass's duration
// (at most 10% of a core under a flood that keeps asking).
const (
	reconcileInterval    = 10 * time.Second
	reconcileIntervalMax = 5 * time.Minute
	reconcileDuty        = 100
	reconcileSoonDuty    = 10
)

// reconcileDelays returns how long after a pass that took took the next
// periodic pass comes, and how long an early one waits at least.
func reconcileDelays(took time.Duration) (periodic, early time.Duration) {
	periodic = min(reconcileIntervalMax, max(reconcileInterval, reconcileDuty*took))
	early = min(periodic, max(time.Second, reconcileSoonDuty*took))
	return periodic, early
}

// reconcileFlows keeps the XDP flow map equal to the connection table's
// live flows: it deletes reply tuples whose flow is gone (expired, evicted,
// deleted), so that a later direct connection with the same tuple reaches
// the kernel, and puts back the tuple of a live flow that is missing (a
// write that failed).
func (e *Engine) reconcileFlows() {
	periodic, early := reconcileDelays(0)
	t := time.NewTimer(periodic)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
		case <-e.reconcileNow:
			// A second at least, so that requests that come together
			// get one pass; and no sooner than early after the last.
			select {
			case <-e.stop:
				return
			case <-time.After(max(time.Second, time.Until(last.Add(early)))):
			}
		}
		// This pass answers any request made so far.
		select {
		case <-e.reconcileNow:
		default:
		}
		start := time.Now()
		removed, restored, err := e.reconcileOnce()
		last = time.Now()
		took := last.Sub(start)
		e.flowPassTook.Store(int64(took))
		if err != nil {
			e.log.Warn("reconciling the XDP flow map", "err", err)
		}
		periodic, early = reconcileDelays(took)
		e.log.Debug("reconciled the XDP flow map", "took", took, "entries", e.flowEntries.Load(),
			"removed", removed, "restored", restored, "next", periodic)
		t.Reset(periodic)
	}
}

// reconcileSoon asks for a pass of the flow reconciler without waiting for
// its tick: a worker whose flow-table write was refused calls it.
func (e *Engine) reconcileSoon() {
	select {
	case e.reconcileNow <- struct{}{}:
	default:
	}
}

// FlowTableStats describes the XDP flow map, the reply tuples the program
// claims, as the flow reconciler's passes found it: the map's pressure.
type FlowTableStats struct {
	// Entries is the number of tuples the map held after the last pass.
	Entries int
	// LastPass is how long the last pass took; passes come every 10 s,
	// or every 100 times this when that is longer (at most 5 min).
	LastPass time.Duration
	// Removed counts tuples the passes deleted because their flow was
	// gone; Restored, tuples of live flows they wrote back (a write was
	// refused or lost).
	Removed, Restored uint64
	// LostDeletions counts ended flows whose deletion did not fit the
	// janitor's queue (a pass removes them later).
	LostDeletions uint64
}

// FlowTableStats returns the flow map's pressure (see FlowTableStats).
func (e *Engine) FlowTableStats() FlowTableStats {
	return FlowTableStats{Entries: int(e.flowEntries.Load()), LastPass: time.Duration(e.flowPassTook.Load()),
		Removed:  e.flowRemoved.Load(),
		Restored: e.flowRestored.Load(), LostDeletions: e.goneDropped.Load()}
}

// reconcileOnce makes one pass and returns how many tuples it removed and
// how many it put back.
func (e *Engine) reconcileOnce() (removed, restored int, err error) {
	e.reconcileMu.Lock()
	defer e.reconcileMu.Unlock()
	inMap := &e.inFlowMap
	inMap.reset()
	defer func() {
		e.flowRemoved.Add(uint64(removed))
		e.flowRestored.Add(uint64(restored))
		if err == nil {
			e.flowEntries.Store(int64(inMap.len() - removed + restored))
		}
	}()
	now := monotonicNow()
	var stale []xdp.FlowKey
	err = e.tables.ForEachFlow(func(k xdp.FlowKey) bool {
		inMap.add(&k)
		if _, _, ok := e.ct.Lookup(packet.Tuple(k), now); !ok {
			stale = append(stale, k)
		}
		return true
	})
	if err != nil {
		return 0, 0, err
	}
	// The pass read the whole map before this delete: a new flow may
	// have taken one of these tuples since (deleteGoneTuples); those
	// are written back, so not removed in the end.
	back, deleted, err := e.deleteGoneTuples(stale)
	if deleted {
		removed = len(stale) - back
	}
	if err != nil {
		return removed, 0, err
	}
	w := e.tables.NewFlowWriter(256)
	for f := range e.ct.All(now) {
		k := xdp.FlowKey(f.Reply())
		if inMap.has(&k) {
			continue
		}
		if !w.Add(k) {
			n, err := w.Flush()
			restored += n
			if err != nil {
				return removed, restored, err
			}
			w.Add(k)
		}
	}
	n, err := w.Flush()
	restored += n
	return removed, restored, err
}

// sameSlice reports whether a and b are the same slice (not merely equal).
func sameSlice[T any](a, b []T) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}
