package dataplane

import (
	"sync/atomic"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Counters are one worker's totals. The worker accumulates a batch in a
// plain local copy and adds it here once per batch, so readers (metrics,
// the admin CLI) see consistent atomics without a per-packet atomic add.
type Counters struct {
	RxFrames  atomic.Uint64
	Forwarded atomic.Uint64
	Replied   atomic.Uint64
	TxFrames  atomic.Uint64
	Copied    atomic.Uint64 // frames copied into another interface's UMEM
	NewFlows  atomic.Uint64
	Wakeups   atomic.Uint64 // times the worker woke from poll() with frames
	// SpinCatches counts times frames arrived while the worker spun on
	// its empty ring (a poll() sleep and wake-up saved).
	SpinCatches atomic.Uint64
	// FlowCacheHits and FlowCacheMisses count packets of established
	// flows whose flow the worker's flow cache held (still valid) or
	// not (found in conntrack).
	FlowCacheHits   atomic.Uint64
	FlowCacheMisses atomic.Uint64
	// ToKernel counts frames handed to the kernel's stack through the
	// exception link: frames that were not ours after all (counted under
	// their pass_* reason too) and translated frames for destinations
	// behind interfaces xdproxy does not serve (ViaKernel).
	ToKernel  atomic.Uint64
	ViaKernel atomic.Uint64
	// Unresolved counts translated frames whose next hop's neighbour
	// was not resolved yet: they went through the kernel (counted in
	// ViaKernel too), which holds them while it resolves it.
	Unresolved atomic.Uint64
	Batches    atomic.Uint64
	ByReason   [packet.NumReasons]atomic.Uint64
	TxFullDrop atomic.Uint64
	// FlowPublishErrors counts batches whose reply tuples the XDP flow map
	// refused; those replies reach the kernel instead of xdproxy.
	FlowPublishErrors atomic.Uint64
}

// batchCounters is the per-batch local accumulator.
type batchCounters struct {
	rx, forwarded, replied, tx, copied, newFlows uint64
	toKernel, viaKernel, unresolved              uint64
	cacheHits, cacheMisses                       uint64
	byReason                                     [packet.NumReasons]uint64
}

func (c *Counters) add(b *batchCounters) {
	if b.rx != 0 {
		c.RxFrames.Add(b.rx)
	}
	if b.forwarded != 0 {
		c.Forwarded.Add(b.forwarded)
	}
	if b.replied != 0 {
		c.Replied.Add(b.replied)
	}
	if b.tx != 0 {
		c.TxFrames.Add(b.tx)
	}
	if b.copied != 0 {
		c.Copied.Add(b.copied)
	}
	if b.newFlows != 0 {
		c.NewFlows.Add(b.newFlows)
	}
	if b.toKernel != 0 {
		c.ToKernel.Add(b.toKernel)
	}
	if b.viaKernel != 0 {
		c.ViaKernel.Add(b.viaKernel)
	}
	if b.unresolved != 0 {
		c.Unresolved.Add(b.unresolved)
	}
	if b.cacheHits != 0 {
		c.FlowCacheHits.Add(b.cacheHits)
	}
	if b.cacheMisses != 0 {
		c.FlowCacheMisses.Add(b.cacheMisses)
	}
	for i, v := range b.byReason {
		if v != 0 {
			c.ByReason[i].Add(v)
		}
	}
	c.Batches.Add(1)
	*b = batchCounters{}
}

// Snapshot is a plain copy of Counters.
type Snapshot struct {
	RxFrames, Forwarded, Replied, TxFrames, Copied, NewFlows, Wakeups, Batches uint64
	ToKernel, ViaKernel, Unresolved, FlowPublishErrors                         uint64
	SpinCatches, FlowCacheHits, FlowCacheMisses                                uint64
	ByReason                                                                   map[string]uint64
}

// Snapshot reads the counters.
func (c *Counters) Snapshot() Snapshot {
	s := Snapshot{
		RxFrames: c.RxFrames.Load(), Forwarded: c.Forwarded.Load(), Replied: c.Replied.Load(),
		TxFrames: c.TxFrames.Load(), Copied: c.Copied.Load(), NewFlows: c.NewFlows.Load(),
		Wakeups: c.Wakeups.Load(), Batches: c.Batches.Load(), FlowPublishErrors: c.FlowPublishErrors.Load(),
		ToKernel: c.ToKernel.Load(), ViaKernel: c.ViaKernel.Load(), Unresolved: c.Unresolved.Load(),
		SpinCatches: c.SpinCatches.Load(), FlowCacheHits: c.FlowCacheHits.Load(), FlowCacheMisses: c.FlowCacheMisses.Load(),
		ByReason: map[string]uint64{},
	}
	for i := range c.ByReason {
		if v := c.ByReason[i].Load(); v != 0 {
			s.ByReason[packet.Reason(i).String()] = v
		}
	}
	return s
}

// Add sums another snapshot into s.
func (s *Snapshot) Add(o Snapshot) {
	s.RxFrames += o.RxFrames
	s.Forwarded += o.Forwarded
	s.Replied += o.Replied
	s.TxFrames += o.TxFrames
	s.Copied += o.Copied
	s.NewFlows += o.NewFlows
	s.Wakeups += o.Wakeups
	s.Batches += o.Batches
	s.FlowPublishErrors += o.FlowPublishErrors
	s.ToKernel += o.ToKernel
	s.ViaKernel += o.ViaKernel
	s.Unresolved += o.Unresolved
	s.SpinCatches += o.SpinCatches
	s.FlowCacheHits += o.FlowCacheHits
	s.FlowCacheMisses += o.FlowCacheMisses
	if s.ByReason == nil {
		s.ByReason = map[string]uint64{}
	}
	for k, v := range o.ByReason {
		s.ByReason[k] += v
	}
}
