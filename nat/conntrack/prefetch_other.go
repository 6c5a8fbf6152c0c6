//go:build !amd64 && !arm64

package conntrack

// prefetch is a no-op where there is no prefetch instruction to call; see
// prefetch.go.
func prefetch(addr uintptr) {}
