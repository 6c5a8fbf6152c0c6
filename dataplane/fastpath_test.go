package dataplane

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// fastCase is one packet given to both paths.
type fastCase struct {
	name  string
	frame []byte
	// fast says whether fastV4 must take it (else it must leave it to the
	// general path untouched).
	fast bool
}

// TestFastPathMatchesGeneral: for packets of cached flows, the fast path
// writes exactly the bytes the general path (Parse, DecrementTTL,
// CompleteIfPartial, UpdateTCP, Rewrite) writes, and gives the same
// verdict; packets it must not take (a TTL about to expire, a partial
// checksum, IP options, a short or inconsistent length) it leaves
// untouched to the general path. Flows in both directions, DNAT only and
// masqueraded, TCP and UDP, random TTLs, payloads and checksums.
func TestFastPathMatchesGeneral(t *testing.T) {
	h := newHarness(t, testModel(), 1<<14)
	general := h.proc
	general.cacheOff = true
	fast := NewProcessor(general.cfg)
	fast.BeginBatch(1)
	rng := rand.New(rand.NewPCG(1, 2))
	const now = 5e9
	checked, taken := 0, 0
	for i := range 200 {
		client := podA
		if i%2 == 1 {
			client = outside // masqueraded
		}
		proto, vip, port, flags := packet.ProtoTCP, addr("198.19.0.10"), uint16(80), uint8(packet.TCPSyn)
		if i%4 >= 2 {
			proto, vip, port, flags = packet.ProtoUDP, addr("198.19.0.20"), 53, 0
		}
		sport := uint16(20000 + i)
		first := frame(t, proto, client, vip, sport, port, flags, nil)
		v := general.Process(first, now)
		if v.Action != Forward {
			t.Fatalf("flow %d: first packet %v/%v", i, v.Action, v.Reason)
		}
		out := parse(t, first[:v.Len])
		for dir := range 2 {
			src, dst, sp, dp := client, vip, sport, port
			if dir == 1 { // the backend's reply
				src, dst, sp, dp = out.Dst, out.Src, out.DstPort, out.SrcPort
			}
			ack := uint8(packet.TCPAck)
			if proto == packet.ProtoUDP {
				ack = 0
			}
			// Warm the fast processor's cache for this flow and direction.
			warm := frame(t, proto, src, dst, sp, dp, ack, []byte("warm"))
			if v := fast.Process(warm, now); v.Action != Forward {
				t.Fatalf("flow %d dir %d: warm-up %v/%v", i, dir, v.Action, v.Reason)
			}
			cases := fastCases(t, rng, proto, src, dst, sp, dp, ack)
			if proto == packet.ProtoUDP {
				// A UDP checksum the update turns into zero must be
				// sent as 0xffff: take the one that does (the
				// payload does not matter to an incremental update).
				f := frame(t, proto, src, dst, sp, dp, ack, []byte("zero"))
				fast.prepare(0, f)
				if pre := &fast.pre[0]; pre.way >= 0 {
					if d := fast.cache.sets[pre.set][pre.way].l4Delta; d != 0 {
						binary.BigEndian.PutUint16(f[34+6:], d)
						cases = append(cases, fastCase{"checksum comes out zero", f, true})
					}
				}
			}
			for _, c := range cases {
				a := append(make([]byte, 0, 2048), c.frame...)
				b := append(make([]byte, 0, 2048), c.frame...)
				va := general.Process(a, now)
				fast.prepare(0, b)
				pre := &fast.pre[0]
				if pre.way < 0 {
					if c.fast {
						t.Fatalf("flow %d dir %d %s: not in the flow cache", i, dir, c.name)
					}
				} else {
					s := &fast.cache.sets[pre.set][pre.way]
					if !h.ct.Revalidate(s.handle, s.stamp, now) {
						t.Fatalf("flow %d dir %d %s: cached flow not valid", i, dir, c.name)
					}
					vb, ok := fast.fastV4(b, s, now, false)
					if ok != c.fast {
						t.Fatalf("flow %d dir %d %s: fast path took it: %v, want %v", i, dir, c.name, ok, c.fast)
					}
					if !ok {
						if !bytes.Equal(b, c.frame) {
							t.Fatalf("flow %d dir %d %s: declined but changed the frame", i, dir, c.name)
						}
					} else {
						taken++
						if vb != va || fast.Destination() != general.Destination() {
							t.Fatalf("flow %d dir %d %s: verdict %+v to %v, general %+v to %v", i, dir, c.name,
								vb, fast.Destination(), va, general.Destination())
						}
						if !bytes.Equal(a[:va.Len], b[:vb.Len]) {
							t.Fatalf("flow %d dir %d %s:\nfast    %x\ngeneral %x", i, dir, c.name, b[:vb.Len], a[:va.Len])
						}
						checked++
						continue
					}
				}
				// Not fast: the worker's general path must agree too.
				vb := fast.process(b, now, pre)
				if vb != va || !bytes.Equal(a[:va.Len], b[:vb.Len]) {
					t.Fatalf("flow %d dir %d %s: general path through process differs", i, dir, c.name)
				}
				checked++
			}
		}
	}
	if taken < checked/2 {
		t.Errorf("the fast path took %d of %d packets", taken, checked)
	}
	t.Logf("%d packets compared, %d through the fast path", checked, taken)
}

// fastCases are packets of one flow direction: ordinary ones with random
// TTLs, payloads and IP ids (fast), and ones the fast path must decline.
func fastCases(t *testing.T, rng *rand.Rand, proto packet.Proto, src, dst packet.Addr, sp, dp uint16, flags uint8) []fastCase {
	var cs []fastCase
	mk := func(payload int) []byte {
		f := frame(t, proto, src, dst, sp, dp, flags, bytes.Repeat([]byte{byte(rng.IntN(256))}, payload))
		return f
	}
	setTTL := func(f []byte, ttl byte) {
		f[22] = ttl
		fixIPChecksum(f)
	}
	l4sum := 16
	if proto == packet.ProtoUDP {
		l4sum = 6
	}
	for range 6 {
		f := mk(rng.IntN(1400))
		setTTL(f, byte(2+rng.IntN(254)))
		f[18], f[19] = byte(rng.IntN(256)), byte(rng.IntN(256)) // IP id
		if rng.IntN(2) == 0 {
			f[20] |= 0x40 // don't fragment
		}
		fixIPChecksum(f)
		cs = append(cs, fastCase{"ordinary", f, true})
	}
	// A TCP checksum of 0xffff and, for UDP, no checksum at all.
	f := mk(10)
	if proto == packet.ProtoUDP {
		f[34+6], f[34+7] = 0, 0
		cs = append(cs, fastCase{"no UDP checksum", f, true})
	}
	// Ethernet padding after the IP packet.
	f = mk(0)
	f = append(f, make([]byte, 20)...)
	cs = append(cs, fastCase{"padded", f, true})

	f = mk(32)
	setTTL(f, 1)
	cs = append(cs, fastCase{"TTL 1", f, false})
	f = mk(32)
	var p packet.Packet
	packet.Parse(f, &p)
	ps := nat.Fold(nat.PseudoHeaderSum(p.Src, p.Dst, p.Proto, p.End-p.L4))
	binary.BigEndian.PutUint16(f[p.L4+l4sum:], ps)
	cs = append(cs, fastCase{"partial checksum", f, false})
	f = mk(32)
	binary.BigEndian.PutUint16(f[16:], uint16(len(f)-14+1)) // IP total length past the frame
	fixIPChecksum(f)
	cs = append(cs, fastCase{"total length too long", f, false})
	if proto == packet.ProtoTCP {
		f = mk(32)
		f[34+12] = 0xf0 // data offset 60 bytes, past the segment
		cs = append(cs, fastCase{"bad data offset", f, false})
	} else {
		f = mk(32)
		binary.BigEndian.PutUint16(f[34+4:], 4) // UDP length below the header
		cs = append(cs, fastCase{"bad UDP length", f, false})
	}
	return cs
}

// TestQuickKeyMatchesParse: whenever quickKey reads a tuple from a frame
// that packet.Parse accepts, it is Parse's tuple.
func TestQuickKeyMatchesParse(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	base := [][]byte{
		frame(t, packet.ProtoTCP, podA, addr("198.19.0.10"), 1234, 80, packet.TCPAck, []byte("x")),
		frame(t, packet.ProtoUDP, outside, addr("198.19.0.20"), 5353, 53, 0, []byte("y")),
	}
	matched := 0
	for i := range 20000 {
		f := append([]byte(nil), base[i%2]...)
		// Flip a few random bytes of the headers.
		for range 1 + rng.IntN(3) {
			f[rng.IntN(54)] ^= byte(1 << rng.IntN(8))
		}
		var k conntrack.Key
		ok := quickKey(f, &k)
		var p packet.Packet
		if !ok || packet.Parse(f, &p) != packet.OK || p.IsICMPError || p.IsLaterFragment() {
			continue
		}
		tu := p.Tuple()
		if want := conntrack.MakeKey(&tu); k != want {
			t.Fatalf("frame %x: quickKey %x, Parse %x", f, k, want)
		}
		matched++
	}
	if matched < 1000 {
		t.Fatalf("only %d frames compared", matched)
	}
}

// TestFlowCacheSurvivesNothingStale: a cached flow that conntrack deleted
// and replaced (the same tuple, another backend) is never used: the next
// packet gets the new translation.
func TestFlowCacheSurvivesNothingStale(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	vip := addr("198.19.0.20")
	f := frame(t, packet.ProtoUDP, podA, vip, 7000, 53, 0, nil)
	v := h.proc.Process(f, 1)
	first := parse(t, f[:v.Len])
	for range 3 { // cached now
		f = frame(t, packet.ProtoUDP, podA, vip, 7000, 53, 0, nil)
		h.proc.Process(f, 2)
	}
	if h.proc.CacheHits == 0 {
		t.Fatal("the flow never came from the cache")
	}
	fl, _, _ := h.ct.Lookup(first.Tuple().Reverse(), 2)
	h.ct.Delete(fl.Handle)
	// Another flow with the same tuple, translated elsewhere.
	other := packet.Tuple{Src: podA, Dst: addr("198.18.1.99"), SrcPort: 7000, DstPort: 9999, Proto: packet.ProtoUDP}
	orig := packet.Tuple{Src: podA, Dst: vip, SrcPort: 7000, DstPort: 53, Proto: packet.ProtoUDP}
	if _, res := h.ct.Insert(orig, other, conntrack.DNAT, 1, 3); res != conntrack.Inserted {
		t.Fatal(res)
	}
	// Twice in one batch, both prepared while the cache still held the
	// old flow: the first finds it gone and caches the new one, the
	// second must not use the slot prepare saw.
	fs := [][]byte{frame(t, packet.ProtoUDP, podA, vip, 7000, 53, 0, nil), frame(t, packet.ProtoUDP, podA, vip, 7000, 53, 0, nil)}
	for i, f := range fs {
		h.proc.prepare(i, f)
	}
	for i, f := range append(fs, frame(t, packet.ProtoUDP, podA, vip, 7000, 53, 0, nil)) {
		if i < 2 {
			v = h.proc.process(f, 4, &h.proc.pre[i])
		} else {
			v = h.proc.Process(f, 4)
		}
		got := parse(t, f[:v.Len])
		if got.Dst != other.Dst || got.DstPort != 9999 {
			t.Fatalf("packet %d: sent to %v:%d after the flow was replaced, want %v:9999", i, got.Dst, got.DstPort, other.Dst)
		}
	}
}

// TestNewFlowCachedAtOnce: a flow enters the flow cache with its first
// packet, so that the connection's next packet is a cache hit, and the
// first packet already takes the fast path.
func TestNewFlowCachedAtOnce(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	p := h.proc
	vip := addr("198.19.0.20")
	f := frame(t, packet.ProtoUDP, podA, vip, 7100, 53, 0, []byte("q"))
	p.prepare(0, f)
	v := p.process(f, 1, &p.pre[0])
	if v.Action != Forward || p.NewFlows != 1 {
		t.Fatalf("first packet %v/%v, %d new flows", v.Action, v.Reason, p.NewFlows)
	}
	out := parse(t, f[:v.Len]) // checksums included
	if out.Dst != addr("198.18.1.13") || out.DstPort != 5353 {
		t.Fatalf("first packet sent to %v:%d", out.Dst, out.DstPort)
	}
	f = frame(t, packet.ProtoUDP, podA, vip, 7100, 53, 0, []byte("q2"))
	p.prepare(0, f)
	if p.pre[0].way < 0 {
		t.Fatal("the new flow is not in the flow cache")
	}
	hits := p.CacheHits
	if v := p.process(f, 2, &p.pre[0]); v.Action != Forward || p.CacheHits != hits+1 || p.CacheMisses != 0 {
		t.Fatalf("second packet %v/%v, hits %d, misses %d", v.Action, v.Reason, p.CacheHits-hits, p.CacheMisses)
	}
}

// TestNewFlowFastMatchesGeneral: the first packet of a new flow, which the
// worker's batch path rewrites with fastV4 once the flow is inserted,
// leaves exactly as the general path sends it (two tables with the same
// seeds make the same choices).
func TestNewFlowFastMatchesGeneral(t *testing.T) {
	mk := func() *Processor {
		ct, err := conntrack.New(conntrack.Config{Capacity: 4096, Seed: 7})
		if err != nil {
			t.Fatal(err)
		}
		h := newHarness(t, testModel(), 16)
		cfg := h.proc.cfg
		cfg.Conntrack = ct
		p := NewProcessor(cfg)
		p.BeginBatch(1)
		return p
	}
	general, fast := mk(), mk()
	general.cacheOff = true
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 200 {
		client := []packet.Addr{podA, outside}[i%2]
		proto, vip, port, flags := packet.ProtoTCP, addr("198.19.0.10"), uint16(80), uint8(packet.TCPSyn)
		if i%4 >= 2 {
			proto, vip, port, flags = packet.ProtoUDP, addr("198.19.0.20"), 53, 0
		}
		f := frame(t, proto, client, vip, uint16(30000+i), port, flags, make([]byte, rng.IntN(100)))
		if i%8 == 1 { // a SYN with options: the fast path reads the window scale too
			f = synWithWScale(t, client, vip, uint16(30000+i), port, uint8(rng.IntN(15)))
		}
		f[22] = byte(2 + rng.IntN(250))
		fixIPChecksum(f)
		a := append(make([]byte, 0, 2048), f...)
		b := append(make([]byte, 0, 2048), f...)
		va := general.Process(a, 1e9)
		fast.prepare(0, b)
		vb := fast.process(b, 1e9, &fast.pre[0])
		if va != vb || general.Destination() != fast.Destination() || !bytes.Equal(a[:va.Len], b[:vb.Len]) {
			t.Fatalf("flow %d: fast %+v %x\ngeneral %+v %x", i, vb, b[:vb.Len], va, a[:va.Len])
		}
		if va.Action != Forward {
			t.Fatalf("flow %d: %v/%v", i, va.Action, va.Reason)
		}
	}
	if fast.NewFlows != 200 || general.NewFlows != 200 {
		t.Fatalf("new flows: fast %d, general %d", fast.NewFlows, general.NewFlows)
	}
}

// TestPredictedChoiceIsNewFlowsChoice: for a batch of new flows, the
// backend predictNewFlow chooses (to prefetch the reply tuple's index slot)
// is the one newFlow then translates to: both use the random number drawn
// for the frame. Masqueraded clients, whose reply slot is not predicted,
// keep the choice too.
func TestPredictedChoiceIsNewFlowsChoice(t *testing.T) {
	h := newHarness(t, testModel(), 4096)
	p := h.proc
	p.BeginBatch(1)
	vip := addr("198.19.0.10")
	const n = 64
	frames := make([][]byte, n)
	for i := range frames {
		client := []packet.Addr{podA, outside}[i%2]
		frames[i] = frame(t, packet.ProtoTCP, client, vip, uint16(40000+i), 80, packet.TCPSyn, nil)
		p.prepare(i, frames[i])
	}
	if !p.prefetchLookups(n) {
		t.Fatal("no frame of the batch is fresh")
	}
	for i := range frames {
		if !p.pre[i].fresh {
			t.Fatalf("frame %d of a new flow is not fresh", i)
		}
	}
	p.lookService(n)
	p.locateFrontend(n)
	p.prefetchSelect(n)
	for i := range frames {
		p.predictNewFlow(i)
	}
	fe := p.table.Lookup(packet.ProtoTCP, vip, 80)
	backends := map[packet.Addr]int{}
	for i, f := range frames {
		pk := parse(t, f)
		orig := pk.Tuple()
		want := fe.Select(flowHash(&orig), p.pre[i].rnd, false)
		if p.pre[i].fe != fe || p.pre[i].be != want {
			t.Fatalf("frame %d: predicted %p/%p, want %p/%p", i, p.pre[i].fe, p.pre[i].be, fe, want)
		}
		v := p.process(f, 1, &p.pre[i])
		if v.Action != Forward {
			t.Fatalf("frame %d: %v/%v", i, v.Action, v.Reason)
		}
		if got := parse(t, f[:v.Len]); got.Dst != want.Addr || got.DstPort != want.Port {
			t.Fatalf("frame %d went to %v:%d, predicted %v:%d", i, got.Dst, got.DstPort, want.Addr, want.Port)
		}
		backends[want.Addr]++
	}
	if len(backends) < 2 {
		t.Fatalf("every flow chose the same backend: %v", backends)
	}
}

// TestPredictionsForgotten: after a batch of new flows, no frame's
// findings still point into the service table (an idle worker would keep
// a replaced table reachable).
func TestPredictionsForgotten(t *testing.T) {
	bw := newBenchWorld(t, 10, 4096)
	n := 0
	bw.feedFlows(benchBatch, packet.TCPSyn, func() int { n++; return n })
	w := bw.w
	got := w.port.Sock.Receive(w.rx)
	// The first pass alone: the batch's new flows are predicted.
	w.proc.BeginBatch(1)
	w.prepareBatch(w.rx[:got])
	predicted := 0
	for i := range got {
		if w.proc.pre[i].be != nil {
			predicted++
		}
	}
	if predicted != got {
		t.Fatalf("%d of %d new flows predicted", predicted, got)
	}
	// The whole batch.
	w.processBatch(w.rx[:got])
	for i := range got {
		if pre := &w.proc.pre[i]; pre.fe != nil || pre.be != nil {
			t.Fatalf("frame %d still holds its prediction", i)
		}
	}
	if f := w.Counters.Forwarded.Load(); f != uint64(got) {
		t.Fatalf("%d of %d frames forwarded: %+v", f, got, w.Counters.Snapshot())
	}
}
