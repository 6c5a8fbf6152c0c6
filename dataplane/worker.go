package dataplane

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// NextHop is where a frame leaves: the egress interface and the Ethernet
// addresses to write.
type NextHop struct {
	Ifindex int
	Src     [6]byte
	Dst     [6]byte
}

// Resolver finds the next hop of a destination. Resolve is called per
// forwarded frame and must not block, lock or allocate; a destination whose
// neighbour is unknown returns packet.DropNeighbor after triggering
// resolution, one without a route packet.DropNoRoute.
type Resolver interface {
	Resolve(dst packet.Addr) (NextHop, packet.Reason)
}

// FlowPublisher tells the XDP program which replies are xdproxy's. Add
// buffers a reply tuple; Flush makes the buffered tuples visible to the
// program (one system call). A worker owns its FlowPublisher.
type FlowPublisher interface {
	Add(reply packet.Tuple) bool
	Flush() error
}

// WorkerConfig configures one worker.
type WorkerConfig struct {
	// CPU pins the worker's OS thread; -1 leaves it unpinned.
	CPU       int
	BatchSize int
	// BusyPoll spins on empty rings instead of sleeping in poll().
	BusyPoll bool
	// IdleWait bounds one poll() sleep so that housekeeping (conntrack
	// sweeps, stop requests) still runs on an idle queue.
	IdleWait time.Duration
}

// Worker forwards the frames of one Port. Run must be called once, on its
// own goroutine; the worker locks that goroutine to an OS thread pinned to
// WorkerConfig.CPU.
type Worker struct {
	cfg      WorkerConfig
	port     *Port
	proc     *Processor
	resolver Resolver
	flows    FlowPublisher
	// egress[ifindex] is the port this worker transmits on for that
	// interface; nil where xdproxy has no socket.
	egress []*Port

	Counters Counters
	tid      atomic.Int32
	stop     atomic.Bool
	done     chan struct{}

	rx       []afxdp.Desc
	ownTx    []afxdp.Desc
	release  []afxdp.Desc
	cross    [][]afxdp.Desc // pending frames per egress slot (by index in crossPorts)
	crossIdx []int          // egress ifindex -> index in crossPorts, -1 when none
	ports    []*Port        // crossPorts: other ports this worker forwards into
	batch    batchCounters
}

// NewWorker builds a worker for port. ports lists every port of this
// xdproxy; for each interface the worker transmits on the port whose queue
// matches its own (modulo the interface's queue count), so that several
// workers spread their transmit load over the egress interface's queues.
func NewWorker(cfg WorkerConfig, port *Port, ports []*Port, proc *Processor, resolver Resolver, flows FlowPublisher) *Worker {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 64
	}
	cfg.BatchSize = min(cfg.BatchSize, maxBatch)
	if cfg.IdleWait <= 0 {
		cfg.IdleWait = 200 * time.Millisecond
	}
	w := &Worker{cfg: cfg, port: port, proc: proc, resolver: resolver, flows: flows, done: make(chan struct{})}
	byIf := map[int][]*Port{}
	maxIf := 0
	for _, p := range ports {
		byIf[p.Ifindex] = append(byIf[p.Ifindex], p)
		maxIf = max(maxIf, p.Ifindex)
	}
	w.egress = make([]*Port, maxIf+1)
	w.crossIdx = make([]int, maxIf+1)
	for i := range w.crossIdx {
		w.crossIdx[i] = -1
	}
	for ifindex, ps := range byIf {
		eg := ps[port.Queue%len(ps)]
		if ifindex == port.Ifindex {
			eg = port
		}
		w.egress[ifindex] = eg
		if eg != port {
			w.crossIdx[ifindex] = len(w.ports)
			w.ports = append(w.ports, eg)
			w.cross = append(w.cross, make([]afxdp.Desc, 0, cfg.BatchSize))
		}
	}
	w.rx = make([]afxdp.Desc, cfg.BatchSize)
	w.ownTx = make([]afxdp.Desc, 0, cfg.BatchSize)
	w.release = make([]afxdp.Desc, 0, cfg.BatchSize)
	return w
}

// TID is the OS thread the worker runs on, 0 before Run started.
func (w *Worker) TID() int { return int(w.tid.Load()) }

// Port is the port this worker receives on.
func (w *Worker) Port() *Port { return w.port }

// CPU is the CPU the worker is pinned to, -1 for none.
func (w *Worker) CPU() int { return w.cfg.CPU }

// Stop asks Run to return after its current batch and waits until it has.
func (w *Worker) Stop() {
	w.stop.Store(true)
	<-w.done
}

// Run is the worker loop: receive a batch, process it, transmit, reclaim
// completions and keep the fill ring full; sleep in poll() when idle.
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
		n := sock.Receive(w.rx)
		if n == 0 {
			w.idle()
			continue
		}
		w.processBatch(w.rx[:n])
	}
	return nil
}

// idle reclaims completions, refills and sleeps until frames arrive.
func (w *Worker) idle() {
	w.port.mu.Lock()
	w.port.Sock.Complete()
	w.port.Sock.Refill()
	w.port.mu.Unlock()
	w.proc.Housekeep(monotonicNow())
	if w.cfg.BusyPoll {
		return
	}
	if ok, _ := w.port.Sock.Wait(w.cfg.IdleWait); ok {
		w.Counters.Wakeups.Add(1)
	}
}

func (w *Worker) processBatch(descs []afxdp.Desc) {
	now := monotonicNow()
	w.proc.BeginBatch(now)
	sock := w.port.Sock
	b := &w.batch
	b.rx += uint64(len(descs))
	for _, d := range descs {
		frame := sock.Frame(d)
		v := w.proc.Process(frame, now)
		switch v.Action {
		case Forward, Reply:
			hop, r := w.resolver.Resolve(v.NextHop)
			if r != packet.OK {
				b.byReason[r]++
				w.release = append(w.release, d)
				continue
			}
			copy(frame[0:6], hop.Dst[:])
			copy(frame[6:12], hop.Src[:])
			d.Len = uint32(v.Len)
			if v.Action == Forward {
				b.forwarded++
			} else {
				b.replied++
			}
			if hop.Ifindex == w.port.Ifindex {
				w.ownTx = append(w.ownTx, d)
				continue
			}
			if hop.Ifindex >= len(w.crossIdx) || w.crossIdx[hop.Ifindex] < 0 {
				// Routed out of an interface xdproxy has no socket on.
				b.byReason[packet.DropNoRoute]++
				w.release = append(w.release, d)
				continue
			}
			i := w.crossIdx[hop.Ifindex]
			w.cross[i] = append(w.cross[i], d)
		default:
			b.byReason[v.Reason]++
			w.release = append(w.release, d)
		}
	}
	w.publishFlows()
	w.flushCross()
	w.flushOwn()
	w.proc.Housekeep(now)
	b.newFlows += w.proc.NewFlows
	w.proc.NewFlows = 0
	w.Counters.add(b)
}

// publishFlows registers the batch's new reply tuples with the XDP program
// before any of the batch's frames leave, so that no reply can arrive
// before the program knows it.
func (w *Worker) publishFlows() {
	p := w.proc
	if len(p.NewReplies) == 0 {
		return
	}
	if w.flows != nil {
		for _, t := range p.NewReplies {
			w.flows.Add(t)
		}
		if err := w.flows.Flush(); err != nil {
			w.Counters.FlowPublishErrors.Add(1)
		}
	}
	p.NewReplies = p.NewReplies[:0]
}

// flushCross copies frames bound for other interfaces into those ports'
// UMEMs and transmits them, one lock per egress port.
func (w *Worker) flushCross() {
	src := w.port.Sock
	for i, pending := range w.cross {
		if len(pending) == 0 {
			continue
		}
		eg := w.ports[i]
		eg.mu.Lock()
		es := eg.Sock
		es.Complete()
		sent := 0
		for j, d := range pending {
			nd, ok := es.Alloc()
			if !ok {
				break
			}
			buf := es.Frame(afxdp.Desc{Addr: nd.Addr, Len: d.Len})
			copy(buf, src.Frame(d))
			nd.Len = d.Len
			pending[j] = nd // reuse the slot for the egress frame
			w.release = append(w.release, d)
			sent++
		}
		dropped := pending[sent:]
		for _, d := range dropped {
			w.release = append(w.release, d)
		}
		n := es.Transmit(pending[:sent])
		for _, d := range pending[n:sent] {
			es.Release(d)
		}
		eg.mu.Unlock()
		w.batch.copied += uint64(sent)
		w.batch.tx += uint64(n)
		if lost := uint64(len(pending) - n); lost > 0 {
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

var clockStart = time.Now()

// monotonicNow is nanoseconds on the monotonic clock (vDSO, no syscall).
func monotonicNow() int64 { return int64(time.Since(clockStart)) }

// MonotonicNow is the clock workers pass to Process and conntrack, for
// callers outside the dataplane (the admin dump).
func MonotonicNow() int64 { return monotonicNow() }
