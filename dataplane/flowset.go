package dataplane

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"

	"github.com/xdproxy/xdproxy/xdp"
)

// flowSet is the set of reply tuples the flow reconciler found in the XDP
// flow map during one pass, kept by their 64-bit hashes in one
// pointer-free open-addressing table that the next pass reuses. A Go map of
// the tuples themselves allocated and hashed a table of every tuple each
// pass (tens of megabytes at a million flows, on every pass), and half of the
// pass's time went there during a flood of new flows.
//
// Two tuples with the same 64-bit hash count as one: the pass would then
// not write back the second if it were missing from the map, once in about
// 10^13 passes at a million tuples; the next pass would.
type flowSet struct {
	slots []uint64 // hash, 0 for an empty slot (a zero hash is stored as 1)
	n     int
}

// reset empties the set, keeping its memory.
func (s *flowSet) reset() {
	clear(s.slots)
	s.n = 0
}

// flowSetHash hashes k's fields (not its memory: its padding byte is not
// always zero).
func flowSetHash(k *xdp.FlowKey) uint64 {
	var b [37]byte
	copy(b[0:16], k.Src[:])
	copy(b[16:32], k.Dst[:])
	binary.BigEndian.PutUint16(b[32:34], k.SrcPort)
	binary.BigEndian.PutUint16(b[34:36], k.DstPort)
	b[36] = byte(k.Proto)
	h := xxhash.Sum64(b[:])
	if h == 0 {
		h = 1
	}
	return h
}

// add puts k in the set.
func (s *flowSet) add(k *xdp.FlowKey) {
	if 2*(s.n+1) > len(s.slots) {
		s.grow()
	}
	if s.insert(flowSetHash(k)) {
		s.n++
	}
}

// has reports whether k is in the set.
func (s *flowSet) has(k *xdp.FlowKey) bool {
	if len(s.slots) == 0 {
		return false
	}
	h := flowSetHash(k)
	return *s.slot(h) == h
}

// len is the number of distinct hashes in the set.
func (s *flowSet) len() int { return s.n }

// insert puts h in the table and reports whether it was not there yet.
func (s *flowSet) insert(h uint64) bool {
	p := s.slot(h)
	if *p == h {
		return false
	}
	*p = h
	return true
}

// slot is the slot holding h, or the empty slot where it goes.
func (s *flowSet) slot(h uint64) *uint64 {
	mask := uint64(len(s.slots) - 1)
	for i := h & mask; ; i = (i + 1) & mask {
		if v := s.slots[i]; v == h || v == 0 {
			return &s.slots[i]
		}
	}
}

// grow doubles the table (at least 1024 slots), keeping it at most half
// full so that probes stay short.
func (s *flowSet) grow() {
	old := s.slots
	s.slots = make([]uint64, max(1024, 2*len(old)))
	for _, h := range old {
		if h != 0 {
			s.insert(h)
		}
	}
}
