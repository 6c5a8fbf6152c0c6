//go:build !amd64 && !arm64

package cpu

// Relax is a no-op where there is no spin-wait hint; see relax.go.
func Relax() {}
