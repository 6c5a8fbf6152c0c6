// Package runner calls a sync function at a bounded frequency, the way
// kube-proxy's BoundedFrequencyRunner does: Run asks for a sync soon, bursts
// of requests coalesce into one sync (the request channel has room for one),
// two syncs start at least MinInterval apart, and a sync runs at least every
// MaxInterval even if nobody asks.
//
// Time comes from a Clock so tests can move it by hand (FakeClock); nothing
// in this package sleeps.
package runner
