package xdp

import "fmt"

// Counters are the program's counters summed over CPUs and over the
// programs of all interfaces. Every frame the programs saw is in exactly
// one of Redirected, Passed, NoSocket, SYNGuardDropped and ParseFailed; the
// Match counters say which rule claimed the frames in Redirected and
// NoSocket.
type Counters struct {
	Redirected  uint64 // into an AF_XDP socket
	Passed      uint64 // to the kernel: not xdproxy's
	NoSocket    uint64 // xdproxy's, but no socket on the queue: dropped
	ParseFailed uint64 // headers cut short or malformed: passed

	MatchFrontend  uint64 // destination is a frontend
	MatchFlow      uint64 // exactly a reply xdproxy expects (see FlowWriter)
	MatchFragment  uint64 // later fragment of a redirected datagram, or to a VIP
	MatchICMPError uint64 // ICMP error quoting one of xdproxy's packets

	// FragTrackFailed counts first fragments whose datagram the program
	// could not remember; their later fragments reach the kernel.
	FragTrackFailed uint64

	// SYNGuardDropped counts first SYNs to a frontend the SYN guard
	// dropped (see SetSYNGuard).
	SYNGuardDropped uint64

	// EgressSeen counts packets the egress programs looked at, and
	// EgressRedirected those they sent back to xdproxy: replies of local
	// backends that would have left untranslated.
	EgressSeen, EgressRedirected uint64
}

// Counters reads the counters.
func (o *Objects) Counters() (Counters, error) {
	var c Counters
	fields := [bpfCounterCNT_MAX]*uint64{
		bpfCounterCNT_REDIRECTED:        &c.Redirected,
		bpfCounterCNT_PASSED:            &c.Passed,
		bpfCounterCNT_NO_SOCKET:         &c.NoSocket,
		bpfCounterCNT_PARSE_FAILED:      &c.ParseFailed,
		bpfCounterCNT_MATCH_FRONTEND:    &c.MatchFrontend,
		bpfCounterCNT_MATCH_FLOW:        &c.MatchFlow,
		bpfCounterCNT_MATCH_FRAGMENT:    &c.MatchFragment,
		bpfCounterCNT_MATCH_ICMP_ERROR:  &c.MatchICMPError,
		bpfCounterCNT_FRAG_TRACK_FAILED: &c.FragTrackFailed,
		bpfCounterCNT_SYN_GUARD_DROPPED: &c.SYNGuardDropped,
		bpfCounterCNT_EGRESS_SEEN:       &c.EgressSeen,
		bpfCounterCNT_EGRESS_REDIRECTED: &c.EgressRedirected,
	}
	var perCPU []uint64
	for i, f := range fields {
		if err := o.counters.Lookup(bpfCounter(i), &perCPU); err != nil {
			return Counters{}, fmt.Errorf("xdp: reading counter %d: %w", i, err)
		}
		for _, v := range perCPU {
			*f += v
		}
	}
	return c, nil
}
