package tcpbench

import (
	"context"
	"net"
	"testing"
	"time"
)

func TestPercentileNearestRank(t *testing.T) {
	var s []time.Duration
	for i := 1; i <= 100; i++ {
		s = append(s, time.Duration(i))
	}
	if p := Percentile(s, 50); p != 50 {
		t.Fatalf("p50 %v", p)
	}
	if p := Percentile(s, 99); p != 99 {
		t.Fatalf("p99 %v", p)
	}
	if p := Percentile(s[:1], 99); p != 1 {
		t.Fatalf("p99 of one %v", p)
	}
}

func TestSummarizeHistogram(t *testing.T) {
	r := Summarize([]time.Duration{10 * time.Microsecond, 30 * time.Microsecond, time.Hour}, time.Second)
	if r.Connections != 3 || r.CPS != 3 {
		t.Fatalf("%+v", r)
	}
	if r.Histogram[0] != 1 || r.Histogram[1] != 1 || r.Histogram[HistogramBuckets-1] != 1 {
		t.Fatalf("histogram %v %v %v", r.Histogram[0], r.Histogram[1], r.Histogram[HistogramBuckets-1])
	}
}

// TestLoopback runs the real client against the real server on loopback.
func TestLoopback(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go Serve(ctx, ln)
	r, err := Run(ctx, Options{Target: ln.Addr().String(), Duration: 200 * time.Millisecond, Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	if r.Connections < 10 || r.Errors != 0 {
		t.Fatalf("%d connections, %d errors (%s)", r.Connections, r.Errors, r.FirstErr)
	}
	if r.P50 <= 0 || r.P99 < r.P50 {
		t.Fatalf("p50 %v p99 %v", r.P50, r.P99)
	}
}
