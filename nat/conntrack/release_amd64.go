//go:build amd64 && !race

package conntrack

import (
	"sync/atomic"
	"unsafe"
)

// storeRelease stores v in w with release ordering: a reader that loads w
// atomically and sees v also sees every store this goroutine made before.
// On amd64 the processor makes stores visible in program order, so this is
// a plain MOV; atomic.Uint64.Store is an XCHG there, a full barrier of
// some 20 cycles, and an insert writes 14 words of its entry under the
// seqlock (tryInsert): those barriers were a fifth of its cost. That the
// compiler also keeps these stores in program order is how gc compiles
// them (every store is ordered on one memory chain), not a promise of the
// Go memory model, to which they race with the readers' atomic loads; and
// gc drops a store that a later store to the same word overwrites with no
// load between, so a word written twice must not use this (the sequence
// number's odd store is a Store). The race detector does not know this
// ordering, so race builds use Store.
func storeRelease(w *atomic.Uint64, v uint64) { *(*uint64)(unsafe.Pointer(w)) = v }

// storeRelease32 is storeRelease for a 32-bit word.
func storeRelease32(w *atomic.Uint32, v uint32) { *(*uint32)(unsafe.Pointer(w)) = v }
