package dataplane

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// benchModel has n cluster-IP services of two endpoints each.
func benchModel(n int) *service.Model {
	m := &service.Model{Node: service.Node{Name: "node-1"}}
	for i := 0; i < n; i++ {
		vip := packet.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
		if i >= 65536 {
			vip = packet.AddrFrom4([4]byte{100, byte(i >> 16), byte(i >> 8), byte(i)})
		}
		m.Ports = append(m.Ports, service.ServicePort{
			Name: service.PortName{Namespace: "bench", Name: fmt.Sprint("svc-", i)}, Proto: packet.ProtoTCP,
			ClusterIPs: []packet.Addr{vip}, Port: 80,
			Endpoints: []service.Endpoint{
				{Addr: packet.AddrFrom4([4]byte{172, 16, byte(i >> 8), byte(i)}), Port: 8080, Ready: true, Serving: true},
				{Addr: packet.AddrFrom4([4]byte{172, 17, byte(i >> 8), byte(i)}), Port: 8080, Ready: true, Serving: true},
			}})
	}
	return m
}

func benchVIP(i, services int) packet.Addr {
	s := i % services
	if s >= 65536 {
		return packet.AddrFrom4([4]byte{100, byte(s >> 16), byte(s >> 8), byte(s)})
	}
	return packet.AddrFrom4([4]byte{198, 19, byte(s >> 8), byte(s)})
}

// flowFrame writes flow i's client packet into buf from the template.
func flowFrame(buf, tmpl []byte, i, services int) {
	copy(buf, tmpl)
	// Source 10.a.b.c (inside the cluster CIDR: no masquerade), port by i.
	buf[26], buf[27], buf[28], buf[29] = 10, byte(i>>16), byte(i>>8), byte(i)
	vip := benchVIP(i, services)
	copy(buf[30:34], vip[12:])
	port := uint16(1024 + i%60000)
	buf[34], buf[35] = byte(port>>8), byte(port)
}

func benchProcessor(b *testing.B, services, flows int) (*Processor, []byte) {
	ct, err := conntrack.New(conntrack.Config{Capacity: flows + flows/4 + 1024})
	if err != nil {
		b.Fatal(err)
	}
	cur := &service.Current{}
	cur.Store(service.Compile(benchModel(services), service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}))
	p := NewProcessor(ProcessorConfig{Services: cur, Conntrack: ct, SNATPorts: conntrack.PortRange{First: 1024, Last: 65535},
		SNATSource: func(packet.Addr) (packet.Addr, bool) { return nodeAddr, true }, Seed: 1})
	p.BeginBatch(1)
	tmpl := frame(b, packet.ProtoTCP, addr("10.0.0.1"), addr("198.19.0.0"), 1, 80, packet.TCPAck, make([]byte, 6))
	return p, tmpl
}

// BenchmarkProcessEstablished is the per-packet cost of a tracked flow:
// parse, conntrack lookup and update, rewrite with incremental checksums.
func BenchmarkProcessEstablished(b *testing.B) {
	for _, services := range []int{1, 10_000, 100_000} {
		for _, flows := range []int{10_000, 1_000_000} {
			b.Run(fmt.Sprintf("services=%d/flows=%d", services, flows), func(b *testing.B) {
				p, tmpl := benchProcessor(b, services, flows)
				buf := make([]byte, len(tmpl), 2048)
				for i := 0; i < flows; i++ {
					flowFrame(buf, tmpl, i, services)
					if v := p.Process(buf, 1); v.Action != Forward {
						b.Fatalf("flow %d: %v %v", i, v.Action, v.Reason)
					}
				}
				b.ReportAllocs()
				b.ResetTimer()
				i := 0
				for b.Loop() {
					// Visit flows in a scattered order so that caches do
					// not hide the table's size.
					i = (i + 7919) % flows
					flowFrame(buf, tmpl, i, services)
					if v := p.Process(buf, 2); v.Action != Forward {
						b.Fatal(v)
					}
				}
			})
		}
	}
}

// BenchmarkProcessNewFlow is the cost of a first packet: service lookup,
// backend selection and conntrack insert on top of the established path.
func BenchmarkProcessNewFlow(b *testing.B) {
	for _, services := range []int{1, 10_000, 100_000} {
		b.Run(fmt.Sprintf("services=%d", services), func(b *testing.B) {
			const flows = 1 << 20
			p, tmpl := benchProcessor(b, services, flows)
			buf := make([]byte, len(tmpl), 2048)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if i == flows {
					// Start over with an empty table so every packet stays new.
					b.StopTimer()
					p, _ = benchProcessor(b, services, flows)
					i = 0
					b.StartTimer()
				}
				flowFrame(buf, tmpl, i, services)
				if v := p.Process(buf, 1); v.Action != Forward {
					b.Fatal(v)
				}
				i++
			}
		})
	}
}

// udpEndpointsModel is testModel with one more UDP service, of n
// endpoints (172.20.0.0/16, port 5353).
func udpEndpointsModel(n int) *service.Model {
	m := testModel()
	sp := service.ServicePort{Name: service.PortName{Namespace: "bench", Name: "udp-many"}, Proto: packet.ProtoUDP,
		ClusterIPs: []packet.Addr{addr("198.19.2.1")}, Port: 53}
	for i := range n {
		sp.Endpoints = append(sp.Endpoints, service.Endpoint{Addr: packet.AddrFrom4([4]byte{172, 20, byte(i >> 8), byte(i)}),
			Port: 5353, Ready: true, Serving: true, NodeName: "node-2"})
	}
	m.Ports = append(m.Ports, sp)
	return m
}

// BenchmarkPublishRemovingUDPEndpoints is a Publish that takes 1,000 UDP
// endpoints away while a 1 Mi-entry connection table holds 640 Ki flows:
// the flows to the removed endpoints (4 each) are deleted.
func BenchmarkPublishRemovingUDPEndpoints(b *testing.B) {
	const (
		removed  = 1000
		perEP    = 4
		capacity = 1 << 20
		bulk     = 640 << 10
	)
	fn := startFakeNode(b, 1, func(c *EngineConfig) {
		c.Conntrack.Capacity = capacity
		// The flows must outlive a slow iteration.
		c.Conntrack.Timeouts.UDPUnreplied = time.Hour
		c.Conntrack.Timeouts.TCPSynSent = time.Hour
	})
	ct := fn.e.Conntrack()
	opts := service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/24")}}
	full := service.Compile(udpEndpointsModel(2*removed), opts)
	fewer := service.Compile(udpEndpointsModel(removed), opts)
	now := MonotonicNow()
	web := packet.Tuple{Dst: addr("198.19.0.10"), DstPort: 80, Proto: packet.ProtoTCP}
	for i := range bulk {
		o := web
		o.Src, o.SrcPort = packet.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 40000
		tr := o
		tr.Dst, tr.DstPort = addr("198.18.1.11"), 8080
		if _, res := ct.Insert(o, tr, conntrack.DNAT, 1, now); res != conntrack.Inserted {
			b.Fatalf("bulk flow %d: %v", i, res)
		}
	}
	b.ResetTimer()
	for b.Loop() {
		b.StopTimer()
		if err := fn.e.Publish(full); err != nil {
			b.Fatal(err)
		}
		// Flows to the endpoints the next Publish removes.
		for i := range removed * perEP {
			ep := i % removed
			o := packet.Tuple{Src: packet.AddrFrom4([4]byte{10, 250, byte(ep >> 8), byte(ep)}), SrcPort: uint16(1000 + i/removed),
				Dst: addr("198.19.2.1"), DstPort: 53, Proto: packet.ProtoUDP}
			tr := o
			gone := removed + ep // fewer has the first removed endpoints
			tr.Dst, tr.DstPort = packet.AddrFrom4([4]byte{172, 20, byte(gone >> 8), byte(gone)}), 5353
			if _, res := ct.Insert(o, tr, conntrack.DNAT, 2, MonotonicNow()); res != conntrack.Inserted {
				b.Fatalf("UDP flow %d: %v", i, res)
			}
		}
		b.StartTimer()
		if err := fn.e.Publish(fewer); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if st := ct.Stats(); st.Live != bulk {
		b.Fatalf("%d flows left, want the %d bulk flows", st.Live, bulk)
	}
}
