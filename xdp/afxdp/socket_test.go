package afxdp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// waitUntil calls cond every interval (0: without pause) until it returns
// true or timeout has passed, and says whether it did. cond may fail the
// test.
func waitUntil(interval, timeout time.Duration, cond func() bool) bool {
	return wait.PollUntilContextTimeout(context.Background(), interval, timeout, true,
		func(context.Context) (bool, error) { return cond(), nil }) == nil
}

// receiveN collects n frames from s, waiting at most timeout in total.
func receiveN(t *testing.T, s *Socket, n int, timeout time.Duration) []Desc {
	t.Helper()
	got := make([]Desc, 0, n)
	buf := make([]Desc, 64)
	// Wait paces the loop while nothing arrives.
	if !waitUntil(0, timeout, func() bool {
		s.Refill()
		k := s.Receive(buf)
		got = append(got, buf[:k]...)
		if k == 0 {
			if _, err := s.Wait(50 * time.Millisecond); err != nil {
				t.Fatalf("Wait: %v", err)
			}
		}
		return len(got) >= n
	}) {
		st, _ := s.Stats()
		t.Fatalf("received %d frames, want %d (stats %+v)", len(got), n, st)
	}
	return got
}

// checkFrames asserts that every frame is accounted for and that the free
// stack holds distinct, frame-aligned addresses.
func checkFrames(t *testing.T, s *Socket, held int) {
	t.Helper()
	st, err := s.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.FramesFree+st.FramesFill+st.FramesTx+held != s.cfg.NumFrames {
		t.Errorf("free %d + fill %d + tx %d + held %d != NumFrames %d", st.FramesFree, st.FramesFill, st.FramesTx, held, s.cfg.NumFrames)
	}
	seen := make(map[uint64]bool, s.nfree)
	for _, a := range s.free[:s.nfree] {
		if a%s.frameSize != 0 || a >= uint64(len(s.umem)) {
			t.Fatalf("free stack holds bad address %#x", a)
		}
		if seen[a] {
			t.Fatalf("free stack holds %#x twice", a)
		}
		seen[a] = true
	}
}

func TestEcho(t *testing.T) {
	e := newEnv(t, 1)
	cfg := DefaultConfig()
	s := e.open(t, 0, cfg)
	if s.ZeroCopy() {
		t.Logf("veth bound zero-copy (unexpected but fine)")
	}
	if n := s.Refill(); n != cfg.FillRingSize {
		t.Fatalf("first Refill moved %d frames, want %d", n, cfg.FillRingSize)
	}
	if n := s.Refill(); n != 0 {
		t.Fatalf("second Refill moved %d frames into a full ring", n)
	}

	peer := e.udpB(t, 0)
	const count = 100
	for i := 0; i < count; i++ {
		if _, err := peer.WriteToUDP([]byte(fmt.Sprintf("ping %03d", i)), &net.UDPAddr{IP: ipA, Port: 9}); err != nil {
			t.Fatal(err)
		}
	}
	descs := receiveN(t, s, count, 5*time.Second)
	peerPort := uint16(peer.LocalAddr().(*net.UDPAddr).Port)
	for i, d := range descs {
		f := s.Frame(d)
		if len(f) != int(d.Len) {
			t.Fatalf("Frame len %d, Desc.Len %d", len(f), d.Len)
		}
		if want := int(d.Addr&^s.frameMask + s.frameSize - d.Addr); cap(f) != want {
			t.Fatalf("Frame cap %d, want %d (to the end of the frame)", cap(f), want)
		}
		sport, dport, payload, ok := udpPayload(f)
		if !ok || sport != peerPort || dport != 9 || string(payload) != fmt.Sprintf("ping %03d", i) {
			t.Fatalf("frame %d: sport %d dport %d payload %q ok %v", i, sport, dport, payload, ok)
		}
		// Reply in place, growing the frame by four bytes into its capacity.
		f = f[:len(f)+4]
		buildUDP(f, macA, macB, ipA, ipB, 9, sport, append(payload, " pong"[1:]...))
		descs[i].Len = uint32(len(f))
	}
	checkFrames(t, s, count)

	sent := 0
	for sent < count {
		n := s.Transmit(descs[sent:])
		if n == 0 {
			t.Fatalf("Transmit took nothing with %d frames left", count-sent)
		}
		sent += n
	}
	buf := make([]byte, 2048)
	peer.SetReadDeadline(time.Now().Add(5 * time.Second))
	for i := 0; i < count; i++ {
		n, from, err := peer.ReadFromUDP(buf)
		if err != nil {
			st, _ := s.Stats()
			t.Fatalf("reply %d: %v (stats %+v)", i, err, st)
		}
		if want := fmt.Sprintf("ping %03dpong", i); string(buf[:n]) != want || !from.IP.Equal(ipA) || from.Port != 9 {
			t.Fatalf("reply %d from %v: %q, want %q from %v:9", i, from, buf[:n], want, ipA)
		}
	}
	completed := 0
	waitUntil(0, time.Second, func() bool { completed += s.Complete(); return completed >= count })
	if completed != count {
		t.Fatalf("Complete returned %d frames, want %d", completed, count)
	}
	checkFrames(t, s, 0)
	st, _ := s.Stats()
	if st.FramesTx != 0 || st.FramesHeld != 0 || st.TxInvalidDescs != 0 || st.KickErrors != 0 {
		t.Fatalf("after echo: %+v", st)
	}
	// receiveN refilled as it went: the ring is full again and the rest
	// of the UMEM, the completed frames included, is on the free stack.
	if st.FramesFill != cfg.FillRingSize || st.FramesFree != cfg.NumFrames-cfg.FillRingSize {
		t.Fatalf("after echo: %d frames in the fill ring, %d free", st.FramesFill, st.FramesFree)
	}
}

func TestRefillKeepsFillRingFull(t *testing.T) {
	e := newEnv(t, 1)
	cfg := Config{NumFrames: 64, FrameSize: 2048, FillRingSize: 32, CompletionRingSize: 32, RxRingSize: 32, TxRingSize: 32}
	s := e.open(t, 0, cfg)
	if n := s.Refill(); n != 32 {
		t.Fatalf("Refill moved %d, want 32", n)
	}
	if n := s.Refill(); n != 0 {
		t.Fatalf("Refill into a full ring moved %d", n)
	}
	if s.FreeFrames() != 32 {
		t.Fatalf("FreeFrames %d, want 32", s.FreeFrames())
	}
	peer := e.udpB(t, 0)
	for i := 0; i < 10; i++ {
		peer.WriteToUDP([]byte("x"), &net.UDPAddr{IP: ipA, Port: 9})
	}
	var descs [32]Desc
	got := 0
	waitUntil(0, 3*time.Second, func() bool {
		got += s.Receive(descs[got:])
		if got < 10 {
			s.Wait(50 * time.Millisecond)
		}
		return got >= 10
	})
	if got != 10 {
		t.Fatalf("received %d, want 10", got)
	}
	// The kernel took exactly ten fill entries; Refill tops the ring up by ten.
	if n := s.Refill(); n != 10 {
		t.Fatalf("Refill after 10 frames moved %d, want 10", n)
	}
	if s.FreeFrames() != 22 {
		t.Fatalf("FreeFrames %d, want 22", s.FreeFrames())
	}
	checkFrames(t, s, 10)
	for _, d := range descs[:got] {
		s.Release(d)
	}
	checkFrames(t, s, 0)
	if s.FreeFrames() != 32 {
		t.Fatalf("FreeFrames after Release %d, want 32", s.FreeFrames())
	}
}

func TestAllocExhaustsAndReleaseRecycles(t *testing.T) {
	e := newEnv(t, 1)
	cfg := Config{NumFrames: 32, FrameSize: 4096, FillRingSize: 16, CompletionRingSize: 32, RxRingSize: 32, TxRingSize: 32}
	s := e.open(t, 0, cfg)
	s.Refill()
	var held []Desc
	for {
		d, ok := s.Alloc()
		if !ok {
			break
		}
		if d.Len != 0 || d.Addr%4096 != 0 {
			t.Fatalf("Alloc returned %+v", d)
		}
		held = append(held, d)
	}
	if len(held) != 16 {
		t.Fatalf("allocated %d frames with 16 in the fill ring, want 16", len(held))
	}
	checkFrames(t, s, 16)
	s.Release(held[3])
	if d, ok := s.Alloc(); !ok || d.Addr != held[3].Addr {
		t.Fatalf("Alloc after Release = %+v %v, want the released frame %#x (LIFO)", d, ok, held[3].Addr)
	}
	for _, d := range held {
		s.Release(d)
	}
	checkFrames(t, s, 0)
	// A double release is caught once the stack would hold more frames
	// than the UMEM: here after the 16 frames in the fill ring's share.
	for _, d := range held {
		s.Release(d)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("releasing more frames than the UMEM holds did not panic")
		}
	}()
	s.Release(held[0])
}

// TestTransmitAllocated sends frames written from scratch, more than one
// copy-mode kick's default budget of 32 in a single Transmit, and checks
// that the peer gets each one and that Complete recycles them all.
func TestTransmitAllocated(t *testing.T) {
	e := newEnv(t, 1)
	cfg := Config{NumFrames: 1024, FrameSize: 2048, FillRingSize: 256, CompletionRingSize: 512, RxRingSize: 256, TxRingSize: 256}
	s := e.open(t, 0, cfg)
	s.Refill()
	peer := e.udpB(t, 7000)
	peer.SetReadBuffer(1 << 20)

	const count = 300 // more than the TX ring holds
	descs := make([]Desc, count)
	for i := range descs {
		d, ok := s.Alloc()
		if !ok {
			t.Fatalf("Alloc %d failed", i)
		}
		f := s.Frame(d)[:2048]
		d.Len = uint32(buildUDP(f, macA, macB, ipA, ipB, 5000, 7000, []byte(fmt.Sprintf("frame %03d", i))))
		descs[i] = d
	}
	n := s.Transmit(descs)
	if n != cfg.TxRingSize {
		t.Fatalf("Transmit into an empty %d-slot ring took %d of %d", cfg.TxRingSize, n, count)
	}
	// Wait for completions without kicking again: one Transmit must have
	// pushed the whole ring out.
	completed := 0
	waitUntil(0, 2*time.Second, func() bool { completed += s.Complete(); return completed >= n })
	if completed != n {
		st, _ := s.Stats()
		t.Fatalf("%d of %d frames completed after one Transmit (stats %+v)", completed, n, st)
	}
	if m := s.Transmit(descs[n:]); m != count-n {
		t.Fatalf("second Transmit took %d, want %d", m, count-n)
	}
	buf := make([]byte, 2048)
	peer.SetReadDeadline(time.Now().Add(5 * time.Second))
	for i := 0; i < count; i++ {
		k, _, err := peer.ReadFromUDP(buf)
		if err != nil {
			st, _ := s.Stats()
			t.Fatalf("datagram %d: %v (stats %+v)", i, err, st)
		}
		if want := fmt.Sprintf("frame %03d", i); !bytes.Equal(buf[:k], []byte(want)) {
			t.Fatalf("datagram %d = %q, want %q", i, buf[:k], want)
		}
	}
	waitUntil(0, 2*time.Second, func() bool { completed += s.Complete(); return completed >= count })
	if completed != count {
		t.Fatalf("completed %d, want %d", completed, count)
	}
	checkFrames(t, s, 0)
}

// TestTwoQueues binds one socket to each queue of a two-queue veth. Flows
// from many peer sockets spread over both queues, and a flow stays on one.
func TestTwoQueues(t *testing.T) {
	e := newEnv(t, 2)
	cfg := DefaultConfig()
	socks := []*Socket{e.open(t, 0, cfg), e.open(t, 1, cfg)}
	for _, s := range socks {
		s.Refill()
	}
	const flows, perFlow = 32, 4
	for f := 0; f < flows; f++ {
		c := e.udpB(t, 0)
		for i := 0; i < perFlow; i++ {
			c.WriteToUDP([]byte{byte(f), byte(i)}, &net.UDPAddr{IP: ipA, Port: 9})
		}
	}
	queueOf := map[uint16]int{}
	perQueue := [2]int{}
	buf := make([]Desc, 64)
	waitUntil(0, 5*time.Second, func() bool {
		idle := true
		for q, s := range socks {
			n := s.Receive(buf)
			for _, d := range buf[:n] {
				sport, _, _, ok := udpPayload(s.Frame(d))
				if !ok {
					t.Fatalf("queue %d: non-UDP frame % x", q, s.Frame(d))
				}
				if prev, seen := queueOf[sport]; seen && prev != q {
					t.Fatalf("flow from port %d arrived on queues %d and %d", sport, prev, q)
				}
				queueOf[sport] = q
				perQueue[q]++
				s.Release(d)
			}
			if n > 0 {
				idle = false
			}
			s.Refill()
		}
		if idle {
			time.Sleep(5 * time.Millisecond)
		}
		return perQueue[0]+perQueue[1] >= flows*perFlow
	})
	if perQueue[0]+perQueue[1] != flows*perFlow {
		t.Fatalf("received %v frames per queue, want %d in total", perQueue, flows*perFlow)
	}
	if perQueue[0] == 0 || perQueue[1] == 0 {
		t.Fatalf("all %d flows landed on one queue: %v", flows, perQueue)
	}
	t.Logf("frames per queue: %v", perQueue)
	for _, s := range socks {
		checkFrames(t, s, 0)
	}
}

// TestReopenSameQueue closes a socket and binds a new one to the same queue
// at once: Close must release the queue (rings unmapped) and Open must ride
// out the kernel's asynchronous release.
func TestReopenSameQueue(t *testing.T) {
	e := newEnv(t, 1)
	for i := 0; i < 3; i++ {
		var s *Socket
		inNetns(t, e.nsA, func() (err error) {
			s, err = Open(e.idxA, 0, DefaultConfig())
			return err
		})
		if err := s.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	}
}

func TestWaitTimesOutWhenIdle(t *testing.T) {
	e := newEnv(t, 1)
	s := e.open(t, 0, DefaultConfig())
	s.Refill()
	start := time.Now()
	ready, err := s.Wait(100 * time.Millisecond)
	if err != nil || ready {
		t.Fatalf("Wait on an idle socket = %v, %v", ready, err)
	}
	if el := time.Since(start); el < 90*time.Millisecond {
		t.Fatalf("Wait returned after %v, want about 100ms", el)
	}
	peer := e.udpB(t, 0)
	go func() {
		time.Sleep(50 * time.Millisecond)
		peer.WriteToUDP([]byte("wake"), &net.UDPAddr{IP: ipA, Port: 9})
	}()
	ready, err = s.Wait(5 * time.Second)
	if err != nil || !ready {
		t.Fatalf("Wait with traffic = %v, %v", ready, err)
	}
}

// TestHotPathAllocs measures allocations of the per-batch calls (and of
// Wait, here with a zero timeout) on a live socket while frames really pass
// through RX, TX and completion.
func TestHotPathAllocs(t *testing.T) {
	e := newEnv(t, 1)
	s := e.open(t, 0, DefaultConfig())
	s.Refill()
	peer := e.udpB(t, 0)
	const queued = 500
	for i := 0; i < queued; i++ {
		peer.WriteToUDP([]byte("alloc"), &net.UDPAddr{IP: ipA, Port: 9})
	}
	waitUntil(10*time.Millisecond, 3*time.Second, func() bool { return s.rx.available(queued) >= queued })
	descs := make([]Desc, 4)
	one := make([]Desc, 1)
	var frame [64]byte
	n := buildUDP(frame[:], macA, macB, ipA, ipB, 9, 9, nil)
	received, transmitted := 0, 0
	allocs := testing.AllocsPerRun(100, func() {
		k := s.Receive(descs)
		received += k
		transmitted += s.Transmit(descs[:k])
		s.Complete()
		s.Refill()
		if _, err := s.Wait(0); err != nil {
			panic(err)
		}
		if d, ok := s.Alloc(); ok {
			copy(s.Frame(d)[:n], frame[:n])
			d.Len = uint32(n)
			one[0] = d
			if s.Transmit(one) == 0 {
				s.Release(d)
			}
		}
	})
	if allocs != 0 {
		t.Fatalf("hot path allocates %.1f times per batch", allocs)
	}
	if received < 400 || transmitted < 400 {
		t.Fatalf("only %d frames received and %d transmitted during the measurement", received, transmitted)
	}
}

// TestBindModes: veth has no zero-copy support, so Copy binds, Auto falls
// back to copy, and ZeroCopy fails with the kernel's reason.
func TestBindModes(t *testing.T) {
	e := newEnv(t, 1)
	for _, mode := range []BindMode{Copy, Auto, ZeroCopy} {
		cfg := DefaultConfig()
		cfg.Mode = mode
		var s *Socket
		var err error
		inNetns(t, e.nsA, func() error {
			s, err = Open(e.idxA, 0, cfg)
			return nil
		})
		if mode == ZeroCopy {
			if err == nil {
				s.Close()
				t.Fatal("ZeroCopy bound on veth")
			}
			if !errors.Is(err, unix.EOPNOTSUPP) {
				t.Fatalf("ZeroCopy on veth: %v, want EOPNOTSUPP", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", mode, err)
		}
		if s.ZeroCopy() {
			t.Errorf("%v: veth socket reports zero-copy", mode)
		}
		s.Close()
	}
}

// TestRingsWrap pushes ten rings' worth of frames through 32-slot rings in
// both directions, so every index wraps many times and a side that forgot
// to publish its producer or consumer index would stall the kernel.
func TestRingsWrap(t *testing.T) {
	e := newEnv(t, 1)
	cfg := Config{NumFrames: 64, FrameSize: 2048, FillRingSize: 32, CompletionRingSize: 32, RxRingSize: 32, TxRingSize: 32, NeedWakeup: true}
	s := e.open(t, 0, cfg)
	peer := e.udpB(t, 0)
	peerPort := uint16(peer.LocalAddr().(*net.UDPAddr).Port)
	buf := make([]byte, 2048)
	const rounds, burst = 20, 16
	for r := 0; r < rounds; r++ {
		s.Refill()
		for i := 0; i < burst; i++ {
			peer.WriteToUDP([]byte{byte(r), byte(i)}, &net.UDPAddr{IP: ipA, Port: 9})
		}
		descs := receiveN(t, s, burst, 3*time.Second)
		for i, d := range descs {
			_, _, payload, ok := udpPayload(s.Frame(d))
			if !ok || len(payload) != 2 || payload[0] != byte(r) || payload[1] != byte(i) {
				t.Fatalf("round %d frame %d: payload %v", r, i, payload)
			}
			descs[i].Len = uint32(buildUDP(s.Frame(d)[:d.Len], macA, macB, ipA, ipB, 9, peerPort, []byte{byte(r), byte(i)}))
		}
		if n := s.Transmit(descs); n != burst {
			t.Fatalf("round %d: Transmit took %d of %d", r, n, burst)
		}
		peer.SetReadDeadline(time.Now().Add(3 * time.Second))
		for i := 0; i < burst; i++ {
			n, _, err := peer.ReadFromUDP(buf)
			if err != nil || n != 2 || buf[0] != byte(r) || buf[1] != byte(i) {
				t.Fatalf("round %d reply %d: % x, %v", r, i, buf[:n], err)
			}
		}
		done := 0
		waitUntil(0, time.Second, func() bool { done += s.Complete(); return done >= burst })
		if done != burst {
			t.Fatalf("round %d: %d of %d frames completed", r, done, burst)
		}
	}
	checkFrames(t, s, 0)
}

// TestNeedWakeupRespected: with need-wakeup, Transmit calls sendto only
// while the TX ring's flag asks for it (in copy mode the kernel keeps it
// set: it transmits inside sendto), Refill and Drive call recvfrom only
// while the fill ring's flag asks for it (never in copy mode), and an
// empty Transmit with nothing pending calls nothing.
func TestNeedWakeupRespected(t *testing.T) {
	e := newEnv(t, 1)
	cfg := DefaultConfig()
	cfg.Mode = Copy
	s := e.open(t, 0, cfg)
	s.Refill()
	peer := e.udpB(t, 7000)
	if !s.tx.needsWakeup() {
		t.Log("the TX ring's need-wakeup flag is clear in copy mode (FINDINGS 4 saw it always set)")
	}
	txFlag := s.tx.needsWakeup()
	d, _ := s.Alloc()
	d.Len = uint32(buildUDP(s.Frame(d)[:2048], macA, macB, ipA, ipB, 5000, 7000, []byte("kick")))
	if s.Transmit([]Desc{d}) != 1 {
		t.Fatal("Transmit refused a frame into an empty ring")
	}
	st, _ := s.Stats()
	if txFlag && st.TxKicks == 0 || !txFlag && st.TxKicks != 0 {
		t.Errorf("TX flag %v but %d sendto calls", txFlag, st.TxKicks)
	}
	peer.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, _, err := peer.ReadFromUDP(make([]byte, 64)); err != nil {
		t.Fatalf("the transmitted frame did not arrive: %v", err)
	}
	waitUntil(0, time.Second, func() bool { return s.Complete() != 0 })
	before, _ := s.Stats()
	s.Transmit(nil) // nothing to send, nothing pending
	for range 100 {
		s.Refill()
		s.Drive()
	}
	after, _ := s.Stats()
	if after.TxKicks != before.TxKicks {
		t.Errorf("Transmit(nil) with nothing pending made %d sendto calls", after.TxKicks-before.TxKicks)
	}
	if s.fill.needsWakeup() {
		t.Log("the fill ring's need-wakeup flag is set in copy mode")
	} else if after.RxWakeups != 0 {
		t.Errorf("fill ring flag clear, yet %d recvfrom calls", after.RxWakeups)
	}
}

// TestBusyPollOptions: a socket opened with BusyPoll carries the three
// options of preferred busy polling, Drive polls the queue with recvfrom
// when the RX ring is empty, and frames still arrive when Drive is all
// the caller does. On veth in copy mode the socket never learns a NAPI
// id, so there is nothing to busy-poll (FINDINGS 4): frames arrive through
// the sender's softirq as without the options.
func TestBusyPollOptions(t *testing.T) {
	e := newEnv(t, 1)
	cfg := DefaultConfig()
	cfg.BusyPoll = 20 * time.Microsecond
	cfg.BusyPollBudget = 32
	s := e.open(t, 0, cfg)
	if !s.BusyPolling() {
		t.Fatal("BusyPolling false")
	}
	for _, o := range []struct {
		name string
		opt  int
		want int
	}{{"SO_PREFER_BUSY_POLL", unix.SO_PREFER_BUSY_POLL, 1}, {"SO_BUSY_POLL", unix.SO_BUSY_POLL, 20}} {
		got, err := unix.GetsockoptInt(s.FD(), unix.SOL_SOCKET, o.opt)
		if err != nil || got != o.want {
			t.Errorf("%s = %d, %v; want %d", o.name, got, err, o.want)
		}
	}
	s.Refill()
	if s.Drive() {
		t.Fatal("Drive found frames on an idle queue")
	}
	if st, _ := s.Stats(); st.RxWakeups != 1 {
		t.Errorf("Drive on an empty ring made %d recvfrom calls, want 1", st.RxWakeups)
	}
	peer := e.udpB(t, 0)
	const count = 50
	for i := range count {
		peer.WriteToUDP([]byte{byte(i)}, &net.UDPAddr{IP: ipA, Port: 9})
	}
	got := 0
	buf := make([]Desc, 64)
	waitUntil(0, 3*time.Second, func() bool {
		if s.Drive() {
			n := s.Receive(buf)
			for _, d := range buf[:n] {
				s.Release(d)
			}
			got += n
			s.Refill()
		}
		return got >= count
	})
	st, _ := s.Stats()
	if got != count {
		t.Fatalf("received %d of %d frames by Drive alone (stats %+v)", got, count, st)
	}
	t.Logf("NAPI id %d, %d recvfrom calls", st.NAPIID, st.RxWakeups)
}
