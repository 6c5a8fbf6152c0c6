package xdp

import (
	"testing"
	"time"

	"github.com/google/gopacket/layers"
)

// TestSYNGuard runs the program on SYNs with the guard on: a tuple's first
// SYN is dropped, a retransmission inside the window goes to the socket,
// one sooner than the minimum retry or after the window is a first SYN
// again; segments without SYN, SYN-ACKs, replies and non-frontends are
// untouched, and turning the guard off lets every SYN through.
func TestSYNGuard(t *testing.T) {
	o, a := newTestInstance(t)
	if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	const minRetry, window = 100 * time.Millisecond, 600 * time.Millisecond
	if err := o.SetSYNGuard(SYNGuard{On: true, MinRetry: minRetry, Window: window}); err != nil {
		t.Fatal(err)
	}
	guarded := Counters{SYNGuardDropped: 1}
	run := func(what string, frame []byte, want uint32, wantC Counters) {
		t.Helper()
		ret, got := runFrame(t, o, a, frame)
		if ret != want || got != wantC {
			t.Errorf("%s: verdict %d, counters %+v; want %d, %+v", what, ret, got, want, wantC)
		}
	}
	syn := tcp4(t, client4, 40000, vip4, 80)
	start := time.Now()
	run("first SYN", syn, xdpDrop, guarded)
	run("SYN again at once", syn, xdpDrop, guarded)
	time.Sleep(minRetry + 20*time.Millisecond - time.Since(start))
	last := time.Now()
	if time.Since(start) < window {
		run("retransmitted SYN", syn, xdpRedirect, wantCounters(frontend, true))
	}
	// The window counts from the SYN before: a second retransmission
	// later than the first SYN's window is let in while it is within the
	// first retransmission's (the client's entry stays the youngest).
	time.Sleep(window + 50*time.Millisecond - time.Since(start))
	if time.Since(last) < window-50*time.Millisecond {
		run("second retransmission", syn, xdpRedirect, wantCounters(frontend, true))
		last = time.Now()
	}
	time.Sleep(window + 50*time.Millisecond - time.Since(last))
	run("SYN after the window", syn, xdpDrop, guarded)

	other := tcp4(t, client4, 40001, vip4, 80)
	run("another tuple's first SYN", other, xdpDrop, guarded)

	ack := serialize(t, eth(layers.EthernetTypeIPv4), ip4(client4, vip4, layers.IPProtocolTCP),
		&layers.TCP{SrcPort: 40002, DstPort: 80, ACK: true, Window: 1024})
	run("ACK to a frontend", ack, xdpRedirect, wantCounters(frontend, true))
	synAck := serialize(t, eth(layers.EthernetTypeIPv4), ip4(client4, vip4, layers.IPProtocolTCP),
		&layers.TCP{SrcPort: 40003, DstPort: 80, SYN: true, ACK: true, Window: 1024})
	run("SYN-ACK to a frontend", synAck, xdpRedirect, wantCounters(frontend, true))
	run("UDP to a frontend", udp4(t, client4, 40004, vip4, 53), xdpRedirect, wantCounters(frontend, true))
	run("reply in flows", tcp4(t, backend4, 8080, client4, 12345), xdpRedirect, wantCounters(flow, true))
	run("SYN to the node's own port", tcp4(t, client4, 40005, node4, 22), xdpPass, wantCounters(passed, true))
	run("IPv6 first SYN", tcp6(t, client6, 40006, vip6, 443), xdpDrop, guarded)

	if err := o.SetSYNGuard(SYNGuard{}); err != nil {
		t.Fatal(err)
	}
	run("first SYN, guard off", tcp4(t, client4, 40007, vip4, 80), xdpRedirect, wantCounters(frontend, true))

	if err := o.SetSYNGuard(SYNGuard{On: true, MinRetry: time.Second, Window: time.Second}); err == nil {
		t.Error("SetSYNGuard took a window no longer than its minimum retry")
	}
	if err := o.SetSYNGuard(SYNGuard{On: true, MinRetry: time.Second, Window: 70 * time.Second}); err == nil {
		t.Error("SetSYNGuard took a window longer than its table's clock can tell (68.7 s)")
	}
}
