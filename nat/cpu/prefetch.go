//go:build amd64 || arm64

package cpu

// Prefetch asks the CPU to bring the cache line at addr into its caches
// and returns at once (PREFETCHT0 on amd64, PRFM PLDL1KEEP on arm64). A
// load would do the same but holds the core until the line arrives, so
// the misses of a batch could overlap only as far as the out-of-order
// window reaches; prefetches of a whole batch are in flight together. It
// never faults: addr must merely have been computed from a live slice.
func Prefetch(addr uintptr)
