package pktgen

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
)

func testSpec(p Proto, flows int) FrameSpec {
	return FrameSpec{
		Proto: p, Size: 64, Flows: flows, Dsts: 3, DstPort: 80,
		SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2},
		Src: netip.MustParseAddr("198.18.0.16"), Dst: netip.MustParseAddr("198.19.0.1"),
	}
}

// TestFramesDecodeWithValidChecksums builds frames for flows that cross a
// source-address boundary and checks every header and checksum with
// gopacket, which recomputes checksums independently.
func TestFramesDecodeWithValidChecksums(t *testing.T) {
	for _, p := range []Proto{UDP, TCPSyn, TCPAck} {
		tpl, err := NewTemplate(testSpec(p, 200_000))
		if err != nil {
			t.Fatal(err)
		}
		if tpl.Len() != 60 {
			t.Fatalf("64-byte frame is %d bytes without FCS, want 60", tpl.Len())
		}
		buf := make([]byte, tpl.Len())
		for _, f := range []uint64{0, 1, SourcePorts - 1, SourcePorts, 199_999, 200_000} {
			tpl.Write(buf, f)
			pkt := gopacket.NewPacket(buf, layers.LayerTypeEthernet, gopacket.Default)
			ip, _ := pkt.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
			if ip == nil {
				t.Fatalf("%v flow %d: no IPv4 layer: %v", p, f, pkt.ErrorLayer())
			}
			wantSrc, wantPort, wantDst := tpl.Flow(f)
			if got, _ := netip.AddrFromSlice(ip.SrcIP); got != wantSrc {
				t.Fatalf("%v flow %d: src %v, want %v", p, f, got, wantSrc)
			}
			if got, _ := netip.AddrFromSlice(ip.DstIP); got != wantDst {
				t.Fatalf("%v flow %d: dst %v, want %v", p, f, got, wantDst)
			}
			ipCopy := *ip
			ipCopy.Checksum = 0
			sb := gopacket.NewSerializeBuffer()
			if err := ipCopy.SerializeTo(sb, gopacket.SerializeOptions{ComputeChecksums: true}); err != nil {
				t.Fatal(err)
			}
			var re layers.IPv4
			if err := re.DecodeFromBytes(sb.Bytes(), gopacket.NilDecodeFeedback); err != nil {
				t.Fatal(err)
			}
			if re.Checksum != ip.Checksum {
				t.Fatalf("%v flow %d: IP checksum %#x, want %#x", p, f, ip.Checksum, re.Checksum)
			}
			checkL4(t, p, f, buf, ip, wantPort)
		}
	}
}

func checkL4(t *testing.T, p Proto, f uint64, buf []byte, ip *layers.IPv4, wantPort uint16) {
	t.Helper()
	// The one's complement sum over pseudo header and segment, checksum
	// included, is 0xffff exactly when the checksum is right.
	seg := buf[l4Off:]
	s := sum16(ip.SrcIP.To4(), 0)
	s = sum16(ip.DstIP.To4(), s)
	s += uint32(ip.Protocol) + uint32(len(seg))
	if got := fold(sum16(seg, s)); got != 0xffff {
		t.Fatalf("%v flow %d: L4 checksum does not verify (sum %#x)", p, f, got)
	}
	switch p {
	case UDP:
		udp := gopacket.NewPacket(buf, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeUDP).(*layers.UDP)
		if uint16(udp.SrcPort) != wantPort || udp.DstPort != 80 || int(udp.Length) != len(seg) {
			t.Fatalf("udp %+v", udp)
		}
	default:
		tcp := gopacket.NewPacket(buf, layers.LayerTypeEthernet, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
		if uint16(tcp.SrcPort) != wantPort || tcp.DstPort != 80 || tcp.SYN != (p == TCPSyn) || tcp.ACK != (p == TCPAck) {
			t.Fatalf("tcp %+v", tcp)
		}
	}
}

func TestFlowsAreDistinct(t *testing.T) {
	tpl, err := NewTemplate(testSpec(UDP, 100_000))
	if err != nil {
		t.Fatal(err)
	}
	type key struct {
		src, dst netip.Addr
		port     uint16
	}
	seen := map[key]bool{}
	for f := uint64(0); f < 100_000; f++ {
		s, p, d := tpl.Flow(f)
		seen[key{s, d, p}] = true
	}
	if len(seen) != 100_000 {
		t.Fatalf("%d distinct tuples, want 100000", len(seen))
	}
	if tpl.SourceAddrs() != 2 {
		t.Fatalf("%d source addresses, want 2", tpl.SourceAddrs())
	}
	if s, _, _ := tpl.Flow(100_000); s != netip.MustParseAddr("198.18.0.16") {
		t.Fatalf("flow index does not wrap at Flows")
	}
}

func TestSpecValidation(t *testing.T) {
	bad := testSpec(UDP, 1)
	bad.Size = 63
	if _, err := NewTemplate(bad); err == nil {
		t.Fatal("63-byte frame accepted")
	}
	bad = testSpec(UDP, 0)
	if _, err := NewTemplate(bad); err == nil {
		t.Fatal("0 flows accepted")
	}
	bad = testSpec(UDP, 1)
	bad.DstMAC = nil
	if _, err := NewTemplate(bad); err == nil {
		t.Fatal("missing MAC accepted")
	}
	big := testSpec(TCPSyn, 1)
	big.Size = 1518
	tpl, err := NewTemplate(big)
	if err != nil || tpl.Len() != 1514 {
		t.Fatalf("1518-byte frame: len %d err %v", tpl.Len(), err)
	}
}

func TestWriteDoesNotAllocate(t *testing.T) {
	tpl, err := NewTemplate(testSpec(TCPSyn, 1_000_000))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, tpl.Len())
	var f uint64
	if a := testing.AllocsPerRun(1000, func() { tpl.Write(buf, f); f++ }); a != 0 {
		t.Fatalf("Write allocates %v times per frame", a)
	}
}

func BenchmarkWrite(b *testing.B) {
	tpl, _ := NewTemplate(testSpec(UDP, 1_000_000))
	buf := make([]byte, tpl.Len())
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		tpl.Write(buf, uint64(i))
	}
}

func TestPacerKeepsRateInBatches(t *testing.T) {
	p := newPacer(100_000, 10) // one batch every 100us
	if n, w := p.due(50 * time.Microsecond); n != 0 || w != 50*time.Microsecond {
		t.Fatalf("at 50us: due %d wait %v, want 0 and 50us", n, w)
	}
	n, _ := p.due(100 * time.Microsecond)
	if n != 10 {
		t.Fatalf("at 100us: due %d, want a batch of 10", n)
	}
	p.took(n)
	// 300us late: 30 owed, under the 40 allowed, so all are due.
	if n, _ := p.due(400 * time.Microsecond); n != 30 {
		t.Fatalf("at 400us: due %d, want 30", n)
	}
	// Far behind: the debt is forgiven down to one batch and counted.
	if n, _ := p.due(10 * time.Millisecond); n != 10 || p.late != 1 {
		t.Fatalf("at 10ms: due %d late %d, want 10 and 1", n, p.late)
	}
	if n, _ := newPacer(0, 64).due(0); n == 0 {
		t.Fatal("unpaced sender got nothing due")
	}
}

func TestBatchFor(t *testing.T) {
	for _, c := range []struct {
		rate float64
		want int
	}{{0, 64}, {10_000, 8}, {300_000, 30}, {5e6, 64}} {
		if got := batchFor(c.rate); got != c.want {
			t.Errorf("batchFor(%v) = %d, want %d", c.rate, got, c.want)
		}
	}
}
