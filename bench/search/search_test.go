package search

import (
	"errors"
	"math"
	"testing"
)

// fakePath carries up to capacity pps and loses everything above it; the
// generator sends at most ceiling.
func fakePath(capacity, ceiling float64, calls *[]float64) Trial {
	return func(rate float64) (Point, error) {
		*calls = append(*calls, rate)
		sent := math.Min(rate, ceiling)
		recv := math.Min(sent, capacity)
		return Point{Offered: rate, Sent: sent, Received: recv}, nil
	}
}

func TestZeroLossBisectsToCapacity(t *testing.T) {
	var calls []float64
	r, err := ZeroLoss(Options{Max: 1e6, Min: 1e4, LossTolerance: 0.001, Resolution: 0.01, MaxTrials: 30},
		fakePath(337_000, 1e6, &calls))
	if err != nil {
		t.Fatal(err)
	}
	if r.AtMax {
		t.Fatal("AtMax set for a path slower than Max")
	}
	if r.Throughput > 337_000 || r.Throughput < 337_000*0.99 {
		t.Fatalf("throughput %v, want within 1%% below 337000", r.Throughput)
	}
	if calls[0] != 1e6 {
		t.Fatalf("first trial at %v, want Max", calls[0])
	}
	if len(r.Points) != len(calls) {
		t.Fatalf("%d points for %d trials", len(r.Points), len(calls))
	}
}

func TestZeroLossStopsAtMaxWhenPathIsFaster(t *testing.T) {
	var calls []float64
	r, err := ZeroLoss(Options{Max: 5e5, Min: 1e4, LossTolerance: 0.001, Resolution: 0.01, MaxTrials: 10},
		fakePath(2e6, 4.8e5, &calls))
	if err != nil {
		t.Fatal(err)
	}
	if !r.AtMax || len(calls) != 1 {
		t.Fatalf("AtMax %v after %d trials, want true after 1", r.AtMax, len(calls))
	}
	if r.Throughput != 4.8e5 {
		t.Fatalf("throughput %v, want the rate actually sent (480000)", r.Throughput)
	}
}

func TestZeroLossToleratesSmallLoss(t *testing.T) {
	// 0.05% loss everywhere passes a 0.1% tolerance.
	trial := func(rate float64) (Point, error) {
		return Point{Offered: rate, Sent: rate, Received: rate * 0.9995}, nil
	}
	r, err := ZeroLoss(Options{Max: 1e5, Min: 1e3, LossTolerance: 0.001, Resolution: 0.05, MaxTrials: 5}, trial)
	if err != nil || !r.AtMax {
		t.Fatalf("AtMax %v err %v, want a pass at Max", r.AtMax, err)
	}
}

func TestZeroLossRespectsMaxTrialsAndMeasuresFloor(t *testing.T) {
	var calls []float64
	r, err := ZeroLoss(Options{Max: 1e6, Min: 1e4, LossTolerance: 0, Resolution: 0.001, MaxTrials: 4},
		fakePath(5e3, 1e6, &calls))
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 4 {
		t.Fatalf("%d trials, want MaxTrials=4", len(calls))
	}
	if calls[3] != 1e4 {
		t.Fatalf("last trial at %v, want the floor Min when nothing passed", calls[3])
	}
	if r.Throughput != 0 {
		t.Fatalf("throughput %v for a path that loses at Min, want 0", r.Throughput)
	}
}

func TestZeroLossPropagatesTrialErrors(t *testing.T) {
	boom := errors.New("boom")
	_, err := ZeroLoss(Options{Max: 1, Min: 1, Resolution: 0.1, MaxTrials: 3}, func(float64) (Point, error) { return Point{}, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("err %v, want boom", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	bad := []Options{
		{Max: 0, Min: 1, Resolution: 0.1, MaxTrials: 1},
		{Max: 10, Min: 20, Resolution: 0.1, MaxTrials: 1},
		{Max: 10, Min: 1, Resolution: 0, MaxTrials: 1},
		{Max: 10, Min: 1, Resolution: 0.1, MaxTrials: 0},
		{Max: 10, Min: 1, Resolution: 0.1, MaxTrials: 1, LossTolerance: 1},
	}
	for _, o := range bad {
		if _, err := ZeroLoss(o, nil); !errors.Is(err, ErrOptions) {
			t.Errorf("%+v: err %v, want ErrOptions", o, err)
		}
	}
}

func TestLoss(t *testing.T) {
	cases := []struct {
		p    Point
		want float64
	}{
		{Point{Sent: 100, Received: 100}, 0},
		{Point{Sent: 100, Received: 90}, 0.1},
		{Point{Sent: 100, Received: 120}, 0},
		{Point{Sent: 0, Received: 0}, 0},
	}
	for _, c := range cases {
		if got := c.p.Loss(); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%+v: loss %v, want %v", c.p, got, c.want)
		}
	}
}

func TestCurveAscending(t *testing.T) {
	var calls []float64
	pts, err := Curve([]float64{3e5, 1e5, 2e5}, fakePath(1.5e5, 1e6, &calls))
	if err != nil {
		t.Fatal(err)
	}
	if calls[0] != 1e5 || calls[2] != 3e5 {
		t.Fatalf("calls %v, want ascending", calls)
	}
	if pts[0].Loss() != 0 || pts[2].Loss() < 0.49 {
		t.Fatalf("losses %v %v", pts[0].Loss(), pts[2].Loss())
	}
}

func TestMedian(t *testing.T) {
	if m := Median([]float64{3, 1, 2}); m != 2 {
		t.Fatalf("median %v", m)
	}
	if m := Median([]float64{4, 1, 2, 3}); m != 2.5 {
		t.Fatalf("median %v", m)
	}
	if m := Median(nil); m != 0 {
		t.Fatalf("median of none %v", m)
	}
}

func TestZeroLossRetriesTransientFailures(t *testing.T) {
	// The path carries 300k, but every other trial is disturbed and
	// loses 5%.
	n := 0
	trial := func(rate float64) (Point, error) {
		n++
		recv := math.Min(rate, 300_000)
		if n%2 == 1 {
			recv *= 0.95
		}
		return Point{Offered: rate, Sent: rate, Received: recv}, nil
	}
	r, err := ZeroLoss(Options{Max: 1e6, Min: 1e4, LossTolerance: 0.001, Resolution: 0.02, MaxTrials: 20, Retries: 1}, trial)
	if err != nil {
		t.Fatal(err)
	}
	if r.Throughput < 290_000 || r.Throughput > 300_300 {
		t.Fatalf("throughput %v with retries, want about 300000", r.Throughput)
	}
	n = 0
	r, _ = ZeroLoss(Options{Max: 1e6, Min: 1e4, LossTolerance: 0.001, Resolution: 0.02, MaxTrials: 20}, trial)
	if r.Throughput >= 290_000 {
		t.Fatalf("throughput %v without retries; the disturbed trials should have pulled it down", r.Throughput)
	}
}
