package xdp

import (
	"testing"

	"github.com/xdproxy/xdproxy/dataplane/packet"
)

// BenchmarkProgram measures the program's cost per frame with
// BPF_PROG_RUN (no socket: a claimed frame falls back to pass).
func BenchmarkProgram(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 65536, MaxBackends: 65536, MaxAddrs: 4096})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	var fe, be []Key
	for i := range 10000 {
		fe = append(fe, Key{packet.AddrFrom4([4]byte{198, 18, byte(100 + i>>8), byte(i)}), 80, packet.ProtoTCP})
		be = append(be, Key{packet.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), 8080, packet.ProtoTCP})
	}
	if err := o.SetTables(fe, be, map[packet.Addr]Flags{packet.MustParseAddr(node4): FlagNode}, PortRange{40000, 49999}); err != nil {
		b.Fatal(err)
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

// BenchmarkSetTables measures a sync of 10,000 frontends and backends in
// which 10% of each changes.
func BenchmarkSetTables(b *testing.B) {
	requireRoot(b)
	o, err := Load(Options{MaxFrontends: 65536, MaxBackends: 65536, MaxAddrs: 4096})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	gen := func(shift int) (fe, be []Key) {
		for i := range 10000 {
			j := i
			if i < 1000 {
				j = i + shift
			}
			fe = append(fe, Key{packet.AddrFrom4([4]byte{198, 18, byte(j >> 8), byte(j)}), 80, packet.ProtoTCP})
			be = append(be, Key{packet.AddrFrom4([4]byte{198, 19, byte(j >> 8), byte(j)}), 8080, packet.ProtoTCP})
		}
		return fe, be
	}
	fe0, be0 := gen(0)
	fe1, be1 := gen(20000)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		fe, be := fe0, be0
		if i%2 == 1 {
			fe, be = fe1, be1
		}
		if err := o.SetTables(fe, be, nil, PortRange{}); err != nil {
			b.Fatal(err)
		}
	}
}
