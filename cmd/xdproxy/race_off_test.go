//go:build !race

package main

// raceDetector is true in a test binary built with -race: the daemon the
// tests start is that binary too, many times slower per packet.
const raceDetector = false
