package nat

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestNoAllocations holds every per-packet function to zero allocations.
func TestNoAllocations(t *testing.T) {
	tcp := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn, payload: make([]byte, 100)}
	udp := frameSpec{proto: packet.ProtoUDP, src: client6, dst: vip6, sport: 40000, dport: 53, payload: make([]byte, 100)}
	icmpErr := icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 3,
		inner: frameSpec{proto: packet.ProtoUDP, src: node, dst: backend, sport: 61000, dport: 8080, payload: make([]byte, 64)}}

	frame := tcp.build(t)
	orig := append([]byte(nil), frame...)
	buf := make([]byte, 2048)
	var p packet.Packet
	there := packet.Tuple{Src: packet.AddrFromNetip(node), Dst: packet.AddrFromNetip(backend), SrcPort: 61000, DstPort: 8080}
	back := tcp.tuple()
	reparse := func(f []byte) {
		if r := packet.Parse(f, &p); r != packet.OK {
			t.Fatal(r)
		}
	}
	reparse(frame)
	udpFrame := udp.build(t)
	var up packet.Packet
	packet.Parse(udpFrame, &up)
	errFrame := icmpErr.build(t)
	var ep packet.Packet
	packet.Parse(errFrame, &ep)
	a, b := packet.AddrFromNetip(client), packet.AddrFromNetip(vip)
	c, d := packet.AddrFromNetip(node), packet.AddrFromNetip(backend)

	cases := map[string]func(){
		"Checksum": func() { Checksum(frame, 0) },
		"Rewrite": func() {
			Rewrite(frame, &p, there)
			Rewrite(frame, &p, back)
		},
		"RewriteSrc+RewriteDst": func() {
			RewriteSrc(frame, &p, c, 61000)
			RewriteDst(frame, &p, d, 8080)
			RewriteSrc(frame, &p, a, 40000)
			RewriteDst(frame, &p, b, 80)
		},
		"Rewrite IPv6 UDP": func() {
			RewriteDst(udpFrame, &up, packet.AddrFromNetip(backend6), 5353)
			RewriteDst(udpFrame, &up, packet.AddrFromNetip(vip6), 53)
		},
		"DecrementTTL":      func() { DecrementTTL(frame, &p) },
		"CompleteIfPartial": func() { CompleteIfPartial(frame, &p) },
		"ValidL4":           func() { ValidL4(frame, &p) },
		"TranslateICMPError": func() {
			TranslateICMPError(errFrame, &ep, b, a, a, b, 40000, 80)
			TranslateICMPError(errFrame, &ep, d, c, c, d, 61000, 8080)
		},
		"BuildTCPReset": func() {
			copy(frame, orig)
			reparse(frame)
			BuildTCPReset(frame, &p)
		},
		"BuildICMPUnreachable": func() {
			copy(buf, orig)
			reparse(buf[:len(orig)])
			BuildICMPUnreachable(buf, len(orig), &p, 3)
		},
	}
	for name, f := range cases {
		if n := testing.AllocsPerRun(200, f); n != 0 {
			t.Errorf("%s: %v allocations per run", name, n)
		}
		copy(frame, orig)
		reparse(frame)
	}
}

func BenchmarkChecksum1500(b *testing.B) {
	buf := make([]byte, 1500)
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		Checksum(buf, 0)
	}
}

// benchRewrite rewrites one frame back and forth between two tuples, so
// every iteration changes what it claims to change.
func benchRewrite(b *testing.B, s frameSpec, to packet.Tuple) {
	frame := s.build(b)
	var p packet.Packet
	if r := packet.Parse(frame, &p); r != packet.OK {
		b.Fatal(r)
	}
	from := p.Tuple()
	b.ReportAllocs()
	for b.Loop() {
		Rewrite(frame, &p, to)
		Rewrite(frame, &p, from)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(2*b.N), "ns/rewrite")
}

func BenchmarkRewriteTCPv4DNAT(b *testing.B) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, payload: make([]byte, 1400)}
	to := s.tuple()
	to.Dst, to.DstPort = packet.AddrFromNetip(backend), 8080
	benchRewrite(b, s, to)
}

func BenchmarkRewriteUDPv4DNATSNAT(b *testing.B) {
	s := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 53, payload: make([]byte, 100)}
	benchRewrite(b, s, packet.Tuple{Src: packet.AddrFromNetip(node), Dst: packet.AddrFromNetip(backend), SrcPort: 61000, DstPort: 5353})
}

func BenchmarkRewriteTCPv6DNATSNAT(b *testing.B) {
	s := frameSpec{proto: packet.ProtoTCP, src: client6, dst: vip6, sport: 40000, dport: 80, payload: make([]byte, 1400)}
	benchRewrite(b, s, packet.Tuple{Src: packet.AddrFromNetip(node6), Dst: packet.AddrFromNetip(backend6), SrcPort: 61000, DstPort: 8080})
}

func BenchmarkCompleteIfPartialTCP1400(b *testing.B) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, payload: make([]byte, 1400)}
	want := s.build(b)
	part := partial(s, want)
	frame := append([]byte(nil), part...)
	var p packet.Packet
	packet.Parse(frame, &p)
	b.ReportAllocs()
	for b.Loop() {
		copy(frame[p.L4+16:p.L4+18], part[p.L4+16:])
		CompleteIfPartial(frame, &p)
	}
}

func BenchmarkCompleteIfPartialNotPartial(b *testing.B) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, payload: make([]byte, 1400)}
	frame := s.build(b)
	var p packet.Packet
	packet.Parse(frame, &p)
	b.ReportAllocs()
	for b.Loop() {
		CompleteIfPartial(frame, &p)
	}
}

func BenchmarkTranslateICMPError(b *testing.B) {
	e := icmpErrorSpec{outerSrc: backend, outerDst: node, typ: 3, code: 4, rest: 1400,
		inner: frameSpec{proto: packet.ProtoTCP, src: node, dst: backend, sport: 61000, dport: 8080, payload: make([]byte, 500)}}
	frame := e.build(b)
	var p packet.Packet
	packet.Parse(frame, &p)
	a, v := packet.AddrFromNetip(client), packet.AddrFromNetip(vip)
	n, bk := packet.AddrFromNetip(node), packet.AddrFromNetip(backend)
	b.ReportAllocs()
	for b.Loop() {
		TranslateICMPError(frame, &p, v, a, a, v, 40000, 80)
		TranslateICMPError(frame, &p, bk, n, n, bk, 61000, 8080)
	}
}

func BenchmarkBuildTCPReset(b *testing.B) {
	s := frameSpec{proto: packet.ProtoTCP, src: client, dst: vip, sport: 40000, dport: 80, tcpFlags: packet.TCPSyn}
	orig := s.build(b)
	frame := make([]byte, len(orig))
	var p packet.Packet
	b.ReportAllocs()
	for b.Loop() {
		copy(frame, orig)
		packet.Parse(frame, &p)
		BuildTCPReset(frame, &p)
	}
}

func BenchmarkBuildICMPUnreachable(b *testing.B) {
	s := frameSpec{proto: packet.ProtoUDP, src: client, dst: vip, sport: 40000, dport: 53, payload: make([]byte, 100)}
	orig := s.build(b)
	buf := make([]byte, 2048)
	var p packet.Packet
	b.ReportAllocs()
	for b.Loop() {
		copy(buf, orig)
		packet.Parse(buf[:len(orig)], &p)
		BuildICMPUnreachable(buf, len(orig), &p, 3)
	}
}
