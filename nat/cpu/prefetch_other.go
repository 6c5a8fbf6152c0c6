//go:build !amd64 && !arm64

package cpu

// Prefetch is a no-op where there is no prefetch instruction to call; see
// prefetch.go.
func Prefetch(addr uintptr) {}
