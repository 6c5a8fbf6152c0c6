package pktgen

import (
	"time"
)

// Budget says how much to send: at Rate packets per second (0: as fast as
// possible), until Duration has passed or Count packets are sent, whichever
// comes first. At least one of Duration and Count must be set.
type Budget struct {
	Rate     float64
	Duration time.Duration
	Count    uint64
	// Seq is the sequence number of the first packet: packet i carries
	// flow (Seq+i) % Flows. A caller that wants every packet of several
	// sends to open a new flow continues where the last send ended
	// (AF_XDP mode only).
	Seq uint64
}

// Result of one Send.
type Result struct {
	Mode     string        `json:"mode"`
	Offered  float64       `json:"offeredPps"`
	Sent     uint64        `json:"sent"`
	Elapsed  time.Duration `json:"elapsedNs"`
	Achieved float64       `json:"achievedPps"`
	// Late counts the times the sender fell more than four batches behind
	// its schedule and gave up the backlog instead of bursting it out.
	Late uint64 `json:"late"`
	// SendErrors counts kernel-side failures the mode can see (AF_XDP
	// wakeup errors, invalid descriptors).
	SendErrors uint64 `json:"sendErrors"`
}

func (r *Result) finish(elapsed time.Duration) {
	r.Elapsed = elapsed
	if elapsed > 0 {
		r.Achieved = float64(r.Sent) / elapsed.Seconds()
	}
}

// pacer spreads packets evenly, a batch at a time: due says how many may
// go now, and nothing is due until a whole batch is, because one kick per
// frame would cost more than the frame. When the sender falls far behind
// (the thread was descheduled), the debt is forgiven instead of sent as
// one burst, because a burst would overflow the receiver's ring and be
// blamed on the path under test.
type pacer struct {
	rate   float64
	batch  uint64
	start  time.Time
	sent   uint64 // packets the schedule has accounted for
	maxOwe uint64
	late   uint64
}

func newPacer(rate float64, batch int) *pacer {
	return &pacer{rate: rate, batch: uint64(batch), start: time.Now(), maxOwe: uint64(4 * batch)}
}

// due returns how many packets are due at elapsed (time since start), or
// how long to wait for the next batch when fewer than a batch are.
func (p *pacer) due(elapsed time.Duration) (uint64, time.Duration) {
	if p.rate <= 0 {
		return ^uint64(0), 0
	}
	should := uint64(elapsed.Seconds() * p.rate)
	if should < p.sent+p.batch {
		next := time.Duration(float64(p.sent+p.batch) / p.rate * 1e9)
		return 0, next - elapsed
	}
	owe := should - p.sent
	if owe > p.maxOwe {
		p.late++
		p.sent = should - p.batch
		owe = p.batch
	}
	return owe, 0
}

// took records that n packets were sent.
func (p *pacer) took(n uint64) { p.sent += n }

// batchFor chooses how many frames go per kick: about 100us worth of
// packets at the rate, between 8 and 64, so low rates stay smooth.
func batchFor(rate float64) int {
	if rate <= 0 {
		return 64
	}
	return min(64, max(8, int(rate/10000)))
}

// wait sleeps for d when d is long, and otherwise spins: Go's timers
// oversleep by tens of microseconds, as long as a batch lasts. The spin
// yields the CPU, so a receive thread pinned to the same CPU keeps running.
func wait(d time.Duration) {
	if d > 2*time.Millisecond {
		time.Sleep(d - time.Millisecond)
		return
	}
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		yield()
	}
}
