package runner

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/sink"
	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// TestSmokeKernelNFTPath is the short privileged check of the benchmark's
// parts on the real kernel: the topology, kube-proxy's nftables shape for
// 10 services, the AF_XDP generator and the XDP sink. Frames to a cluster
// IP reach the sink only if the rules DNAT them (the node has no route
// for the service range), so the count checks the rules too.
func TestSmokeKernelNFTPath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, XDP)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	tp, err := topo.New(topo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tp.Close(); err != nil {
			t.Error(err)
		}
	})
	set := Services(10, kernelrules.UDP)
	var rules bytes.Buffer
	if err := set.WriteNFT(&rules); err != nil {
		t.Fatal(err)
	}
	if err := tp.ExecInput(tp.Node, rules.Bytes(), time.Minute, "nft", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	var sk *sink.Sink
	if err := testbed.DoIn(tp.Sink, func() (err error) {
		sk, err = sink.Attach(tp.SinkIndex, sink.Native)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sk.Close()

	send := func(dst int, count uint64) pktgen.Result {
		t.Helper()
		var res pktgen.Result
		err := testbed.DoIn(tp.Gen, func() error {
			tpl, err := pktgen.NewTemplate(pktgen.FrameSpec{
				Proto: pktgen.UDP, Size: 64, Flows: 100, DstPort: set.Port(dst),
				SrcMAC: tp.GenMAC, DstMAC: tp.NodeInMAC, Src: topo.FlowSource, Dst: set.VIP(dst),
			})
			if err != nil {
				return err
			}
			s, err := pktgen.OpenAFXDP(tp.GenIndex, 0, tpl)
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
		return res
	}
	before, _ := sk.Read()
	res := send(3, 5000)
	time.Sleep(200 * time.Millisecond)
	after, err := sk.Read()
	if err != nil {
		t.Fatal(err)
	}
	got := after.Sub(before)
	if res.Sent != 5000 {
		t.Fatalf("generator sent %d of 5000", res.Sent)
	}
	// A shared machine may drop a few; DNAT failing drops all.
	if got.Packets < 4900 || got.Packets > 5000 {
		t.Fatalf("sink counted %d of %d frames sent to a cluster IP", got.Packets, res.Sent)
	}
	if got.Bytes != got.Packets*60 {
		t.Fatalf("sink counted %d bytes for %d 64-byte frames", got.Bytes, got.Packets)
	}

	// Without rules the same frames go nowhere: the count above was the
	// rules' doing.
	if _, err := tp.Exec(tp.Node, "nft", "delete", "table", "ip", kernelrules.NFTTable); err != nil {
		t.Fatal(err)
	}
	before, _ = sk.Read()
	send(3, 1000)
	time.Sleep(100 * time.Millisecond)
	after, _ = sk.Read()
	if n := after.Sub(before).Packets; n != 0 {
		t.Fatalf("%d frames reached the sink without rules", n)
	}
}

// TestSmokeThreadedNAPI checks that the forwarding work can be found and
// pinned: with GRO on, each of the node's veths gets a NAPI kthread when
// threaded mode is on, and SetThreaded finds it (the kernel's netlink dump
// alone misses the second one).
func TestSmokeThreadedNAPI(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	tp, err := topo.New(topo.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.Close() })
	for _, ifc := range []string{topo.NodeInIface, topo.NodeOutIface} {
		if err := tp.SetOffload(tp.Node, ifc, "gro", true); err != nil {
			t.Fatal(err)
		}
		pids, err := tp.SetThreaded(tp.Node, ifc)
		if err != nil || len(pids) != 1 {
			t.Fatalf("%s: threads %v, err %v", ifc, pids, err)
		}
		if err := topo.Pin(0, pids...); err != nil {
			t.Fatal(err)
		}
	}
}
