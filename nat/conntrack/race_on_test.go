//go:build race

package conntrack

// raceEnabled shortens the long tests, which the race detector slows ~10x.
const raceEnabled = true
