package service

import (
	"unsafe"

	"github.com/xdproxy/xdproxy/nat/cpu"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// A Lookup at 100,000 services is a chain of cache misses: the index
// slot, the frontend it names, the frontend's port and backend sets. A
// caller that looks up a batch of keys (a worker's new flows) can take the
// chain one link at a time over the whole batch, so that the misses of
// different keys overlap: PrefetchLookup for every key, then LookupHashed
// for every key, then PrefetchSelect for every frontend found, and only
// then the decisions (Verdict, Select, NeedsMasquerade).

// PrefetchLookup prefetches the index slot where Lookup of proto, dst,
// port starts and returns the key's hash for LookupHashed.
func (t *Table) PrefetchLookup(proto packet.Proto, dst *packet.Addr, port uint16) uint64 {
	h := hashParts(dst, port, proto)
	if t != nil && len(t.index.slots) > 0 {
		cpu.Prefetch(uintptr(unsafe.Pointer(&t.index.slots[h&t.index.mask])))
	}
	return h
}

// LookupHashed is Lookup of a key whose hash PrefetchLookup returned. It
// prefetches the frontend it finds, without reading it.
func (t *Table) LookupHashed(h uint64, proto packet.Proto, dst *packet.Addr, port uint16) *Frontend {
	if t == nil {
		return nil
	}
	i := t.index.findHashed(h, dst, port, proto)
	if i < 0 {
		return nil
	}
	f := t.frontend(i)
	cpu.Prefetch(uintptr(unsafe.Pointer(f)))
	return f
}

// PrefetchSelect prefetches what Verdict, Select and NeedsMasquerade read
// of f beyond f itself: its port and its backend sets.
func (f *Frontend) PrefetchSelect() {
	cpu.Prefetch(uintptr(unsafe.Pointer(f.Port)))
	cpu.Prefetch(uintptr(unsafe.Pointer(f.backends)))
	if f.shortCircuit != f.backends {
		cpu.Prefetch(uintptr(unsafe.Pointer(f.shortCircuit)))
	}
}
