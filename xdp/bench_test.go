package xdp

import (
	"fmt"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// BenchmarkProgram measures the program's cost per frame with
// BPF_PROG_RUN (no socket: a claimed frame falls back to pass).
func BenchmarkProgram(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 65536, MaxAddrs: 4096})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	var fe []Key
	var vips []packet.Addr
	for i := range 10000 {
		fe = append(fe, Key{packet.AddrFrom4([4]byte{198, 18, byte(100 + i>>8), byte(i)}), 80, packet.ProtoTCP})
		if i < 4096 {
			vips = append(vips, fe[i].Addr)
		}
	}
	if err := o.SetTables(fe, vips); err != nil {
		b.Fatal(err)
	}
	// 100,000 replies expected, from the backends to clients in
	// 198.19.0.0/16 on ports 1024-1025.
	w := o.NewFlowWriter(1000)
	for i := 0; i < 100000; i += 1000 {
		for _, k := range flowKeys(1000, i) {
			w.Add(k)
		}
		if _, err := w.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	inst, err := o.newInstance(1)
	if err != nil {
		b.Fatal(err)
	}
	defer inst.close()
	for _, c := range []struct {
		name  string
		frame func(tb testing.TB) []byte
	}{
		{"frontend", func(tb testing.TB) []byte { return tcp4(tb, client4, 1000, "198.18.110.16", 80) }},
		{"flow", func(tb testing.TB) []byte { return tcp4(tb, backend4, 8080, "198.19.3.231", 1024) }},
		{"unrelated", func(tb testing.TB) []byte { return tcp4(tb, client4, 1000, remote4, 22) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			frame := c.frame(b)
			_, per, err := inst.prog.Benchmark(frame, b.N, b.ResetTimer)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(per.Nanoseconds()), "ns/frame")
		})
	}
}

// BenchmarkSetTables measures a sync of 10,000 frontends in which 10%
// change.
func BenchmarkSetTables(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 65536, MaxAddrs: 4096})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	gen := func(shift int) (fe []Key) {
		for i := range 10000 {
			j := i
			if i < 1000 {
				j = i + shift
			}
			fe = append(fe, Key{packet.AddrFrom4([4]byte{198, 18, byte(j >> 8), byte(j)}), 80, packet.ProtoTCP})
		}
		return fe
	}
	fe0, fe1 := gen(0), gen(20000)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		fe := fe0
		if i%2 == 1 {
			fe = fe1
		}
		if err := o.SetTables(fe, nil); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFlush(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	const distinct = 131072
	ks := flowKeys(distinct, 0)
	w := o.NewFlowWriter(64)
	for i := 0; i < distinct; i += 64 {
		for _, k := range ks[i : i+64] {
			w.Add(k)
		}
		if _, err := w.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	for _, n := range []int{1, 64} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			next := 0
			for b.Loop() {
				for range n {
					w.Add(ks[next])
					next = (next + 1) % distinct
				}
				if _, err := w.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/flow")
		})
	}
}

// writeFlows writes ks through w, a buffer's worth per Flush.
func writeFlows(tb testing.TB, w *FlowWriter, ks []FlowKey) {
	tb.Helper()
	for len(ks) > 0 {
		n := min(len(ks), len(w.keys))
		for _, k := range ks[:n] {
			w.Add(k)
		}
		if _, err := w.Flush(); err != nil {
			tb.Fatal(err)
		}
		ks = ks[n:]
	}
}

// BenchmarkPublishAndRetire is a reply tuple's whole life in the tables,
// as a worker and the janitor see it: written by Flush in a batch of 64
// new flows, deleted by DeleteFlows when its flow ends. The table holds
// about a quarter of its capacity meanwhile. place=slots is the table as
// it is (the reply slots, the map for a full set); place=map writes and
// deletes through the flows map alone, as before the slots.
func BenchmarkPublishAndRetire(b *testing.B) {
	requireRoot(b)
	for _, place := range []string{"slots", "map"} {
		b.Run("place="+place, func(b *testing.B) {
			o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16})
			if err != nil {
				b.Fatal(err)
			}
			defer o.Close()
			if place == "map" {
				o.replies = nil
			}
			const held, batch = DefaultMaxFlows / 4, 64
			ks := flowKeys(held, 0)
			w := o.NewFlowWriter(batch)
			writeFlows(b, w, ks)
			b.ReportAllocs()
			next := 0
			for b.Loop() {
				chunk := ks[next : next+batch]
				next = (next + batch) % held
				if err := o.DeleteFlows(chunk); err != nil {
					b.Fatal(err)
				}
				for _, k := range chunk {
					w.Add(k)
				}
				if n, err := w.Flush(); n != batch || err != nil {
					b.Fatalf("Flush: %d of %d, %v", n, batch, err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/flow")
		})
	}
}

// BenchmarkForEachFlow measures reading back a full table of the default
// size, as a reconciler would.
func BenchmarkForEachFlow(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	writeFlows(b, o.NewFlowWriter(1024), flowKeys(DefaultMaxFlows, 0))
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		n = 0
		if err := o.ForEachFlow(func(FlowKey) bool { n++; return true }); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n), "flows")
}
