// Package cpu holds the two instructions the per-packet path needs that Go
// does not emit: Prefetch (bring a cache line in without waiting for it)
// and Relax (the spin-wait hint). They are assembly functions, so each
// call costs a call; callers issue prefetches in short loops over a batch
// (see dataplane's fastpath.go).
package cpu
