package xdp

import (
	"bufio"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// A FlowKey is a packet.Tuple by conversion; this fails to compile if the
// two drift apart.
var _ = FlowKey(packet.Tuple{})

// flowKeys returns n distinct replies from backend4:8080 to clients in
// 198.19.0.0/16, numbered from from.
func flowKeys(n, from int) []FlowKey {
	ks := make([]FlowKey, n)
	for i := range ks {
		j := from + i
		ks[i] = FlowKey{
			Src: packet.MustParseAddr(backend4), Dst: packet.AddrFrom4([4]byte{198, 19, byte(j >> 8), byte(j)}),
			SrcPort: 8080, DstPort: uint16(1024 + j>>16), Proto: packet.ProtoTCP,
		}
	}
	return ks
}

// flowSet reads the flows table through ForEachFlow, failing on a flow
// seen twice.
func flowSet(t *testing.T, o *Objects) map[FlowKey]bool {
	t.Helper()
	set := map[FlowKey]bool{}
	var dup error
	err := o.ForEachFlow(func(k FlowKey) bool {
		if set[k] {
			dup = fmt.Errorf("flow %v seen twice", k)
		}
		set[k] = true
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	if dup != nil {
		t.Fatal(dup)
	}
	return set
}

func sameFlows(got map[FlowKey]bool, want []FlowKey) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d flows, want %d", len(got), len(want))
	}
	for _, k := range want {
		if !got[k] {
			return fmt.Errorf("flow %v missing", k)
		}
	}
	return nil
}

func loadFlows(t *testing.T, maxFlows int) *Objects {
	t.Helper()
	requireRoot(t)
	o, err := Load(Options{MaxFrontends: 4, MaxAddrs: 4, MaxFlows: maxFlows})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

func addAll(t *testing.T, w *FlowWriter, ks []FlowKey) {
	t.Helper()
	for _, k := range ks {
		if !w.Add(k) {
			t.Fatalf("Add(%v) with %d buffered: full", k, w.Len())
		}
	}
}

func TestFlowWriter(t *testing.T) {
	o := loadFlows(t, 64)
	w := o.NewFlowWriter(4)
	ks := flowKeys(4, 0)
	addAll(t, w, ks)
	if w.Add(flowKeys(1, 4)[0]) {
		t.Error("Add accepted a fifth flow into a buffer of 4")
	}
	if got := flowSet(t, o); len(got) != 0 {
		t.Errorf("Add alone wrote %d flows", len(got))
	}
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if w.Len() != 0 {
		t.Errorf("%d flows buffered after Flush", w.Len())
	}
	if err := sameFlows(flowSet(t, o), ks); err != nil {
		t.Errorf("after Flush: %v", err)
	}
	if _, err := w.Flush(); err != nil {
		t.Errorf("Flush of nothing: %v", err)
	}

	// A flow written again is still one entry.
	addAll(t, w, ks[:2])
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := sameFlows(flowSet(t, o), ks); err != nil {
		t.Errorf("after writing two again: %v", err)
	}

	// Missing keys are skipped, including the first and the last.
	gone := append(flowKeys(1, 100), ks[1], ks[3])
	gone = append(gone, flowKeys(1, 101)...)
	if err := o.DeleteFlows(gone); err != nil {
		t.Fatalf("DeleteFlows with missing keys: %v", err)
	}
	if err := sameFlows(flowSet(t, o), []FlowKey{ks[0], ks[2]}); err != nil {
		t.Errorf("after DeleteFlows: %v", err)
	}
	if err := o.DeleteFlows(nil); err != nil {
		t.Errorf("DeleteFlows(nil): %v", err)
	}

	calls := 0
	if err := o.ForEachFlow(func(FlowKey) bool { calls++; return false }); err != nil || calls != 1 {
		t.Errorf("ForEachFlow whose fn stops at once: %d calls, %v", calls, err)
	}

	// The paths for kernels without batch operations, on the flows map
	// alone (no reply slots).
	w.batch, w.replies = false, nil
	more := flowKeys(3, 10)
	addAll(t, w, more)
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	iterated := map[FlowKey]bool{}
	if err := o.iterateFlows(func(k FlowKey) bool { iterated[k] = true; return true }); err != nil {
		t.Fatal(err)
	}
	if err := sameFlows(iterated, more); err != nil {
		t.Errorf("per-key Flush, read by iterating: %v", err)
	}
	if err := sameFlows(flowSet(t, o), append([]FlowKey{ks[0], ks[2]}, more...)); err != nil {
		t.Errorf("slots and map together: %v", err)
	}
}

// TestFlowWriterFlushDoesNotAllocate holds the per-batch cost of a worker
// at one system call and no garbage.
func TestFlowWriterFlushDoesNotAllocate(t *testing.T) {
	o := loadFlows(t, 4096)
	w := o.NewFlowWriter(64)
	for _, n := range []int{1, 64} {
		ks := flowKeys(n, 0)
		allocs := testing.AllocsPerRun(100, func() {
			for _, k := range ks {
				w.Add(k)
			}
			if _, err := w.Flush(); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("Add and Flush of %d flows: %v allocations, want 0", n, allocs)
		}
	}
}

// TestFlowTableFullRefuses: the table never evicts a live flow's reply; a
// Flush into a full table writes what fits and says how many, so the worker
// knows which connections could not be published.
func TestFlowTableFullRefuses(t *testing.T) {
	const size = 256
	o := loadFlows(t, size)
	w := o.NewFlowWriter(32)
	var written []FlowKey
	refused := false
	// The reply slots hold at least size more than the map, and as many
	// as every set's ways when the keys spread evenly: enough keys for
	// both, and more.
	for i := 0; i < 4*size+replyWays*replySets(size) && !refused; i += 32 {
		ks := flowKeys(32, i)
		addAll(t, w, ks)
		n, err := w.Flush()
		written = append(written, ks[:n]...)
		if err != nil {
			if n == len(ks) {
				t.Fatalf("Flush failed but wrote all %d: %v", n, err)
			}
			refused = true
		}
	}
	if !refused {
		t.Fatalf("wrote %d flows into a map of %d and its slots without an error", len(written), size)
	}
	got := flowSet(t, o)
	if err := sameFlows(got, written); err != nil {
		t.Errorf("after filling: %v (every flow Flush counted as written must be there, no other)", err)
	}
	// Room again after deletions, where those flows were (a slot of
	// their set, or the map).
	if err := o.DeleteFlows(written[:10]); err != nil {
		t.Fatal(err)
	}
	addAll(t, w, written[:10])
	if n, err := w.Flush(); n != 10 || err != nil {
		t.Errorf("Flush of 10 after deleting 10: %d written, %v", n, err)
	}
}

// TestFlowWritersConcurrent runs one FlowWriter per goroutine, as the
// workers do, while another goroutine deletes and reads flows and the
// program looks them up. Run it with -race.
func TestFlowWritersConcurrent(t *testing.T) {
	const (
		writers   = 6
		perWriter = 1000
		batch     = 32
	)
	o := loadFlows(t, 64*1024)
	inst, err := o.newInstance(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.close() })
	// Flows another goroutine deletes while the writers write.
	doomed := flowKeys(500, 50000)
	w0 := o.NewFlowWriter(len(doomed))
	addAll(t, w0, doomed)
	if _, err := w0.Flush(); err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	errs := make(chan error, writers+1)
	for g := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := o.NewFlowWriter(batch)
			for _, k := range flowKeys(perWriter, g*perWriter) {
				if !w.Add(k) {
					if _, err := w.Flush(); err != nil {
						errs <- err
						return
					}
					w.Add(k)
				}
			}
			if _, err := w.Flush(); err != nil {
				errs <- err
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; i < len(doomed); i += 50 {
			if err := o.DeleteFlows(doomed[i : i+50]); err != nil {
				errs <- err
				return
			}
			if err := o.ForEachFlow(func(FlowKey) bool { return true }); err != nil {
				errs <- err
				return
			}
		}
	}()
	// The program looks flows up while they are written; afterwards the
	// reply of the first writer's last flow must match.
	frame := tcp4(t, backend4, 8080, "198.19.3.231", 1024) // flowKeys(1, 999)
	for range 200 {
		if _, err := inst.prog.Run(&ebpf.RunOptions{Data: frame}); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	want := flowKeys(writers*perWriter, 0)
	if err := sameFlows(flowSet(t, o), want); err != nil {
		t.Errorf("after %d writers of %d flows each: %v", writers, perWriter, err)
	}
	before, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inst.prog.Run(&ebpf.RunOptions{Data: frame}); err != nil {
		t.Fatal(err)
	}
	after, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if d := after.minus(before); d.MatchFlow != 1 {
		t.Errorf("reply %v: counters changed by %+v, want a flow match", want[999], d)
	}
}

func TestFlowKeyLayout(t *testing.T) {
	k := FlowKey{Src: packet.MustParseAddr(backend4), Dst: packet.MustParseAddr(client4),
		SrcPort: 8080, DstPort: 443, Proto: packet.ProtoTCP}
	b := k.flowKey()
	if b.Sport != networkOrder16(8080) || b.Dport != networkOrder16(443) || b.Pad != [3]uint8{} {
		t.Errorf("key %+v: ports not in network order or pad set", b)
	}
	if got := b.public(); got != k {
		t.Errorf("round trip %v -> %v", k, got)
	}
}

// TestDirectTrafficToEndpoint is what the flows table is for: a client
// talks to a pod directly, not through a service (Prometheus scraping an
// endpoint), and the pod's replies must reach the client's kernel
// sockets. Only the replies of a flow xdproxy wrote go to its sockets.
// Namespace a is the node with xdproxy on a0, b is the pod 198.18.0.2.
func TestDirectTrafficToEndpoint(t *testing.T) {
	requireRoot(t)
	for _, mode := range []Mode{Native, Generic} {
		t.Run(mode.String(), func(t *testing.T) {
			a, b := vethPair(t)
			o := loadSmall(t)
			pod := packet.MustParseAddr("198.18.0.2")
			node := packet.MustParseAddr("198.18.0.1")
			_, socks := attachWithSockets(t, o, a, "a0", mode)

			// The pod: an HTTP-like TCP server and a UDP echo server.
			var ln net.Listener
			var echo net.PacketConn
			if err := inNetns(b, func() (err error) {
				if ln, err = net.Listen("tcp4", "198.18.0.2:8080"); err != nil {
					return err
				}
				echo, err = net.ListenPacket("udp4", "198.18.0.2:5353")
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			defer echo.Close()
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					c.Write([]byte("HTTP/1.0 200 OK\r\n"))
					c.Close()
				}
			}()
			go func() {
				buf := make([]byte, 100)
				for {
					n, from, err := echo.ReadFrom(buf)
					if err != nil {
						return
					}
					echo.WriteTo(buf[:n], from)
				}
			}()

			// Two UDP clients on the node: one stands for a connection
			// xdproxy opened, the other talks to the pod directly.
			var viaProxy, direct net.PacketConn
			if err := inNetns(a, func() (err error) {
				if viaProxy, err = net.ListenPacket("udp4", "198.18.0.1:0"); err != nil {
					return err
				}
				direct, err = net.ListenPacket("udp4", "198.18.0.1:0")
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer viaProxy.Close()
			defer direct.Close()
			w := o.NewFlowWriter(1)
			w.Add(FlowKey{Src: pod, Dst: node, SrcPort: 5353,
				DstPort: uint16(viaProxy.LocalAddr().(*net.UDPAddr).Port), Proto: packet.ProtoUDP})
			if _, err := w.Flush(); err != nil {
				t.Fatal(err)
			}

			podEcho := &net.UDPAddr{IP: net.ParseIP("198.18.0.2"), Port: 5353}
			const sent = 10
			for range sent {
				if _, err := viaProxy.WriteTo([]byte("reply to xdproxy"), podEcho); err != nil {
					t.Fatal(err)
				}
			}
			got := receive(t, socks, sent, func(p *packet.Packet) bool { return p.SrcPort == 5353 })
			if got != sent {
				t.Errorf("xdproxy's sockets received %d of %d replies of its flow", got, sent)
			}
			viaProxy.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			if n, _, err := viaProxy.ReadFrom(make([]byte, 100)); err == nil {
				t.Errorf("the kernel delivered a %d-byte reply of xdproxy's flow", n)
			}

			// Direct traffic to the same endpoint ports: the kernel's.
			if _, err := direct.WriteTo([]byte("direct"), podEcho); err != nil {
				t.Fatal(err)
			}
			direct.SetReadDeadline(time.Now().Add(3 * time.Second))
			if n, _, err := direct.ReadFrom(make([]byte, 100)); err != nil || n != len("direct") {
				t.Errorf("direct UDP to the endpoint: %d bytes, %v", n, err)
			}
			var status string
			err := inNetns(a, func() error {
				c, err := net.DialTimeout("tcp4", "198.18.0.2:8080", 3*time.Second)
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(3 * time.Second))
				status, err = bufio.NewReader(c).ReadString('\n')
				return err
			})
			if err != nil || status != "HTTP/1.0 200 OK\r\n" {
				t.Errorf("direct TCP to the endpoint: %q, %v", status, err)
			}

			c, err := o.Counters()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%v: %+v", mode, c)
			if c.MatchFlow != sent || c.Redirected != sent || c.Passed == 0 {
				t.Errorf("counters %+v: want the %d replies of the flow redirected, the rest passed", c, sent)
			}
		})
	}
}
