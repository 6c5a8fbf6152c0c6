package filesource

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
)

// BenchmarkParse reads 10,000 Services and their EndpointSlices written as
// the benchmarks write them (one document each, two endpoints).
func BenchmarkParse(b *testing.B) {
	set := kernelrules.ServiceSet{
		Count: 10000, Proto: kernelrules.TCP,
		VIPBase: netip.MustParseAddr("172.30.0.1"), BasePort: 80,
		Endpoints: []netip.AddrPort{
			netip.MustParseAddrPort("10.0.0.1:8080"),
			netip.MustParseAddrPort("10.0.0.2:8080"),
		},
		ClusterCIDR: netip.MustParsePrefix("10.0.0.0/16"),
		ServiceCIDR: netip.MustParsePrefix("172.30.0.0/16"),
	}
	var buf bytes.Buffer
	if err := set.WriteManifests(&buf); err != nil {
		b.Fatal(err)
	}
	data := buf.Bytes()
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		objs, problems := Parse(data)
		if len(problems) != 0 || len(objs.Services) != set.Count || len(objs.EndpointSlices) != set.Count {
			b.Fatalf("%d services, %d slices, problems %v", len(objs.Services), len(objs.EndpointSlices), problems)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/float64(2*set.Count), "µs/doc")
}
