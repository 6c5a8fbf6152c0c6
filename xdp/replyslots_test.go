package xdp

import (
	"sync/atomic"
	"testing"
	"unsafe"
)

// setOf is the set of o's reply slots that k falls into.
func setOf(o *Objects, k FlowKey) *bpfReplySet {
	bk := k.flowKey()
	q := slotKeyOf(&bk)
	set, _ := o.replies.locate(&q)
	return set
}

// sameSetKeys returns n replies whose tuples fall into one set of o's
// reply slots.
func sameSetKeys(t *testing.T, o *Objects, n int) []FlowKey {
	t.Helper()
	var out []FlowKey
	var first *bpfReplySet
	for i := 0; len(out) < n; i++ {
		if i > 1<<20 {
			t.Fatalf("found only %d keys of one set", len(out))
		}
		k := flowKeys(1, i)[0]
		set := setOf(o, k)
		if first == nil {
			first = set
		}
		if set == first {
			out = append(out, k)
		}
	}
	return out
}

// replyFrame is the frame of reply k as it arrives.
func replyFrame(t *testing.T, k FlowKey) []byte {
	return tcp4(t, k.Src.String(), k.SrcPort, k.Dst.String(), k.DstPort)
}

// inSlots and inMap say where the tables hold k.
func inSlots(o *Objects, k FlowKey) bool {
	found := false
	o.replies.each(func(q *slotKey) bool {
		found = found || q.flowKey().public() == k
		return true
	})
	return found
}

func inMap(t *testing.T, o *Objects, k FlowKey) bool {
	t.Helper()
	found := false
	if err := o.iterateFlows(func(m FlowKey) bool { found = found || m == k; return true }); err != nil {
		t.Fatal(err)
	}
	return found
}

// TestReplySlotsOverflowToMap: a reply whose set is full goes to the flows
// map; the program claims replies in either place and nothing else, and
// DeleteFlows takes each out of the place it is in.
func TestReplySlotsOverflowToMap(t *testing.T) {
	o := loadFlows(t, 64)
	inst, err := o.newInstance(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.close() })
	a := &Attachment{ifname: "test", inst: inst}
	if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	ks := sameSetKeys(t, o, replyWays+2)
	w := o.NewFlowWriter(len(ks))
	for _, k := range ks {
		w.Add(k)
	}
	if n, err := w.Flush(); n != len(ks) || err != nil {
		t.Fatalf("Flush: %d of %d written, %v", n, len(ks), err)
	}
	for i, k := range ks {
		wantSlot := i < replyWays
		if got := inSlots(o, k); got != wantSlot {
			t.Errorf("reply %d in the slots: %v, want %v", i, got, wantSlot)
		}
		if got := inMap(t, o, k); got == wantSlot {
			t.Errorf("reply %d in the map: %v, want %v", i, got, !wantSlot)
		}
		if ret, c := runFrame(t, o, a, replyFrame(t, k)); ret != xdpRedirect || c.MatchFlow != 1 {
			t.Errorf("reply %d (slot %v): verdict %d, counters %+v; want it redirected as a flow", i, wantSlot, ret, c)
		}
	}
	// A tuple of the same set that nobody wrote is not ours.
	other := sameSetKeys(t, o, replyWays+3)[replyWays+2]
	if ret, _ := runFrame(t, o, a, replyFrame(t, other)); ret != xdpPass {
		t.Errorf("a reply nobody expects: verdict %d, want pass", ret)
	}

	if err := o.DeleteFlows(ks); err != nil {
		t.Fatal(err)
	}
	for i, k := range ks {
		if inSlots(o, k) || inMap(t, o, k) {
			t.Errorf("reply %d still held after DeleteFlows", i)
		}
		if ret, _ := runFrame(t, o, a, replyFrame(t, k)); ret != xdpPass {
			t.Errorf("reply %d after DeleteFlows: verdict %d, want pass", i, ret)
		}
	}
}

// TestReplySlotsPrefixOnRefusal: when the map refuses an overflowing
// reply, Flush reports the flows before it written, and takes back the
// later ones this Flush put into slots (not a tuple that was there
// before), so the worker's count stays exact.
func TestReplySlotsPrefixOnRefusal(t *testing.T) {
	const maxFlows = 8 // two sets of four ways, a map of eight
	o := loadFlows(t, maxFlows)
	if len(o.replies.sets) != 3 {
		t.Fatalf("%d sets, want two", len(o.replies.sets)-1)
	}
	// Keys of set A (the first key's) and of the other set, B.
	var a, b []FlowKey
	var setA *bpfReplySet
	for i := 0; len(a) < replyWays+maxFlows+1 || len(b) < 2; i++ {
		k := flowKeys(1, i)[0]
		set := setOf(o, k)
		if setA == nil {
			setA = set
		}
		if set == setA {
			a = append(a, k)
		} else {
			b = append(b, k)
		}
	}
	// Fill set A's ways and then the map with more of A's, and put one
	// of B's in a slot.
	w := o.NewFlowWriter(32)
	for _, k := range append(append([]FlowKey{}, a[:replyWays+maxFlows]...), b[0]) {
		w.Add(k)
	}
	if n, err := w.Flush(); n != replyWays+maxFlows+1 || err != nil {
		t.Fatalf("filling: %d written, %v", n, err)
	}
	// One more of A's (refused: set and map full), then a new one of B's
	// (a slot) and B's first again (there already).
	for _, k := range []FlowKey{a[replyWays+maxFlows], b[1], b[0]} {
		w.Add(k)
	}
	n, err := w.Flush()
	if err == nil || n != 0 {
		t.Fatalf("Flush behind a refused reply: %d written, %v; want 0 and an error", n, err)
	}
	if inSlots(o, b[1]) {
		t.Error("the slot written after the refused reply was not taken back")
	}
	if !inSlots(o, b[0]) {
		t.Error("the reply that was there before the Flush was taken out")
	}
}

// TestReplySlotsRemoveEveryCopy: a tuple two writers put into two ways at
// once leaves with one removal.
func TestReplySlotsRemoveEveryCopy(t *testing.T) {
	o := loadFlows(t, 64)
	k := flowKeys(1, 0)[0].flowKey()
	q := slotKeyOf(&k)
	set, live := o.replies.locate(&q)
	for _, w := range []int{0, 2} { // as two racing writers would
		copy(set.Key[w][:], q[:])
		atomic.StoreUint64(&set.Tag[w], live)
	}
	if !o.replies.remove(&q) {
		t.Fatal("remove found nothing")
	}
	for w := range replyWays {
		if atomic.LoadUint64(&set.Tag[w]) != replyEmpty {
			t.Errorf("way %d still holds something after remove", w)
		}
	}
}

// TestReplySlotsAdoption: a second Load on the same pins keeps the header
// and the tuples, and empties the slots a writer that died left busy; a
// header of another size starts the table afresh.
func TestReplySlotsAdoption(t *testing.T) {
	requireRoot(t)
	pins := privateBPFFS(t)
	opts := Options{MaxFrontends: 4, MaxAddrs: 4, MaxFlows: 64, PinDir: pins}
	o1, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	ks := flowKeys(3, 0)
	w := o1.NewFlowWriter(len(ks))
	for _, k := range ks {
		w.Add(k)
	}
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	seed := o1.replies.seed
	// A writer that died between its claim and its key.
	var busy *uint64
	for i := 1; i < len(o1.replies.sets) && busy == nil; i++ {
		for w := range replyWays {
			if atomic.CompareAndSwapUint64(&o1.replies.sets[i].Tag[w], replyEmpty, replyBusy) {
				busy = &o1.replies.sets[i].Tag[w]
				break
			}
		}
	}
	busyOffset := uintptr(unsafe.Pointer(busy)) - uintptr(unsafe.Pointer(&o1.replies.mem[0]))
	o1.Close()

	o2, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	if o2.replies.seed != seed {
		t.Errorf("seed %#x after adoption, want %#x", o2.replies.seed, seed)
	}
	if err := sameFlows(flowSet(t, o2), ks); err != nil {
		t.Errorf("after adoption: %v", err)
	}
	// The program finds them where the header says.
	inst, err := o2.newInstance(1)
	if err != nil {
		t.Fatal(err)
	}
	a := &Attachment{ifname: "test", inst: inst}
	if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	for _, k := range ks {
		if ret, _ := runFrame(t, o2, a, replyFrame(t, k)); ret != xdpRedirect {
			t.Errorf("adopted reply %v: verdict %d, want redirect", k, ret)
		}
	}
	inst.close()
	if s := atomic.LoadUint64((*uint64)(unsafe.Pointer(&o2.replies.mem[busyOffset]))); s != replyEmpty {
		t.Errorf("slot left busy: state %d after adoption, want empty", s)
	}
	// A header that does not describe the table (another layout of the
	// same size, say): the next Load starts it afresh with a new seed.
	atomic.StoreUint64(&o2.replies.sets[0].Tag[0], replyMagic+1)
	o2.Close()
	o2, err = Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	if got := flowSet(t, o2); len(got) != 0 {
		t.Errorf("%d flows adopted from a table whose header is not this layout's", len(got))
	}
	if m := atomic.LoadUint64(&o2.replies.sets[0].Tag[0]); m != replyMagic {
		t.Errorf("magic %#x after starting afresh", m)
	}
	o2.Close()

	// Another size: the pinned table is replaced, empty.
	opts.MaxFlows = 1024
	o3, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer o3.Close()
	if got := flowSet(t, o3); len(got) != 0 {
		t.Errorf("%d flows in a table of another size", len(got))
	}
}
