package feed

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/sink"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

func TestParseList(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []Kind
		err  bool
	}{
		{"", []Kind{NIC}, false},
		{"nic", []Kind{NIC}, false},
		{"pod", []Kind{Pod}, false},
		{"nic,pod,nic", []Kind{NIC, Pod}, false},
		{" pod , nic", []Kind{Pod, NIC}, false},
		{"skb", nil, true},
	} {
		got, err := ParseList(c.in)
		if (err != nil) != c.err || !slices.Equal(got, c.want) {
			t.Errorf("ParseList(%q) = %v, %v; want %v, error %v", c.in, got, err, c.want, c.err)
		}
	}
	if NIC.TxIface() != topo.FeedTxIface || Pod.TxIface() != topo.GenIface {
		t.Errorf("TxIface: nic %s, pod %s", NIC.TxIface(), Pod.TxIface())
	}
	if !NIC.TopoOptions().FeedPair || Pod.TopoOptions().FeedPair {
		t.Error("only the NIC feed needs the feed pair")
	}
	d := NIC.Describe(topo.Plan{GenCPU: 0, ForwardCPU: 1})
	for _, want := range []string{"CPU 0 runs the generator and gr's NAPI", "CPU 1 runs n0's NAPI", "XDP frames"} {
		if !strings.Contains(d, want) {
			t.Errorf("NIC description lacks %q: %s", want, d)
		}
	}
}

// TestNICFeedSmoke: with the NIC feed, the generator's frames reach n0 as
// XDP frames: the sink's XDP program on n0 counts every one, and the
// kernel says they came through ndo_xdp_xmit (the xdp_xmit counter of the
// veth pair), not as skbs.
func TestNICFeedSmoke(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, XDP)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	tp, err := topo.New(NIC.TopoOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tp.Close(); err != nil {
			t.Error(err)
		}
	})
	f, err := Setup(tp, NIC, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if len(f.Threads) == 0 {
		t.Fatal("no NAPI kthread for gr")
	}
	var sk *sink.Sink
	if err := testbed.DoIn(tp.Node, func() (err error) {
		sk, err = sink.Attach(tp.NodeInIdx, sink.Native)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sk.Close()
	// Frames g0 handed to n0 through ndo_xdp_xmit.
	xmit := func() uint64 {
		t.Helper()
		st, err := testbed.EthtoolStats(tp.Gen, topo.GenIface)
		if err != nil {
			t.Fatal(err)
		}
		v, ok := st["tx_queue_0_xdp_xmit"]
		if !ok {
			t.Fatalf("no tx_queue_0_xdp_xmit in %s's statistics: %v", topo.GenIface, st)
		}
		return v
	}
	send := func(ifindex int, count uint64) pktgen.Result {
		t.Helper()
		var res pktgen.Result
		err := testbed.DoIn(tp.Gen, func() error {
			tpl, err := pktgen.NewTemplate(pktgen.FrameSpec{
				Proto: pktgen.UDP, Size: 64, Flows: 100, DstPort: 9,
				SrcMAC: tp.GenMAC, DstMAC: tp.NodeInMAC, Src: topo.FlowSource, Dst: topo.SinkAddrs[0],
			})
			if err != nil {
				return err
			}
			s, err := pktgen.OpenAFXDP(ifindex, 0, tpl)
			if err != nil {
				return err
			}
			defer s.Close()
			res, err = s.Send(pktgen.Budget{Rate: 50_000, Count: count, Duration: 2 * time.Second}, nil)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if res.Sent != count {
			t.Fatalf("generator sent %d of %d", res.Sent, count)
		}
		time.Sleep(200 * time.Millisecond)
		return res
	}

	const count = 5000
	x0, c0 := xmit(), read(t, sk)
	send(tp.FeedTxIndex, count)
	got := read(t, sk).Sub(c0).Packets
	// A shared machine may drop a few.
	if got < count*98/100 || got > count {
		t.Fatalf("n0's XDP program counted %d of %d frames", got, count)
	}
	if d := xmit() - x0; d < got {
		t.Fatalf("g0 sent %d frames through ndo_xdp_xmit, n0 received %d: the rest came as skbs", d, got)
	}

	// The pod feed's frames, sent on g0 itself, reach the same program
	// as skbs: the counter above tells the two apart.
	x0, c0 = xmit(), read(t, sk)
	send(tp.GenIndex, 1000)
	if got := read(t, sk).Sub(c0).Packets; got < 980 {
		t.Fatalf("n0's XDP program counted %d of 1000 frames sent on g0", got)
	}
	if d := xmit() - x0; d > 10 {
		t.Fatalf("%d frames sent on g0 went through ndo_xdp_xmit", d)
	}
}

func read(t *testing.T, sk *sink.Sink) sink.Counts {
	t.Helper()
	c, err := sk.Read()
	if err != nil {
		t.Fatal(err)
	}
	return c
}
