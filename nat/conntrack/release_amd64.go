//go:build amd64 && !race

package conntrack

import (
	"sync/atomic"
	"unsafe"
)

// storeRelease stores v in w with release ordering: a reader that loads w
// atomically and sees v also sees every store this goroutine made before.
// On amd64 every store is a release store (stores become visible in
// program order, and the compiler keeps stores in program order), so this
// is a plain MOV. atomic.Uint64.Store is an XCHG there, a full barrier of
// some 20 cycles: an insert writes 14 words of its entry under the seqlock
// (tryInsert), and those barriers were a fifth of its cost. The race
// detector does not know this ordering, so race builds use Store.
func storeRelease(w *atomic.Uint64, v uint64) { *(*uint64)(unsafe.Pointer(w)) = v }

// storeRelease32 is storeRelease for a 32-bit word.
func storeRelease32(w *atomic.Uint32, v uint32) { *(*uint32)(unsafe.Pointer(w)) = v }
