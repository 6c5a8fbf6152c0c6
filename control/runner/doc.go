// Package runner calls a sync function at a bounded frequency, the way
// kube-proxy's BoundedFrequencyRunner does: Run asks for a sync soon, bursts
// of requests coalesce into one sync (the request channel has room for one),
// two syncs start at least MinInterval apart, and a sync runs at least every
// MaxInterval even if nobody asks. A function that failed asks for another
// go with RetryAfter, as with kube-proxy's runner.
//
// Retry paces such retries: exponential backoff (1 s doubling to 30 s by
// default, k8s.io/apimachinery's wait.Backoff), reset by a success, and a
// rule for which failures to log (the first, then one per 30 s) so that a
// lasting failure does not flood the log. The service sources use it for a
// publish that failed.
//
// Time comes from a Clock so tests can move it by hand (FakeClock); nothing
// in this package sleeps.
package runner
