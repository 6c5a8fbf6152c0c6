//go:build amd64 || arm64

package cpu

// Relax tells the CPU that the caller spins on a memory location (PAUSE
// on amd64, YIELD on arm64): it saves power, leaves the core's resources to
// a sibling hyperthread, and avoids the pipeline flush when the location
// changes. The idle spin of a worker calls it between checks of its ring.
func Relax()
