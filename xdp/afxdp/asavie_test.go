package afxdp

// This file compares the wrapper with github.com/asavie/xdp, which the
// package used to build on, and keeps the measurement that decided against
// asavie's socket setup.

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asavie/xdp"
	"golang.org/x/sys/unix"
)

// TestAsavieCloseLeavesQueueBound shows why Open sets the socket up itself:
// asavie's Close unmaps the UMEM but not the rings, each ring mapping keeps
// the socket alive, and so the queue stays bound for the life of the
// process. Open's EBUSY retry gives up after bindRetryFor.
func TestAsavieCloseLeavesQueueBound(t *testing.T) {
	e := newEnv(t, 1)
	inNetns(t, e.nsA, func() error {
		x, err := xdp.NewSocket(e.idxA, 0, nil)
		if err != nil {
			return err
		}
		if err := x.Close(); err != nil {
			return err
		}
		s, err := Open(e.idxA, 0, DefaultConfig())
		if err == nil {
			s.Close()
			t.Fatal("bind after asavie's Close succeeded; asavie now releases its rings and Open could build on it")
		}
		if !errors.Is(err, unix.EBUSY) {
			t.Fatalf("bind after asavie's Close: %v, want EBUSY", err)
		}
		return nil
	})
}

// generator transmits prebuilt 64-byte UDP frames from namespace B through
// an AF_XDP socket in copy mode, at rate frames/s or as fast as it can
// (rate 0), until halted.
type generator struct {
	s        *Socket
	frameLen uint32
	stop     atomic.Bool
	done     chan error
}

func newGenerator(b *testing.B, e *testEnv, queue int) *generator {
	cfg := DefaultConfig()
	cfg.Mode = Copy
	var s *Socket
	inNetns(b, e.nsB, func() (err error) {
		s, err = Open(e.idxB, queue, cfg)
		return err
	})
	b.Cleanup(func() { s.Close() })
	// Every frame holds the same packet, so the send loop writes nothing.
	var n int
	for i := 0; i < cfg.NumFrames; i++ {
		n = buildUDP(s.umem[i*cfg.FrameSize:(i+1)*cfg.FrameSize], macB, macA, ipB, ipA, 7000, 9, make([]byte, 18))
	}
	return &generator{s: s, frameLen: uint32(n)}
}

func (g *generator) start(rate int, cpu int) {
	g.stop.Store(false)
	g.done = make(chan error, 1)
	go func() {
		// The thread stays locked and is discarded with its affinity.
		runtime.LockOSThread()
		if err := pin(cpu); err != nil {
			g.done <- err
			return
		}
		batch := make([]Desc, 64)
		start, sent := time.Now(), 0
		for !g.stop.Load() {
			g.s.Complete()
			want := len(batch)
			if rate > 0 {
				due := int(time.Since(start).Seconds()*float64(rate)) - sent
				if due <= 0 {
					time.Sleep(time.Duration(len(batch)) * time.Second / time.Duration(rate))
					continue
				}
				want = min(want, due)
			}
			k := 0
			for ; k < want; k++ {
				d, ok := g.s.Alloc()
				if !ok {
					break
				}
				d.Len = g.frameLen
				batch[k] = d
			}
			n := g.s.Transmit(batch[:k])
			for _, d := range batch[n:k] {
				g.s.Release(d)
			}
			sent += n
		}
		g.done <- nil
	}()
}

func (g *generator) halt() error {
	g.stop.Store(true)
	return <-g.done
}

// pin binds the calling thread to cpu; -1 leaves it alone.
func pin(cpu int) error {
	if cpu < 0 {
		return nil
	}
	var set unix.CPUSet
	set.Set(cpu)
	return unix.SchedSetaffinity(0, &set)
}

// usage returns the CPU time and voluntary context switches (sleeps) of
// who, RUSAGE_THREAD or RUSAGE_SELF.
func usage(who int) (cpu time.Duration, sleeps int64) {
	var ru unix.Rusage
	if err := unix.Getrusage(who, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), ru.Nvcsw
}

// receiver is one side of the comparison.
type receiver struct {
	name  string
	gen   *generator
	drops func() uint64     // kernel's drop counters for the socket
	prime func()            // empties the RX ring and fills the fill ring
	loop  func(n int) error // receives n frames
}

// measureRx runs r's generator at rate on genCPU while r's loop receives
// b.N frames on rxCPU, and reports receive throughput, the receiving
// thread's CPU time per frame, the whole process's CPU time per frame (the
// generator and the kernel's veth, XDP and copy work, which runs in the
// sender's context, included), kernel drops per received frame, and the
// receiving thread's sleeps (voluntary context switches) per frame.
func measureRx(b *testing.B, r receiver, rate, genCPU, rxCPU int) {
	b.ReportAllocs()
	r.prime()
	dropsBefore := r.drops()
	type result struct {
		cpu    time.Duration
		sleeps int64
		err    error
	}
	resc := make(chan result, 1)
	r.gen.start(rate, genCPU)
	b.ResetTimer()
	start := time.Now()
	selfBefore, _ := usage(unix.RUSAGE_SELF)
	go func() {
		runtime.LockOSThread() // never unlocked: the pinned thread is discarded
		if err := pin(rxCPU); err != nil {
			resc <- result{err: err}
			return
		}
		cpu0, sleeps0 := usage(unix.RUSAGE_THREAD)
		err := r.loop(b.N)
		cpu1, sleeps1 := usage(unix.RUSAGE_THREAD)
		resc <- result{cpu1 - cpu0, sleeps1 - sleeps0, err}
	}()
	res := <-resc
	selfAfter, _ := usage(unix.RUSAGE_SELF)
	elapsed := time.Since(start)
	b.StopTimer()
	if err := r.gen.halt(); err != nil {
		b.Fatal(err)
	}
	if res.err != nil {
		b.Fatal(res.err)
	}
	n := float64(b.N)
	b.ReportMetric(n/elapsed.Seconds(), "frames/s")
	b.ReportMetric(float64(res.cpu.Nanoseconds())/n, "rx-cpu-ns/frame")
	b.ReportMetric(float64((selfAfter-selfBefore).Nanoseconds())/n, "all-cpu-ns/frame")
	b.ReportMetric(float64(r.drops()-dropsBefore)/n, "drops/frame")
	b.ReportMetric(float64(res.sleeps)/n, "sleeps/frame")
	time.Sleep(20 * time.Millisecond) // let frames in flight land before the next prime
}

// errStalled ends a receive loop whose generator stopped delivering. The
// loops count empty 10ms polls rather than read the clock, which costs
// about 0.2us here and would blur the comparison.
var errStalled = errors.New("no frame in 500 polls")

const maxIdlePolls = 500

// BenchmarkReceive compares asavie's receive loop with this package's on
// the same veth pair in the same run: asavie's socket on xa queue 0, ours on
// queue 1, each fed by its own AF_XDP generator on the matching queue of xb
// (a copy-mode AF_XDP transmit on xb queue q arrives on xa queue q). The
// generator runs on CPU 0, and with it the kernel's receive work; the
// receive loop runs on CPU 1. rate=300k is paced below what either loop
// carries, so it compares cost; rate=max floods.
//
//	go test -run '^$' -bench Receive ./xdp/afxdp/
func BenchmarkReceive(b *testing.B) {
	e := newEnv(b, 2)
	cfg := DefaultConfig()
	genCPU, rxCPU := 0, 1
	if runtime.NumCPU() < 2 {
		genCPU, rxCPU = -1, -1
	}

	var ax *xdp.Socket
	inNetns(b, e.nsA, func() (err error) {
		ax, err = xdp.NewSocket(e.idxA, 0, &xdp.SocketOptions{
			NumFrames:              cfg.NumFrames,
			FrameSize:              cfg.FrameSize,
			FillRingNumDescs:       cfg.FillRingSize,
			CompletionRingNumDescs: cfg.CompletionRingSize,
			RxRingNumDescs:         cfg.RxRingSize,
			TxRingNumDescs:         cfg.TxRingSize,
		})
		return err
	})
	b.Cleanup(func() { ax.Close() })
	if err := e.xsks.Put(uint32(0), uint32(ax.FD())); err != nil {
		b.Fatal(err)
	}
	ours := e.open(b, 1, cfg)
	descs := make([]Desc, 64)

	receivers := []receiver{{
		name: "asavie",
		gen:  newGenerator(b, e, 0),
		drops: func() uint64 {
			st, err := ax.Stats()
			if err != nil {
				panic(err)
			}
			k := st.KernelStats
			return k.Rx_dropped + k.Rx_ring_full + k.Rx_fill_ring_empty_descs
		},
		prime: func() {
			for ax.NumReceived() > 0 {
				ax.Receive(ax.NumReceived())
			}
			ax.Fill(ax.GetDescs(ax.NumFreeFillSlots()))
		},
		// The loop asavie's documentation shows: fill, poll, receive.
		loop: func(n int) error {
			idle := 0
			for got := 0; got < n; {
				ax.Fill(ax.GetDescs(ax.NumFreeFillSlots()))
				numRx, _, err := ax.Poll(10)
				if err != nil {
					return err
				}
				k := len(ax.Receive(numRx))
				got += k
				if k > 0 {
					idle = 0
				} else if idle++; idle > maxIdlePolls {
					return errStalled
				}
			}
			return nil
		},
	}, {
		name: "afxdp",
		gen:  newGenerator(b, e, 1),
		drops: func() uint64 {
			st, err := ours.Stats()
			if err != nil {
				panic(err)
			}
			return st.RxDropped + st.RxRingFull + st.FillRingEmpty
		},
		prime: func() {
			for n := ours.Receive(descs); n > 0; n = ours.Receive(descs) {
				for _, d := range descs[:n] {
					ours.Release(d)
				}
			}
			ours.Refill()
		},
		// A worker's loop: refill, take a batch, sleep in Wait when empty.
		loop: func(n int) error {
			idle := 0
			for got := 0; got < n; {
				ours.Refill()
				k := ours.Receive(descs)
				if k == 0 {
					if _, err := ours.Wait(10 * time.Millisecond); err != nil {
						return err
					}
					if idle++; idle > maxIdlePolls {
						return errStalled
					}
					continue
				}
				idle = 0
				for _, d := range descs[:k] {
					ours.Release(d)
				}
				got += k
			}
			return nil
		},
	}}

	for _, rate := range []int{300_000, 0} {
		label := "max"
		if rate > 0 {
			label = fmt.Sprintf("%dk", rate/1000)
		}
		for _, r := range receivers {
			b.Run("rate="+label+"/"+r.name, func(b *testing.B) { measureRx(b, r, rate, genCPU, rxCPU) })
		}
	}
}

// BenchmarkDrain isolates the ring handling from wakeups: a generator on
// xb fills the receiver's RX ring with one ring's worth of frames (2048),
// then the receive loop empties it and gives every frame back to the fill
// ring, without polling. b.N counts frames and ns/op includes the
// generator; drain-ns/frame is the receive loop alone, on a locked thread.
//
//	go test -run '^$' -bench Drain ./xdp/afxdp/
func BenchmarkDrain(b *testing.B) {
	e := newEnv(b, 2)
	cfg := DefaultConfig()
	var ax *xdp.Socket
	inNetns(b, e.nsA, func() (err error) {
		ax, err = xdp.NewSocket(e.idxA, 0, &xdp.SocketOptions{
			NumFrames:              cfg.NumFrames,
			FrameSize:              cfg.FrameSize,
			FillRingNumDescs:       cfg.FillRingSize,
			CompletionRingNumDescs: cfg.CompletionRingSize,
			RxRingNumDescs:         cfg.RxRingSize,
			TxRingNumDescs:         cfg.TxRingSize,
		})
		return err
	})
	b.Cleanup(func() { ax.Close() })
	if err := e.xsks.Put(uint32(0), uint32(ax.FD())); err != nil {
		b.Fatal(err)
	}
	ours := e.open(b, 1, cfg)
	gens := []*generator{newGenerator(b, e, 0), newGenerator(b, e, 1)}
	batch := make([]Desc, cfg.RxRingSize)

	// burst sends up to one RX ring's worth of frames through gen and
	// waits until queued reports them all on the receiver's RX ring. In
	// copy mode sendto does the veth and XDP work itself, so they are
	// usually there when Transmit returns.
	burst := func(b *testing.B, g *generator, queued func() int) {
		b.Helper()
		for g.s.Complete() > 0 {
		}
		k := 0
		for ; k < len(batch); k++ {
			d, ok := g.s.Alloc()
			if !ok {
				break
			}
			d.Len = g.frameLen
			batch[k] = d
		}
		n := g.s.Transmit(batch[:k])
		for _, d := range batch[n:k] {
			g.s.Release(d)
		}
		for spins := 0; queued() < n; spins++ {
			if spins > 10000 {
				b.Fatalf("only %d of %d frames reached the RX ring", queued(), n)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	// measure runs drain after each burst until b.N frames are drained.
	// Each drain empties the ring, so a run may drain a little over b.N.
	measure := func(b *testing.B, g *generator, queued func() int, drain func() int) {
		b.ReportAllocs()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var spent time.Duration
		for got := 0; got < b.N; {
			burst(b, g, queued)
			start := time.Now()
			got += drain()
			spent += time.Since(start)
		}
		b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "drain-ns/frame")
	}

	b.Run("asavie", func(b *testing.B) {
		ax.Fill(ax.GetDescs(ax.NumFreeFillSlots()))
		measure(b, gens[0], ax.NumReceived, func() int {
			got := 0
			for ax.NumReceived() > 0 {
				got += len(ax.Receive(64))
				ax.Fill(ax.GetDescs(ax.NumFreeFillSlots()))
			}
			return got
		})
	})
	b.Run("afxdp", func(b *testing.B) {
		descs := make([]Desc, 64)
		ours.Refill()
		queued := func() int { return int(atomic.LoadUint32(ours.rx.producer) - ours.rx.cachedCons) }
		measure(b, gens[1], queued, func() int {
			got := 0
			for {
				k := ours.Receive(descs)
				if k == 0 {
					break
				}
				for _, d := range descs[:k] {
					ours.Release(d)
				}
				ours.Refill()
				got += k
			}
			return got
		})
	})
}
