package search

import (
	"errors"
	"fmt"
	"sort"
)

// Point is one trial: what was asked for, what the generator managed to
// send, and what arrived, all in packets per second over the trial.
type Point struct {
	Offered  float64
	Sent     float64
	Received float64
}

// Loss is the share of sent packets that did not arrive (0 when more
// arrived than were sent, which only stray traffic can cause).
func (p Point) Loss() float64 {
	if p.Sent <= 0 || p.Received >= p.Sent {
		return 0
	}
	return (p.Sent - p.Received) / p.Sent
}

// Trial offers rate packets per second and reports the result.
type Trial func(rate float64) (Point, error)

// Options bound a zero-loss search.
type Options struct {
	// Max is the highest rate offered, normally the generator's ceiling;
	// the search starts there.
	Max float64
	// Min is the lowest rate worth trying; a path that loses packets at
	// Min has a zero-loss throughput below it (reported as 0).
	Min float64
	// LossTolerance is the loss a passing trial may show: RFC 2544 asks
	// for zero, the benchmark allows 0.001 (0.1%).
	LossTolerance float64
	// Resolution stops the bisection once hi-lo < Resolution*hi.
	Resolution float64
	// MaxTrials caps the rates one search tries (the first one included).
	MaxTrials int
	// Retries repeats a failing trial up to this many times; the rate
	// passes if any repetition does. On a machine shared with other
	// work, one descheduled thread fails a trial that the path itself
	// would pass; retrying filters that, and the report says so.
	Retries int
}

// Result of a zero-loss search.
type Result struct {
	// Throughput is the rate actually sent in the best passing trial
	// (pps), 0 when none passed.
	Throughput float64
	// Offered is the offered rate of that trial.
	Offered float64
	// AtMax is set when the trial at Max passed: the path carried all the
	// generator could offer and its real limit is higher.
	AtMax bool
	// Points holds every trial in the order run.
	Points []Point
}

// ErrOptions is wrapped by errors about bad Options.
var ErrOptions = errors.New("search: bad options")

func (o Options) validate() error {
	switch {
	case o.Max <= 0:
		return fmt.Errorf("%w: Max %v must be positive", ErrOptions, o.Max)
	case o.Min <= 0 || o.Min > o.Max:
		return fmt.Errorf("%w: Min %v must be in (0, Max]", ErrOptions, o.Min)
	case o.LossTolerance < 0 || o.LossTolerance >= 1:
		return fmt.Errorf("%w: LossTolerance %v must be in [0, 1)", ErrOptions, o.LossTolerance)
	case o.Resolution <= 0 || o.Resolution >= 1:
		return fmt.Errorf("%w: Resolution %v must be in (0, 1)", ErrOptions, o.Resolution)
	case o.MaxTrials < 1:
		return fmt.Errorf("%w: MaxTrials %d must be at least 1", ErrOptions, o.MaxTrials)
	case o.Retries < 0:
		return fmt.Errorf("%w: Retries %d must not be negative", ErrOptions, o.Retries)
	}
	return nil
}

// ZeroLoss runs the bisection. It tries Max first; if that passes the path
// is faster than the generator and the search ends with AtMax. Otherwise it
// keeps an interval (lo passes or is Min, hi fails) and halves it until it
// is narrower than Resolution of hi, or MaxTrials is spent.
func ZeroLoss(o Options, trial Trial) (Result, error) {
	var r Result
	if err := o.validate(); err != nil {
		return r, err
	}
	rates := 0
	run := func(rate float64) (bool, error) {
		rates++
		for range 1 + o.Retries {
			p, err := trial(rate)
			if err != nil {
				return false, err
			}
			r.Points = append(r.Points, p)
			if p.Loss() <= o.LossTolerance {
				if p.Sent > r.Throughput {
					r.Throughput, r.Offered = p.Sent, rate
				}
				return true, nil
			}
		}
		return false, nil
	}
	ok, err := run(o.Max)
	if err != nil || ok {
		r.AtMax = ok
		return r, err
	}
	lo, hi := o.Min, o.Max
	loTried := false
	for rates < o.MaxTrials && hi-lo >= o.Resolution*hi {
		mid := (lo + hi) / 2
		if !loTried && rates == o.MaxTrials-1 {
			// One trial left and nothing has passed: try the floor
			// so that a result of 0 is measured, not assumed.
			mid = lo
		}
		ok, err := run(mid)
		if err != nil {
			return r, err
		}
		if ok {
			lo, loTried = mid, true
		} else {
			hi = mid
			if mid == lo {
				break
			}
		}
	}
	return r, nil
}

// Curve runs one trial per rate, in ascending order.
func Curve(rates []float64, trial Trial) ([]Point, error) {
	sorted := append([]float64(nil), rates...)
	sort.Float64s(sorted)
	var pts []Point
	for _, rate := range sorted {
		p, err := trial(rate)
		if err != nil {
			return pts, err
		}
		pts = append(pts, p)
	}
	return pts, nil
}

// Sorted returns points ordered by offered rate, for plotting the trials of
// a search as a loss curve.
func Sorted(pts []Point) []Point {
	out := append([]Point(nil), pts...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].Offered < out[j].Offered })
	return out
}

// Median of xs (0 for none); xs is not modified.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
