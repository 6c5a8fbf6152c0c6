//go:build race

package socklb

// raceEnabled: the race detector slows every client process (the test
// binary started again) so much that the tests that time connects across
// processes cannot hold; they skip those checks.
const raceEnabled = true
