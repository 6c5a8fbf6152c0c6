package dataplane

import "github.com/xdproxy/xdproxy/nat/packet"

// Action is what a worker does with a frame after Process.
type Action uint8

const (
	// Drop releases the frame; Verdict.Reason says why.
	Drop Action = iota
	// Pass hands the frame to the kernel's exception path. The XDP
	// program only redirects frames xdproxy owns, so this is rare (a table
	// changed between the XDP lookup and ours, a fragment we never saw the
	// head of). The worker completes a PassNoService frame's partial
	// checksum first (Processor.CompletePartial), and drops the frame
	// instead when it came from the exception link itself (handing it
	// back would loop) or there is no exception link (DropNoKernelPath).
	Pass
	// Forward transmits the rewritten frame toward the processor's
	// Destination.
	Forward
	// Reply transmits a reply built in place (TCP reset, ICMP
	// unreachable) back toward the sender, Verdict.Len bytes long.
	Reply
)

func (a Action) String() string {
	switch a {
	case Drop:
		return "drop"
	case Pass:
		return "pass"
	case Forward:
		return "forward"
	case Reply:
		return "reply"
	}
	return "unknown"
}

// Verdict is the result of processing one frame. The destination to
// route a Forward or Reply frame to is the processor's Destination.
//
// A Verdict is three scalar fields so that it is returned in registers: with
// the next hop's 16 bytes in it, it was returned in memory and copied on the
// way from fastV4 to the worker, each copy reading in 16-byte pieces the
// fields just written one by one, and on amd64 such a load waits for the
// stores to reach the cache (a failed store-to-load forward): a tenth of an
// established packet's cost.
type Verdict struct {
	Action Action
	Reason packet.Reason
	// Len is the frame's length after processing (a reply may be longer
	// or shorter than the frame it answers).
	Len int
}
