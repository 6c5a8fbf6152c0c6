package dataplane

import (
	"bytes"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

const us = int64(time.Microsecond)

// TestIdleSpinAdapts: the spin grows when frames come soon after the ring
// went empty, follows the gaps it catches, and shrinks on a quiet queue,
// always between spinMin and the maximum.
func TestIdleSpinAdapts(t *testing.T) {
	s := newIdleSpin(0)
	if s.limit != spinMin || s.max != defaultSpinMax {
		t.Fatalf("start %+v", s)
	}
	s.woke(8 * us) // slept, but frames came 8 us later: spin longer
	if s.limit < 16*us {
		t.Errorf("after a short sleep: limit %d, want >= 16us", s.limit)
	}
	for range 10 {
		s.woke(30 * us)
	}
	if s.limit != defaultSpinMax {
		t.Errorf("busy queue: limit %d, want the maximum", s.limit)
	}
	for range 100 { // frames every 3 us, caught spinning: ease down towards 2 gaps
		s.caught(3 * us)
	}
	if s.limit < 6*us || s.limit > 8*us {
		t.Errorf("gaps of 3us caught: limit %d, want about 6us", s.limit)
	}
	for range 20 {
		s.quiet()
	}
	if s.limit != spinMin {
		t.Errorf("quiet queue: limit %d, want spinMin", s.limit)
	}
	s.woke(time.Second.Nanoseconds()) // frames long after: quiet
	if s.limit != spinMin {
		t.Errorf("after a long sleep: limit %d", s.limit)
	}
	if n := newIdleSpin(-1); n.limit != 0 || n.max != 0 {
		t.Errorf("no spin: %+v", n)
	}
	n := newIdleSpin(time.Microsecond)
	n.woke(500)
	if n.limit > us {
		t.Errorf("limit %d above the maximum 1us", n.limit)
	}
}

// TestIOFloorForwardsUntouched: in I/O floor mode a frame received on one
// interface leaves the other with only its MACs changed (to the peer's
// next hop and the egress interface's), even a frame for a service, and
// nothing is tracked.
func TestIOFloorForwardsUntouched(t *testing.T) {
	peer0, peer1 := addr("198.18.0.200"), addr("198.18.1.200")
	fn := startFakeNode(t, 1, func(c *EngineConfig) { c.IOFloor = &IOFloor{Peers: []packet.Addr{peer1, peer0}} })
	mac0, mac1 := [6]byte{2, 0xa, 0, 0, 0, 1}, [6]byte{2, 0xa, 0, 0, 0, 2}
	fn.k.resolver.set(peer0, NextHop{Ifindex: fn.n0.Index, Dst: mac0, Src: macOf(fn.n0.MAC)})
	fn.k.resolver.set(peer1, NextHop{Ifindex: fn.n1.Index, Dst: mac1, Src: macOf(fn.n1.MAC)})
	for _, tc := range []struct {
		in, out Link
		dst     [6]byte
	}{{fn.n0, fn.n1, mac1}, {fn.n1, fn.n0, mac0}} {
		f := frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), 46000, 80, packet.TCPSyn, []byte("floor"))
		fn.inject(t, tc.in, 0, f)
		got := fn.sent(t, tc.out, 1)[0]
		if !bytes.Equal(got[0:6], tc.dst[:]) || !bytes.Equal(got[6:12], tc.out.MAC) {
			t.Errorf("%s -> %s: MACs %x -> %x", tc.in.Name, tc.out.Name, got[6:12], got[0:6])
		}
		if !bytes.Equal(got[12:], f[12:]) {
			t.Errorf("%s -> %s: the frame changed beyond its MACs", tc.in.Name, tc.out.Name)
		}
	}
	if c := fn.counters(); c.Forwarded != 2 || c.NewFlows != 0 || fn.e.Conntrack().Stats().Live != 0 {
		t.Errorf("counters %+v, %d flows tracked: want 2 forwarded and nothing tracked", c, fn.e.Conntrack().Stats().Live)
	}
}

// threadCPUOf is the CPU time thread tid of this process has used, in
// nanoseconds: the thread's CPU-time clock (Linux's MAKE_THREAD_CPUCLOCK
// of tid, CPUCLOCK_SCHED), what /proc/self/task/TID/stat counts in ticks.
func threadCPUOf(t *testing.T, tid int) time.Duration {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(int32(^tid<<3|6), &ts); err != nil {
		t.Fatalf("CPU clock of thread %d: %v", tid, err)
	}
	return time.Duration(ts.Nano())
}

// TestIdleWorkerCostsNothing: a worker with nothing to do uses well under
// 1% of a CPU (its thread's CPU time over a few seconds, threadCPUOf;
// XDPROXY_IDLE_SECONDS=10 for the measurement). A BusyPoll worker
// spins after its last frame, but only for IdleWait (200 ms): then it
// sleeps too, so that a quiet queue leaves the CPU to the busy ones.
func TestIdleWorkerCostsNothing(t *testing.T) {
	secs := 3
	if s, err := strconv.Atoi(os.Getenv("XDPROXY_IDLE_SECONDS")); err == nil && s > 0 {
		secs = s
	}
	if testing.Short() {
		secs = 1
	}
	for _, busy := range []bool{false, true} {
		fn := startFakeNode(t, 1, func(c *EngineConfig) { c.BusyPoll = busy })
		w := fn.e.Workers()[0]
		await(t, "the worker's thread", func() bool { return w.TID() != 0 })
		// One frame, so the worker has been through a batch.
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7000, 53, 0, nil))
		fn.sent(t, fn.n1, 1)
		before, start := threadCPUOf(t, w.TID()), time.Now()
		time.Sleep(time.Duration(secs) * time.Second)
		used, el := threadCPUOf(t, w.TID())-before, time.Since(start)
		share := float64(used) / float64(el)
		t.Logf("busyPoll=%v: worker thread used %v of CPU in %v idle (%.3f%% of a CPU), %d poll wake-ups",
			busy, used, el.Round(time.Millisecond), 100*share, w.Counters.Wakeups.Load())
		switch {
		case !busy:
			if share > 0.01 {
				t.Errorf("idle worker used %.2f%% of a CPU, want well under 1%%", 100*share)
			}
		case share > 0.5:
			// It spun for IdleWait at most, of several seconds.
			t.Errorf("busy-polling worker used %.2f%% of a CPU with a quiet queue: it never went to sleep", 100*share)
		}
		fn.e.Close()
	}
}

// TestBusyPollWorkerForwards: a BusyPoll worker forwards frames that come
// while it spins without a poll() wake-up, goes to sleep once its queue
// has been quiet for IdleWait, and is woken by the next frame.
func TestBusyPollWorkerForwards(t *testing.T) {
	fn := startFakeNode(t, 1, func(c *EngineConfig) { c.BusyPoll = true })
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7000, 53, 0, nil))
	fn.sent(t, fn.n1, 1)
	woken := fn.counters().Wakeups // at most the first frame's, if the worker had gone to sleep before it
	for i := range 20 {
		fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), uint16(7001+i), 53, 0, nil))
	}
	fn.sent(t, fn.n1, 20)
	if c := fn.counters(); c.Wakeups != woken || c.SpinCatches == 0 {
		t.Errorf("counters %+v: want no wake-up while frames keep coming (%d before), batches caught spinning", c, woken)
	}
	// Quiet for longer than IdleWait: asleep. The next frame wakes it.
	time.Sleep(500 * time.Millisecond)
	fn.inject(t, fn.n0, 0, frame(t, packet.ProtoUDP, podA, addr("198.19.0.20"), 7100, 53, 0, nil))
	fn.sent(t, fn.n1, 1)
	if c := fn.counters(); c.Wakeups != woken+1 {
		t.Errorf("counters %+v: want one poll() wake-up after the quiet spell", c)
	}
}
