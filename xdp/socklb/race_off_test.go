//go:build !race

package socklb

const raceEnabled = false
