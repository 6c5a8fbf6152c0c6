package dataplane

import (
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
)

// The benchmarks in this file run the whole worker loop, not only
// Process: receive a batch from the socket, process every frame, resolve
// its next hop, queue it for transmit, publish new flows, transmit,
// complete, release and refill, count, sweep conntrack. The socket is
// benchSocket (rings in memory, nothing allocated), the resolver answers
// every destination with the same next hop, and the flow writer only
// counts. What they leave out is the kernel: the syscalls of a real socket
// (none per batch on the receive side with need-wakeup, one sendto per
// batch in copy mode) and the copy of each frame, which feed does instead,
// on the benchmark's own CPU (BenchmarkWorkerFeed measures that part).

// benchBatch is the batch size of the benchmarks, the engine's default.
const benchBatch = 64

// packetMeter reports a benchmark's cost per packet twice: ns/pkt is wall
// time, cpu-ns/pkt the CPU time of the benchmark's thread, which does not
// count the time other tenants of a shared machine run instead of it.
type packetMeter struct {
	pkts      int
	wall, cpu time.Duration
	wall0     time.Time
	cpu0      time.Duration
}

func threadCPU() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}

// start locks the goroutine to its thread (so that the thread's CPU time
// is the benchmark's) and starts the clocks. It first collects the
// garbage of the set-up (conntrack tables of hundreds of megabytes), so
// that no collection cycle it triggered runs beside the timed loop,
// which allocates nothing.
func (m *packetMeter) start() {
	runtime.GC()
	runtime.LockOSThread()
	m.wall0, m.cpu0 = time.Now(), threadCPU()
}

// pause and resume bracket untimed work, like b.StopTimer/StartTimer.
func (m *packetMeter) pause() {
	m.wall += time.Since(m.wall0)
	m.cpu += threadCPU() - m.cpu0
}

func (m *packetMeter) resume() { m.wall0, m.cpu0 = time.Now(), threadCPU() }

// resumeAfterGC is resume after set-up that allocated (see start).
func (m *packetMeter) resumeAfterGC() {
	runtime.GC()
	m.resume()
}

func (m *packetMeter) report(b *testing.B) {
	m.pause()
	runtime.UnlockOSThread()
	if m.pkts > 0 {
		b.ReportMetric(float64(m.wall.Nanoseconds())/float64(m.pkts), "ns/pkt")
		b.ReportMetric(float64(m.cpu.Nanoseconds())/float64(m.pkts), "cpu-ns/pkt")
	}
}

// benchWorld is one worker on a benchSocket, with its own conntrack table.
type benchWorld struct {
	sock     *benchSocket
	w        *Worker
	ct       *conntrack.Table
	tmpl     []byte
	services int
}

var benchTables sync.Map // services -> *service.Table; compiling 100,000 services takes seconds

func benchTable(services int) *service.Table {
	if t, ok := benchTables.Load(services); ok {
		return t.(*service.Table)
	}
	t := service.Compile(benchModel(services), service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	benchTables.Store(services, t)
	return t
}

// benchResolver sends everything out of the worker's own interface.
type benchResolver struct{}

func (benchResolver) Generation() uint64 { return 1 }

func (benchResolver) Resolve(packet.Addr) (NextHop, packet.Reason) {
	return NextHop{Ifindex: 1, Src: [6]byte{2, 0, 0, 0, 1, 1}, Dst: [6]byte{2, 0, 0, 0, 2, 2}}, packet.OK
}

// benchFlowWriter takes every reply tuple and writes nowhere.
type benchFlowWriter struct{ n int }

func (f *benchFlowWriter) Add(xdp.FlowKey) bool { f.n++; return true }
func (f *benchFlowWriter) Flush() (int, error) {
	n := f.n
	f.n = 0
	return n, nil
}

func newBenchWorld(tb testing.TB, services, capacity int) *benchWorld {
	tb.Helper()
	ct, err := conntrack.New(conntrack.Config{Capacity: capacity})
	if err != nil {
		tb.Fatal(err)
	}
	cur := &service.Current{}
	cur.Store(benchTable(services))
	proc := NewProcessor(ProcessorConfig{Services: cur, Conntrack: ct, SNATPorts: conntrack.PortRange{First: 1024, Last: 65535},
		SNATSource: func(packet.Addr) (packet.Addr, bool) { return nodeAddr, true }, Seed: 1})
	sock := newBenchSocket()
	port := &Port{Ifindex: 1, Name: "bench0", Queue: 0, Sock: sock, FrameSize: 2048}
	eg := &atomic.Pointer[egress]{}
	eg.Store(&egress{ifaces: []egressIface{{ifindex: 1, ports: []*Port{port}}}})
	w := NewWorker(WorkerConfig{CPU: -1, BatchSize: benchBatch}, port, eg, proc, ct, benchResolver{}, &benchFlowWriter{})
	sock.Refill()
	return &benchWorld{sock: sock, w: w, ct: ct, services: services,
		tmpl: frame(tb, packet.ProtoTCP, addr("10.0.0.1"), addr("198.19.0.0"), 1, 80, packet.TCPAck, make([]byte, 6))}
}

// turn is one round of the worker loop with frames waiting.
func (bw *benchWorld) turn() {
	w := bw.w
	if n := w.port.Sock.Receive(w.rx); n > 0 {
		w.processBatch(w.rx[:n])
	}
}

// feedFlows receives n frames of flows next(0..n-1) of the given TCP
// flags.
func (bw *benchWorld) feedFlows(n int, flags uint8, next func() int) {
	bw.sock.feed(n, func(_ int, buf []byte) int {
		flowFrame(buf, bw.tmpl, next(), bw.services)
		buf[47] = flags
		return len(bw.tmpl)
	})
}

// measure is the timed loop of a benchmark: a batch of frames of flows
// next() with the given TCP flags, then one turn of the worker, per
// iteration. It reports the cost per packet and returns the packets sent.
func (bw *benchWorld) measure(b *testing.B, flags uint8, next func() int) int {
	var m packetMeter
	b.ReportAllocs()
	b.ResetTimer()
	m.start()
	for b.Loop() {
		bw.feedFlows(benchBatch, flags, next)
		bw.turn()
		m.pkts += benchBatch
	}
	m.report(b)
	return m.pkts
}

// open runs the first packet of flows 0..flows-1 through the worker.
func (bw *benchWorld) open(tb testing.TB, flows int) {
	tb.Helper()
	i := 0
	for i < flows {
		n := min(benchBatch, flows-i)
		bw.feedFlows(n, packet.TCPAck, func() int { i++; return i - 1 })
		bw.turn()
	}
	if got := bw.w.Counters.NewFlows.Load(); got != uint64(flows) {
		tb.Fatalf("%d flows opened, want %d: %+v", got, flows, bw.w.Counters.Snapshot())
	}
}

// BenchmarkWorkerEstablished is the whole worker loop on packets of
// established flows, visited in a scattered order so that caches do not
// hide the number of flows. ns/pkt is the cost of one packet.
func BenchmarkWorkerEstablished(b *testing.B) {
	for _, services := range []int{1, 100_000} {
		for _, flows := range []int{1_000, 100_000} {
			b.Run(fmt.Sprintf("services=%d/flows=%d", services, flows), func(b *testing.B) {
				bw := newBenchWorld(b, services, flows+flows/4+1024)
				bw.open(b, flows)
				fwd := bw.w.Counters.Forwarded.Load()
				i := 0
				next := func() int {
					if i += 7919; i >= flows {
						i %= flows
					}
					return i
				}
				pkts := bw.measure(b, packet.TCPAck, next)
				if got := bw.w.Counters.Forwarded.Load() - fwd; got != uint64(pkts) {
					b.Fatalf("%d of %d packets forwarded: %+v", got, pkts, bw.w.Counters.Snapshot())
				}
			})
		}
	}
}

// BenchmarkWorkerNewFlow is the whole worker loop when every packet opens
// a flow (a TCP SYN from a new source): service lookup, backend choice,
// conntrack insert, the reply tuple's publication.
func BenchmarkWorkerNewFlow(b *testing.B) {
	for _, services := range []int{1, 100_000} {
		b.Run(fmt.Sprintf("services=%d", services), func(b *testing.B) {
			const flows = 1 << 20
			bw := newBenchWorld(b, services, flows+flows/4)
			i := 0
			next := func() int { i++; return i - 1 }
			var m packetMeter
			b.ReportAllocs()
			b.ResetTimer()
			m.start()
			for b.Loop() {
				if i+benchBatch > flows {
					// Start over with an empty table so every packet stays new.
					b.StopTimer()
					m.pause()
					bw = nil
					bw = newBenchWorld(b, services, flows+flows/4)
					i = 0
					m.resumeAfterGC()
					b.StartTimer()
				}
				bw.feedFlows(benchBatch, packet.TCPSyn, next)
				bw.turn()
				m.pkts += benchBatch
			}
			m.report(b)
			if bw.w.Counters.Forwarded.Load() == 0 {
				b.Fatalf("nothing forwarded: %+v", bw.w.Counters.Snapshot())
			}
		})
	}
}

// BenchmarkWorkerNewFlowFull is BenchmarkWorkerNewFlow with the table
// full, as a flood of new flows keeps it: every new flow evicts an
// unassured one (conntrack's early drop) and its index fills with
// tombstones that rebuilds clear.
func BenchmarkWorkerNewFlowFull(b *testing.B) {
	const capacity = 1 << 16
	bw := newBenchWorld(b, 1, capacity)
	i := 0
	next := func() int { i++; return i % (1 << 22) }
	for range 2 * capacity / benchBatch {
		bw.feedFlows(benchBatch, packet.TCPSyn, next)
		bw.turn()
	}
	if st := bw.ct.Stats(); st.EvictedUnassured == 0 {
		b.Fatalf("the table is not evicting: %+v", st)
	}
	bw.measure(b, packet.TCPSyn, next)
}

// BenchmarkWorkerFeed is the benchmarks' own share: writing a batch of
// frames into the UMEM and recycling them, with no worker. Subtract it
// from the figures above for the worker alone.
func BenchmarkWorkerFeed(b *testing.B) {
	bw := newBenchWorld(b, 1, 1024)
	i := 0
	next := func() int { i++; return i % 1000 }
	s := bw.sock
	rx := bw.w.rx
	var m packetMeter
	b.ReportAllocs()
	m.start()
	for b.Loop() {
		bw.feedFlows(benchBatch, packet.TCPAck, next)
		n := s.Receive(rx)
		for _, d := range rx[:n] {
			s.Release(d)
		}
		s.Refill()
		m.pkts += benchBatch
	}
	m.report(b)
}

// TestWorkerLoopAllocs proves that a turn of the worker loop allocates
// nothing, on established flows and on new ones.
func TestWorkerLoopAllocs(t *testing.T) {
	bw := newBenchWorld(t, 10, 1<<16)
	bw.open(t, 1000)
	i := 0
	est := func() int { i = (i + 7) % 1000; return i }
	if n := testing.AllocsPerRun(200, func() {
		bw.feedFlows(benchBatch, packet.TCPAck, est)
		bw.turn()
	}); n != 0 {
		t.Errorf("established flows: %v allocations per batch", n)
	}
	j := 1000
	fresh := func() int { j++; return j }
	if n := testing.AllocsPerRun(200, func() {
		bw.feedFlows(benchBatch, packet.TCPSyn, fresh)
		bw.turn()
	}); n != 0 {
		t.Errorf("new flows: %v allocations per batch", n)
	}
	if d := bw.w.Counters.Snapshot().ByReason; len(d) != 0 {
		t.Errorf("frames not forwarded: %v", d)
	}
}
