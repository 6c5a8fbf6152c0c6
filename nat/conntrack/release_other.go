//go:build !amd64 || race

package conntrack

import "sync/atomic"

// storeRelease stores v in w with release ordering (see release_amd64.go).
// atomic.Uint64.Store gives it everywhere; on arm64 it is an STLR, itself a
// release store.
func storeRelease(w *atomic.Uint64, v uint64) { w.Store(v) }

// storeRelease32 is storeRelease for a 32-bit word.
func storeRelease32(w *atomic.Uint32, v uint32) { w.Store(v) }
