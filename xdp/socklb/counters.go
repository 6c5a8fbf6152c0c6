package socklb

import "fmt"

// Counters are the programs' counters summed over CPUs. Every connect or
// send to a frontend ends in exactly one of Translated, Rejected,
// Dropped, NotNode and NoBackend.
type Counters struct {
	Translated uint64 // given a backend
	Rejected   uint64 // no backends, Reject: ECONNREFUSED
	Dropped    uint64 // no backends, no Reject: EPERM
	NotNode    uint64 // a loopback frontend from outside the node's netns: untouched
	NoBackend  uint64 // a set's backend was missing: untouched (never expected)

	AffinityHits uint64 // of Translated: the client's affinity backend
	PinHits      uint64 // of Translated: the backend an unconnected UDP socket kept

	Reversed      uint64 // recvmsg or getpeername shown the frontend
	ReverseFailed uint64 // a reverse entry could not be written
}

// Counters reads the counters.
func (lb *LB) Counters() (Counters, error) {
	var c Counters
	fields := [bpfCounterCNT_MAX]*uint64{
		bpfCounterCNT_TRANSLATED:     &c.Translated,
		bpfCounterCNT_REJECTED:       &c.Rejected,
		bpfCounterCNT_DROPPED:        &c.Dropped,
		bpfCounterCNT_NOT_NODE:       &c.NotNode,
		bpfCounterCNT_NO_BACKEND:     &c.NoBackend,
		bpfCounterCNT_AFFINITY_HIT:   &c.AffinityHits,
		bpfCounterCNT_PIN_HIT:        &c.PinHits,
		bpfCounterCNT_REVERSED:       &c.Reversed,
		bpfCounterCNT_REVERSE_FAILED: &c.ReverseFailed,
	}
	var perCPU []uint64
	for i, f := range fields {
		if err := lb.counters.Lookup(bpfCounter(i), &perCPU); err != nil {
			return Counters{}, fmt.Errorf("socklb: reading counter %d: %w", i, err)
		}
		for _, v := range perCPU {
			*f += v
		}
	}
	return c, nil
}
