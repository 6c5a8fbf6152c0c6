package tcpbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Request and Response are the bytes exchanged per connection.
var (
	Request  = []byte("GET / HTTP/1.0\r\n\r\n")
	Response = []byte("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
)

// Serve accepts on ln until ctx ends: read the request, write the
// response, close.
func Serve(ctx context.Context, ln net.Listener) error {
	go func() { <-ctx.Done(); ln.Close() }()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		go func(c net.Conn) {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			buf := make([]byte, 256)
			if _, err := c.Read(buf); err != nil {
				return
			}
			_, _ = c.Write(Response)
		}(c)
	}
}

// Options of a client run.
type Options struct {
	Target      string // host:port
	Duration    time.Duration
	Concurrency int
	Timeout     time.Duration // per connection
}

// Result of a client run. Latencies are of whole connections: connect,
// request, response read to the end, close.
type Result struct {
	Connections uint64        `json:"connections"`
	Errors      uint64        `json:"errors"`
	Elapsed     time.Duration `json:"elapsedNs"`
	CPS         float64       `json:"cps"`
	P50         time.Duration `json:"p50Ns"`
	P90         time.Duration `json:"p90Ns"`
	P99         time.Duration `json:"p99Ns"`
	Max         time.Duration `json:"maxNs"`
	// Histogram holds latency counts in HistogramBucket-wide buckets
	// (the last bucket takes everything slower).
	Histogram []uint64 `json:"histogram"`
	FirstErr  string   `json:"firstError,omitempty"`
}

// HistogramBucket is the width of one Result.Histogram bucket; there are
// HistogramBuckets of them.
const (
	HistogramBucket  = 20 * time.Microsecond
	HistogramBuckets = 500
)

// Run drives Concurrency connection loops for Duration.
func Run(ctx context.Context, o Options) (Result, error) {
	if o.Concurrency < 1 || o.Duration <= 0 || o.Target == "" {
		return Result{}, fmt.Errorf("tcpbench: need a target, a duration and a concurrency of at least 1")
	}
	if o.Timeout <= 0 {
		o.Timeout = 2 * time.Second
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		lat     []time.Duration
		errs    atomic.Uint64
		firstMu sync.Once
		first   string
	)
	ctx, cancel := context.WithTimeout(ctx, o.Duration)
	defer cancel()
	start := time.Now()
	for range o.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := make([]time.Duration, 0, 4096)
			buf := make([]byte, 512)
			d := net.Dialer{Timeout: o.Timeout}
			for ctx.Err() == nil {
				t0 := time.Now()
				err := once(&d, o, buf)
				if err != nil {
					if ctx.Err() != nil {
						break
					}
					errs.Add(1)
					firstMu.Do(func() { first = err.Error() })
					continue
				}
				local = append(local, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	r := Summarize(lat, time.Since(start))
	r.Errors, r.FirstErr = errs.Load(), first
	return r, nil
}

func once(d *net.Dialer, o Options, buf []byte) error {
	c, err := d.Dial("tcp", o.Target)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(o.Timeout))
	if _, err := c.Write(Request); err != nil {
		return err
	}
	n := 0
	for {
		k, err := c.Read(buf[n:])
		n += k
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if n == len(buf) {
			n = 0
		}
	}
	if n < len(Response) && n != 0 {
		return fmt.Errorf("tcpbench: short response (%d bytes)", n)
	}
	return nil
}

// Summarize computes rate, percentiles and the histogram of lat.
func Summarize(lat []time.Duration, elapsed time.Duration) Result {
	r := Result{Connections: uint64(len(lat)), Elapsed: elapsed, Histogram: make([]uint64, HistogramBuckets)}
	if elapsed > 0 {
		r.CPS = float64(len(lat)) / elapsed.Seconds()
	}
	if len(lat) == 0 {
		return r
	}
	s := append([]time.Duration(nil), lat...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	r.P50, r.P90, r.P99, r.Max = Percentile(s, 50), Percentile(s, 90), Percentile(s, 99), s[len(s)-1]
	for _, d := range s {
		b := int(d / HistogramBucket)
		if b >= HistogramBuckets {
			b = HistogramBuckets - 1
		}
		r.Histogram[b]++
	}
	return r
}

// Percentile of sorted durations by the nearest-rank method.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p/100*float64(len(sorted))+0.999999) - 1
	rank = max(0, min(rank, len(sorted)-1))
	return sorted[rank]
}
