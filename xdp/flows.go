package xdp

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// FlowKey is one direction of a flow exactly as a frame of it arrives: the
// program redirects a frame whose tuple is in the flows table. It has the
// fields of packet.Tuple, so FlowKey(t) converts one; as there, for ICMP
// echo SrcPort and DstPort both hold the echo identifier.
type FlowKey struct {
	Src, Dst         packet.Addr
	SrcPort, DstPort uint16
	Proto            packet.Proto
}

func (k FlowKey) String() string {
	return fmt.Sprintf("%v %v:%d->%v:%d", k.Proto, k.Src, k.SrcPort, k.Dst, k.DstPort)
}

// flowKey converts k to the map key layout: ports in network byte order,
// pad bytes zero.
func (k FlowKey) flowKey() bpfFlowKey {
	return bpfFlowKey{
		Src: k.Src, Dst: k.Dst,
		Sport: networkOrder16(k.SrcPort), Dport: networkOrder16(k.DstPort),
		Proto: uint8(k.Proto),
	}
}

func (k bpfFlowKey) public() FlowKey {
	return FlowKey{
		Src: k.Src, Dst: k.Dst,
		SrcPort: networkOrder16(k.Sport), DstPort: networkOrder16(k.Dport),
		Proto: packet.Proto(k.Proto),
	}
}

// FlowWriter buffers flows for the program to recognise and writes them
// on Flush: into the reply slots, with no system call, and those whose
// set is full into the flows map, with one system call for all of them.
// A dataplane worker owns one: it Adds the reply tuple of every connection
// it opens while it handles a batch of frames and Flushes before it sends
// the batch, so that the first reply finds its entry. A FlowWriter must
// not be shared between goroutines; FlowWriters of different goroutines
// may Flush at the same time.
type FlowWriter struct {
	flows   *ebpf.Map
	replies *replySlots  // nil: every flow goes to flows
	keys    []bpfFlowKey // len is the capacity; keys[:n] are buffered
	values  []uint8      // all present
	n       int
	// qs holds keys[:n] as slot words (Add); over holds the flows
	// whose set was full, and overAt their places in keys; written says
	// which of keys[:n] went into a way of their own.
	qs      []slotKey
	over    []bpfFlowKey
	overAt  []int
	written []bool
	// boxed[n] holds keys[:n] and values[:n] as the interfaces that
	// BatchUpdate takes, made on the first write of n flows: converting a
	// slice to an interface allocates, and Flush should not. boxedOver
	// is the same for over.
	boxed, boxedOver []boxedBatch
	// batch is cleared when the kernel has no batch operations (before
	// 5.6); Flush then writes key by key.
	batch bool
}

type boxedBatch struct{ keys, values any }

// NewFlowWriter returns a FlowWriter that buffers up to capacity flows.
func (o *Objects) NewFlowWriter(capacity int) *FlowWriter {
	capacity = max(capacity, 1)
	w := &FlowWriter{
		flows:     o.flows,
		replies:   o.replies,
		keys:      make([]bpfFlowKey, capacity),
		values:    make([]uint8, capacity),
		qs:        make([]slotKey, capacity),
		over:      make([]bpfFlowKey, 0, capacity),
		overAt:    make([]int, 0, capacity),
		written:   make([]bool, capacity),
		boxed:     make([]boxedBatch, capacity+1),
		boxedOver: make([]boxedBatch, capacity+1),
		batch:     true,
	}
	for i := range w.values {
		w.values[i] = present
	}
	return w
}

// Add buffers k. It reports false, and buffers nothing, when the buffer is
// full: Flush and Add again.
func (w *FlowWriter) Add(k FlowKey) bool {
	if w.n == len(w.keys) {
		return false
	}
	w.keys[w.n] = k.flowKey()
	if w.replies.usable() {
		// Ask for the tuple's set now: a worker adds a flow as it opens
		// it, so by Flush, at the end of the batch, the set has arrived
		// (in memory of 4 KiB pages, a page walk as well as a miss).
		w.qs[w.n] = slotKeyOf(&w.keys[w.n])
		w.replies.prefetch(&w.qs[w.n])
	}
	w.n++
	return true
}

// Len returns the number of flows buffered.
func (w *FlowWriter) Len() int { return w.n }

// Flush writes the buffered flows into the table, in the order they were
// added, and empties the buffer. It returns how many were written: on
// error, the flows after those were not (the table is full, say), their
// replies will reach the kernel, and the caller decides what to do about
// their connections. A failed flow is not retried.
func (w *FlowWriter) Flush() (int, error) {
	n := w.n
	w.n = 0
	if n == 0 {
		return 0, nil
	}
	if w.replies == nil {
		return w.writeMap(w.keys[:n], w.boxed)
	}
	if !w.replies.usable() {
		return 0, errClosed
	}
	qs := w.qs[:n] // Add made them
	w.over, w.overAt = w.over[:0], w.overAt[:0]
	for i := range qs {
		r := w.replies.add(&qs[i])
		w.written[i] = r == slotWritten
		if r == slotSetFull {
			w.over = append(w.over, w.keys[i])
			w.overAt = append(w.overAt, i)
		}
	}
	if len(w.over) == 0 {
		return n, nil
	}
	done, err := w.writeMap(w.over, w.boxedOver)
	if err == nil || done >= len(w.over) {
		return n, err
	}
	// The flows from over[done] on are not written: take back those
	// after it that this Flush put into slots, so that what is written
	// is the first flows in the order they were added, as promised.
	first := w.overAt[done]
	for i := first + 1; i < n; i++ {
		if w.written[i] {
			w.replies.remove(&qs[i])
		}
	}
	return first, err
}

// writeMap writes keys into the flows map; see Flush. keys is a prefix of
// w.keys or of w.over, whose backing arrays never change, and boxed is
// its cache of interfaces.
func (w *FlowWriter) writeMap(keys []bpfFlowKey, boxed []boxedBatch) (int, error) {
	n := len(keys)
	values := w.values[:n]
	if w.batch {
		b := &boxed[n]
		if b.keys == nil {
			b.keys, b.values = keys, values
		}
		done, err := w.flows.BatchUpdate(b.keys, b.values, nil)
		if !errors.Is(err, ebpf.ErrNotSupported) {
			if err != nil {
				return done, fmt.Errorf("xdp: writing %d flows, %d written: %w", n, done, err)
			}
			return n, nil
		}
		w.batch = false
	}
	for i := range keys {
		if err := w.flows.Put(&keys[i], &values[i]); err != nil {
			return i, fmt.Errorf("xdp: writing flow %v: %w", keys[i].public(), err)
		}
	}
	return n, nil
}

// DeleteFlows removes keys from the table; keys it does not hold are
// skipped. Safe to call while FlowWriters flush. A key found in the reply
// slots is not looked for in the flows map: it is in one of them, unless
// a write raced with the slot's set filling or emptying, and then the
// reconciler's next pass finds the copy left behind.
func (o *Objects) DeleteFlows(keys []FlowKey) error {
	ks := make([]bpfFlowKey, len(keys))
	for i, k := range keys {
		ks[i] = k.flowKey()
	}
	if o.replies != nil {
		if !o.replies.usable() {
			return errClosed
		}
		// Two passes, so that the sets' cache misses overlap.
		qs := make([]slotKey, len(ks))
		for i := range ks {
			qs[i] = slotKeyOf(&ks[i])
			o.replies.prefetch(&qs[i])
		}
		rest := ks[:0]
		for i := range qs {
			if !o.replies.remove(&qs[i]) {
				rest = append(rest, ks[i])
			}
		}
		ks = rest
	}
	if err := del(o.flows, ks); err != nil {
		return fmt.Errorf("xdp: deleting flows: %w", err)
	}
	return nil
}

// flowChunk is how many flows ForEachFlow reads per system call. The
// kernel hands over whole hash buckets, which hold a few entries each.
const flowChunk = 1024

// ForEachFlow calls fn for each flow in the table until fn returns false.
// The table changes underneath (workers add flows, the janitor and the reconciler delete them): a flow
// added or removed meanwhile may or may not be seen, and without batch
// operations in the kernel one may be seen twice, as may a tuple a race
// left in both the reply slots and the map (see DeleteFlows). It reads
// the slots first. fn may call DeleteFlows.
func (o *Objects) ForEachFlow(fn func(FlowKey) bool) error {
	if o.replies != nil && !o.replies.usable() {
		return errClosed
	}
	if o.replies != nil && !o.replies.each(func(q *slotKey) bool { return fn(q.flowKey().public()) }) {
		return nil
	}
	keys := make([]bpfFlowKey, flowChunk)
	values := make([]uint8, flowChunk)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := o.flows.BatchLookup(&cursor, keys, values, nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			return o.iterateFlows(fn)
		}
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("xdp: reading flows: %w", err)
		}
		for _, k := range keys[:n] {
			if !fn(k.public()) {
				return nil
			}
		}
		if err != nil { // ErrKeyNotExist: that was the last chunk
			return nil
		}
	}
}

// iterateFlows is ForEachFlow for kernels without batch operations.
func (o *Objects) iterateFlows(fn func(FlowKey) bool) error {
	var k bpfFlowKey
	var v uint8
	it := o.flows.Iterate()
	for it.Next(&k, &v) {
		if !fn(k.public()) {
			return nil
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("xdp: reading flows: %w", err)
	}
	return nil
}
