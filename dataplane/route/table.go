package route

// wordKey is a 128-bit address as two native-order words plus a small
// qualifier (the interface index for neighbours, 0 for prefixes).
type wordKey struct {
	w0, w1 uint64
	aux    uint32
}

func (k wordKey) hash() uint64 {
	h := k.w0*0x9e3779b97f4a7c15 ^ k.w1*0xc2b2ae3d27d4eb4f ^ uint64(k.aux)*0x165667b19e3779f9
	return h ^ h>>31
}

// fixedTable is a read-only open-addressing hash table built once per
// snapshot. It exists because Go maps hash 16-byte keys with a general
// hash that costs more than the rest of a lookup; this one is a few
// multiplications. Keys and values hold no pointers, so the garbage
// collector never scans the slots.
type fixedTable[V any] struct {
	slots []fixedSlot[V]
	mask  uint64
}

type fixedSlot[V any] struct {
	key  wordKey
	used bool
	val  V
}

// newFixedTable sizes a table for n keys at most half full.
func newFixedTable[V any](n int) fixedTable[V] {
	size := 8
	for size < 2*n {
		size *= 2
	}
	return fixedTable[V]{slots: make([]fixedSlot[V], size), mask: uint64(size - 1)}
}

// put inserts or overwrites k.
func (t *fixedTable[V]) put(k wordKey, v V) {
	for i := k.hash() & t.mask; ; i = (i + 1) & t.mask {
		s := &t.slots[i]
		if !s.used || s.key == k {
			s.key, s.used, s.val = k, true, v
			return
		}
	}
}

// get returns a pointer to k's value, or nil.
func (t *fixedTable[V]) get(k wordKey) *V {
	if len(t.slots) == 0 {
		return nil
	}
	for i := k.hash() & t.mask; ; i = (i + 1) & t.mask {
		s := &t.slots[i]
		if !s.used {
			return nil
		}
		if s.key == k {
			return &s.val
		}
	}
}
