package dataplane

import (
	"fmt"
	"net"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/cpu"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// NextHop is where a frame leaves: the egress interface and the Ethernet
// addresses to write, or the kernel's stack.
type NextHop struct {
	Ifindex int
	Src     [6]byte
	Dst     [6]byte
	// ViaKernel says the destination is routed through an interface
	// xdproxy does not serve (a local pod's veth): the frame is handed to
	// the kernel's stack through the exception link, and the kernel
	// delivers it.
	ViaKernel bool
}

// Resolver finds the next hop of a destination. Resolve is called per
// forwarded frame and must not block, lock or allocate; a destination whose
// neighbour is unknown returns packet.DropNeighbor after triggering
// resolution (the worker then sends the frame through the kernel, which
// holds it until the neighbour answers), one without a route
// packet.DropNoRoute. Generation changes whenever an answer of Resolve
// may change (routes, links, neighbours): workers cache answers until it
// does (hopCache).
type Resolver interface {
	Resolve(dst packet.Addr) (NextHop, packet.Reason)
	Generation() uint64
}

// WorkerConfig configures one worker.
type WorkerConfig struct {
	// CPU pins the worker's OS thread; -1 leaves it unpinned.
	CPU       int
	BatchSize int
	// BusyPoll makes the worker spin while its queue has traffic: on an
	// empty ring it keeps checking (driving the queue when its socket
	// busy polls) instead of sleeping in poll() after an adaptive spin
	// (see idle.go). Only after IdleWait without a frame does it sleep in
	// poll() until frames come, so that a quiet queue (an interface that
	// carries nothing, the exception link) does not take the CPU from the
	// workers beside it. It costs a CPU per worker with traffic.
	BusyPoll bool
	// MaxSpin is the longest the adaptive idle spin lasts before the
	// worker sleeps in poll(); 0 means 50µs, negative no spin at all.
	MaxSpin time.Duration
	// IdleWait bounds one poll() sleep so that housekeeping (conntrack
	// sweeps) still runs on an idle queue; default 200 ms. Each sleep
	// that ends with nothing to do doubles the next one, up to
	// IdleWaitMax (default 2 s): a node with no traffic wakes each worker
	// twice a second at most (every poll() wake-up also costs the Go
	// runtime's monitor thread a burst of short sleeps). Stop interrupts
	// the sleep.
	IdleWait    time.Duration
	IdleWaitMax time.Duration
	// IOFloor, when set, makes the worker forward every frame untouched
	// but for its MACs: a benchmarking mode (see IOFloor).
	IOFloor *IOFloor
	// FlowTableRefused, when set, is called (off the per-packet path)
	// after the XDP flow table refused reply tuples: the engine then
	// reconciles the table at once instead of at its next tick.
	FlowTableRefused func()
}

// Worker forwards the frames of one Port. Run must be called once, on its
// own goroutine; the worker locks that goroutine to an OS thread pinned to
// WorkerConfig.CPU.
type Worker struct {
	cfg      WorkerConfig
	port     *Port
	proc     *Processor
	resolver Resolver
	hops     hopCache
	flows    FlowWriter
	// added counts the proc's NewReplies of this batch already given to
	// flows.
	added  int
	ct     *conntrack.Table
	egress *atomic.Pointer[egress]

	Counters Counters
	tid      atomic.Int32
	// alive is the monotonic time of the loop's last turn, for /livez.
	alive atomic.Int64
	stop  atomic.Bool
	done  chan struct{}

	// idleWait is the next poll() sleep's bound (IdleWait to IdleWaitMax).
	idleWait time.Duration
	// lastRx is when a BusyPoll worker last received frames: it spins
	// until its queue has been quiet for IdleWait.
	lastRx int64

	rx      []afxdp.Desc
	ownTx   []afxdp.Desc
	release []afxdp.Desc
	unsent  []conntrack.Handle // flows whose reply tuple the XDP table refused

	// Where this worker's frames go, worked out from the egress
	// snapshot eg when it changes: route[i] is for eg.ifaces[i].
	eg         *egress
	route      []egressSlot
	crossPorts []*Port        // ports other than its own it transmits into
	cross      [][]afxdp.Desc // frames pending for crossPorts[i]
	kernel     int            // index into crossPorts of the exception port, -1 none
	kernelMAC  [6]byte        // destination MAC of frames for the kernel
	batch      batchCounters
	spin       idleSpin
}

// egressSlot says where frames routed out of one interface go: -1 for
// this worker's own port, else an index into crossPorts.
type egressSlot struct {
	ifindex int
	cross   int
}

// NewWorker builds a worker for port. egress is the engine's snapshot of
// every port it may transmit into.
func NewWorker(cfg WorkerConfig, port *Port, eg *atomic.Pointer[egress], proc *Processor, ct *conntrack.Table,
	resolver Resolver, flows FlowWriter) *Worker {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 64
	}
	cfg.BatchSize = min(cfg.BatchSize, maxBatch)
	if cfg.IdleWait <= 0 {
		cfg.IdleWait = 200 * time.Millisecond
	}
	if cfg.IdleWaitMax < cfg.IdleWait {
		cfg.IdleWaitMax = max(cfg.IdleWait, 2*time.Second)
	}
	w := &Worker{
		cfg: cfg, port: port, proc: proc, ct: ct, resolver: resolver, flows: flows, egress: eg,
		done:    make(chan struct{}),
		rx:      make([]afxdp.Desc, cfg.BatchSize),
		ownTx:   make([]afxdp.Desc, 0, cfg.BatchSize),
		release: make([]afxdp.Desc, 0, cfg.BatchSize),
		unsent:  make([]conntrack.Handle, 0, cfg.BatchSize),
		kernel:  -1,
		spin:    newIdleSpin(cfg.MaxSpin),
	}
	// A worker that never gets to its first turn is as stuck as one that
	// stops going round: its clock starts now.
	w.alive.Store(monotonicNow())
	return w
}

// TID is the OS thread the worker runs on, 0 before Run started.
func (w *Worker) TID() int { return int(w.tid.Load()) }

// Port is the port this worker receives on.
func (w *Worker) Port() *Port { return w.port }

// CPU is the CPU the worker is pinned to, -1 for none.
func (w *Worker) CPU() int { return w.cfg.CPU }

// Alive is the monotonic time (MonotonicNow) at which the worker's loop
// last went round, or when it was made if it has not gone round yet.
func (w *Worker) Alive() int64 { return w.alive.Load() }

// Stop asks Run to return after its current batch and waits until it has.
// A worker asleep in poll() is woken with SIGURG, the signal the Go
// runtime itself sends threads to preempt them (poll(2) returns EINTR and
// the runtime ignores a SIGURG it did not ask for).
func (w *Worker) Stop() {
	w.stop.Store(true)
	for {
		if tid := w.tid.Load(); tid != 0 {
			_ = unix.Tgkill(unix.Getpid(), int(tid), unix.SIGURG)
		}
		select {
		case <-w.done:
			return
		case <-time.After(50 * time.Millisecond):
			// It was not asleep yet: wake it again.
		}
	}
}

// Run is the worker loop: receive a batch, process it, transmit, reclaim
// completions and keep the fill ring full; when the ring is empty, spin a
// while and then sleep in poll() (see idle.go).
func (w *Worker) Run() error {
	defer close(w.done)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	w.tid.Store(int32(unix.Gettid()))
	if w.cfg.CPU >= 0 {
		var set unix.CPUSet
		set.Set(w.cfg.CPU)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return fmt.Errorf("pinning worker for %s queue %d to CPU %d: %w", w.port.Name, w.port.Queue, w.cfg.CPU, err)
		}
	}
	sock := w.port.Sock
	w.port.mu.Lock()
	sock.Refill()
	w.port.mu.Unlock()
	for !w.stop.Load() {
		w.alive.Store(monotonicNow())
		n := sock.Receive(w.rx)
		if n == 0 {
			w.idle()
			continue
		}
		w.idleWait = w.cfg.IdleWait
		if w.cfg.BusyPoll {
			w.lastRx = monotonicNow()
		}
		w.processBatch(w.rx[:n])
	}
	return nil
}

// idle runs when the receive ring is empty: reclaim completions, refill,
// sweep a little, then spin until frames come or the adaptive limit
// passes (BusyPoll: IdleWait), and then sleep in poll().
func (w *Worker) idle() {
	sock := w.port.Sock
	w.port.mu.Lock()
	sock.Complete()
	sock.Refill()
	w.port.mu.Unlock()
	start := monotonicNow()
	if !w.cfg.IOFloor.enabled() {
		w.proc.HousekeepIdleFor(start, max(w.idleWait, w.cfg.IdleWait))
	}
	// Spin: check the ring (driving the queue when the socket busy
	// polls), relax, look at the clock now and then.
	for i := 0; ; i++ {
		if sock.Drive() {
			w.Counters.SpinCatches.Add(1)
			w.spin.caught(monotonicNow() - start)
			return
		}
		cpu.Relax()
		if i&3 == 3 {
			if w.stop.Load() {
				return
			}
			spun := monotonicNow() - start
			limit := w.spin.limit
			if w.cfg.BusyPoll {
				// Spin until the queue has been quiet for IdleWait.
				limit = w.lastRx + int64(w.cfg.IdleWait) - start
			}
			if spun >= limit {
				break
			}
		}
	}
	if w.idleWait == 0 {
		w.idleWait = w.cfg.IdleWait
	}
	if ok, _ := sock.Wait(w.idleWait); ok {
		w.Counters.Wakeups.Add(1)
		w.spin.woke(monotonicNow() - start)
		w.idleWait = w.cfg.IdleWait
	} else {
		w.spin.quiet()
		w.idleWait = min(2*w.idleWait, w.cfg.IdleWaitMax)
	}
}

// useEgress works out where frames go under a new egress snapshot. It
// allocates, but only when the engine published a new snapshot (an
// interface came, went or changed its queues).
func (w *Worker) useEgress(eg *egress) {
	w.eg = eg
	w.route = w.route[:0]
	w.crossPorts = w.crossPorts[:0]
	w.kernel = -1
	cross := func(p *Port) int {
		for i, q := range w.crossPorts {
			if q == p {
				return i
			}
		}
		w.crossPorts = append(w.crossPorts, p)
		return len(w.crossPorts) - 1
	}
	if eg != nil {
		for _, in := range eg.ifaces {
			s := egressSlot{ifindex: in.ifindex, cross: -1}
			if in.ifindex != w.port.Ifindex {
				// Spread the transmit load of several workers over
				// the egress interface's queues.
				s.cross = cross(in.ports[w.port.Queue%len(in.ports)])
			}
			w.route = append(w.route, s)
		}
		if eg.kernel != nil {
			w.kernel = cross(eg.kernel)
			copy(w.kernelMAC[:], eg.kernelMAC)
		}
	}
	for len(w.cross) < len(w.crossPorts) {
		w.cross = append(w.cross, make([]afxdp.Desc, 0, w.cfg.BatchSize))
	}
}

func (w *Worker) processBatch(descs []afxdp.Desc) {
	if eg := w.egress.Load(); eg != w.eg {
		w.useEgress(eg)
	}
	if w.cfg.IOFloor.enabled() {
		w.floorBatch(descs)
		return
	}
	now := monotonicNow()
	w.proc.BeginBatch(now)
	w.hops.begin(w.resolver.Generation())
	sock := w.port.Sock
	b := &w.batch
	b.rx += uint64(len(descs))
	// Two passes (fastpath.go): the first reads every frame's tuple and
	// prefetches its flow, so that the batch's cache misses overlap; the
	// second translates.
	w.prepareBatch(descs)
	p := w.proc
	for i, d := range descs {
		// Frame again rather than keep the slices: storing a pointer
		// per frame in the heap costs a write barrier whenever the
		// garbage collector runs.
		frame := sock.Frame(d)
		v := p.process(frame, now, &p.pre[i])
		if len(p.NewReplies) > w.added {
			// Buffered at once, so that the writer's look-ahead for
			// where the tuple goes overlaps the batch's other frames.
			w.flows.Add(xdp.FlowKey(p.NewReplies[w.added]))
			w.added++
		}
		switch v.Action {
		case Forward, Reply:
			hop, r := w.hops.resolve(w.resolver, &p.nextHop)
			if r != packet.OK {
				if r != packet.DropNeighbor || w.kernel < 0 {
					b.byReason[r]++
					w.release = append(w.release, d)
					continue
				}
				// The kernel holds a frame while it resolves the
				// neighbour, as it does its own; dropping it would
				// lose a flow's first datagram, or a SYN for a second.
				hop = &viaKernelHop
				b.unresolved++
			}
			d.Len = uint32(v.Len)
			if v.Action == Forward {
				b.forwarded++
			} else {
				b.replied++
			}
			if hop.ViaKernel {
				b.viaKernel++
				w.toKernel(d, frame, packet.OK)
				continue
			}
			copy(frame[0:6], hop.Dst[:])
			copy(frame[6:12], hop.Src[:])
			w.toInterface(d, hop.Ifindex)
		case Pass:
			if v.Reason == packet.PassNoService {
				w.proc.CompletePartial(frame)
			}
			w.toKernel(d, frame, v.Reason)
		default:
			b.byReason[v.Reason]++
			w.release = append(w.release, d)
		}
	}
	p.forgetPredictions(len(descs))
	w.publishFlows()
	w.flushCross()
	w.flushOwn()
	w.proc.Housekeep(now)
	b.newFlows += w.proc.NewFlows
	b.cacheHits += w.proc.CacheHits
	b.cacheMisses += w.proc.CacheMisses
	w.proc.NewFlows, w.proc.CacheHits, w.proc.CacheMisses = 0, 0, 0
	w.Counters.add(b)
}

// prepareBatch is the first pass over a batch (fastpath.go): each step
// runs over every frame before the next starts.
func (w *Worker) prepareBatch(descs []afxdp.Desc) {
	p, sock := w.proc, w.port.Sock
	for i, d := range descs {
		p.prepare(i, sock.Frame(d))
	}
	p.prefetchFirst(len(descs))
	if !p.prefetchLookups(len(descs)) {
		return
	}
	p.lookService(len(descs))
	p.locateFrontend(len(descs))
	p.prefetchSelect(len(descs))
	for i := range descs {
		if p.pre[i].fresh {
			p.predictNewFlow(i)
		}
	}
	p.prefetchInserts(len(descs))
}

// viaKernelHop sends a translated frame through the kernel's stack.
var viaKernelHop = NextHop{ViaKernel: true}

// toInterface queues a frame for the port that transmits on ifindex.
func (w *Worker) toInterface(d afxdp.Desc, ifindex int) {
	for _, s := range w.route {
		if s.ifindex != ifindex {
			continue
		}
		if s.cross < 0 {
			w.ownTx = append(w.ownTx, d)
		} else {
			w.cross[s.cross] = append(w.cross[s.cross], d)
		}
		return
	}
	// Routed out of an interface xdproxy has no socket on any more.
	w.batch.byReason[packet.DropNoRoute]++
	w.release = append(w.release, d)
}

// toKernel hands a frame to the kernel's stack through the exception
// link: it arrives there as if the NIC had received it. Frames that are
// not ours after all keep their reason (pass_*), counted; translated
// frames for a destination behind an interface xdproxy does not serve go
// the same way with reason OK.
func (w *Worker) toKernel(d afxdp.Desc, frame []byte, r packet.Reason) {
	if r != packet.OK {
		w.batch.byReason[r]++
	}
	if w.kernel < 0 || (r != packet.OK && w.crossPorts[w.kernel] == w.port) {
		// No way to the kernel; or a frame that came from the kernel
		// and is not ours: handing it back would loop.
		if w.kernel < 0 {
			w.batch.byReason[packet.DropNoKernelPath]++
		}
		w.release = append(w.release, d)
		return
	}
	copy(frame[0:6], w.kernelMAC[:])
	w.batch.toKernel++
	w.cross[w.kernel] = append(w.cross[w.kernel], d)
}

// publishFlows registers the batch's new reply tuples with the XDP program
// before any of the batch's frames leave, so that no reply can arrive
// before the program knows it. A flow whose tuple the table refused (it is
// full) is taken out of conntrack again: its replies would reach the
// kernel, so the connection could not work, and the client's next attempt
// starts afresh.
func (w *Worker) publishFlows() {
	p := w.proc
	if len(p.NewReplies) == 0 {
		return
	}
	for _, t := range p.NewReplies[w.added:] {
		w.flows.Add(xdp.FlowKey(t))
	}
	w.added = 0
	n, err := w.flows.Flush()
	if err != nil {
		w.Counters.FlowPublishErrors.Add(1)
		for _, h := range p.NewHandles[n:] {
			w.ct.Delete(h)
			w.batch.byReason[packet.DropFlowTableFull]++
		}
		if w.cfg.FlowTableRefused != nil {
			w.cfg.FlowTableRefused()
		}
	}
	p.NewReplies = p.NewReplies[:0]
	p.NewHandles = p.NewHandles[:0]
}

// flushCross copies frames bound for other ports into those ports' UMEMs
// and transmits them, one lock per egress port.
func (w *Worker) flushCross() {
	src := w.port.Sock
	for i, pending := range w.cross {
		if len(pending) == 0 {
			continue
		}
		eg := w.crossPorts[i]
		eg.mu.Lock()
		if eg.closed {
			eg.mu.Unlock()
			w.release = append(w.release, pending...)
			w.batch.byReason[packet.DropNoRoute] += uint64(len(pending))
			w.cross[i] = pending[:0]
			continue
		}
		es := eg.Sock
		es.Complete()
		// Every source frame goes back to this worker's port once its
		// bytes are copied (or it is dropped).
		w.release = append(w.release, pending...)
		sent, tooBig := 0, 0
		for _, d := range pending {
			if int(d.Len) > eg.FrameSize {
				tooBig++
				continue
			}
			nd, ok := es.Alloc()
			if !ok {
				break
			}
			copy(es.Frame(afxdp.Desc{Addr: nd.Addr, Len: d.Len}), src.Frame(d))
			nd.Len = d.Len
			pending[sent] = nd // reuse the slot, already read, for the egress frame
			sent++
		}
		n := es.Transmit(pending[:sent])
		for _, d := range pending[n:sent] {
			es.Release(d)
		}
		eg.mu.Unlock()
		w.batch.copied += uint64(sent)
		w.batch.tx += uint64(n)
		w.batch.byReason[packet.DropTooBig] += uint64(tooBig)
		if lost := uint64(len(pending) - tooBig - n); lost > 0 {
			w.batch.byReason[packet.DropTxFull] += lost
		}
		w.cross[i] = pending[:0]
	}
}

// flushOwn transmits frames that leave through this worker's own port and
// returns dropped and copied frames to its free stack.
func (w *Worker) flushOwn() {
	s := w.port.Sock
	w.port.mu.Lock()
	s.Complete()
	if len(w.ownTx) > 0 {
		n := s.Transmit(w.ownTx)
		w.batch.tx += uint64(n)
		for _, d := range w.ownTx[n:] {
			s.Release(d)
		}
		w.batch.byReason[packet.DropTxFull] += uint64(len(w.ownTx) - n)
	}
	for _, d := range w.release {
		s.Release(d)
	}
	s.Refill()
	w.port.mu.Unlock()
	w.ownTx = w.ownTx[:0]
	w.release = w.release[:0]
}

// monotonicNow is nanoseconds of CLOCK_MONOTONIC, through the vDSO: the
// clock every generation of xdproxy on the node agrees on, so connection
// deadlines in a state file stay valid across a restart.
func monotonicNow() int64 { return conntrack.MonotonicNow() }

// MonotonicNow is the clock workers pass to Process and conntrack, for
// callers outside the dataplane (the admin dump).
func MonotonicNow() int64 { return monotonicNow() }

// macOf copies a hardware address into the form frames carry.
func macOf(m net.HardwareAddr) (out [6]byte) {
	copy(out[:], m)
	return out
}
