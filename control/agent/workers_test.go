package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/dataplane"
)

// TestWorkersAliveNamesAStuckWorker proves /livez's worker check on the
// real engine and workers (over a fake kernel): idle workers go round at
// least every IdleWait (200 ms), so the check passes; a worker stuck in
// its receive call fails it once, and only once, it has not gone round for
// workerStuck, naming its interface and queue; and the check passes again
// as soon as the worker turns again.
func TestWorkersAliveNamesAStuckWorker(t *testing.T) {
	e, k := startFakeEngine(t, 2)
	a := &agent{engine: e}
	proxy := health.NewProxy(health.ProxyOptions{Live: []health.Check{{Name: "workers", Err: a.workersAlive}}})

	waitFor := func(what string, within time.Duration, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, within, true,
			func(context.Context) (bool, error) { return cond(), nil }); err != nil {
			t.Fatalf("%s: not within %v", what, within)
		}
	}
	waitFor("both workers running", 5*time.Second, func() bool {
		ws := e.Workers()
		return len(ws) == 2 && ws[0].Alive() != 0 && ws[1].Alive() != 0
	})

	// Idle: nothing arrives, each worker sleeps in Wait(200ms) and goes
	// round. A second is five turns; a worker that slept without a bound
	// would show an age growing past it.
	var oldest time.Duration
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		now := dataplane.MonotonicNow()
		for _, w := range e.Workers() {
			oldest = max(oldest, time.Duration(now-w.Alive()))
		}
		if err := a.workersAlive(); err != nil {
			t.Fatalf("idle workers reported stuck: %v", err)
		}
	}
	if oldest >= time.Second {
		t.Fatalf("an idle worker went %v without a turn; it should go round every 200 ms", oldest)
	}
	t.Logf("idle: the longest a worker went without a turn was %v", oldest.Round(time.Millisecond))

	stuck, release := k.socket(1).hang()
	t.Cleanup(release) // before the engine closes: Close waits for the worker
	select {
	case <-stuck:
	case <-time.After(5 * time.Second):
		t.Fatal("the worker of queue 1 never called Receive")
	}
	hungAt := time.Now()
	var failedAt time.Time
	var failure error
	waitFor("the stuck worker reported", workerStuck+10*time.Second, func() bool {
		failure = a.workersAlive()
		failedAt = time.Now()
		return failure != nil
	})
	after := failedAt.Sub(hungAt)
	// The worker's last turn began just before it entered Receive.
	if after < workerStuck-500*time.Millisecond {
		t.Errorf("reported stuck %v after it hung; the limit is %v", after.Round(time.Millisecond), workerStuck)
	}
	if after > workerStuck+3*time.Second {
		t.Errorf("reported stuck only %v after it hung; the limit is %v", after.Round(time.Millisecond), workerStuck)
	}
	if msg := failure.Error(); !strings.Contains(msg, "the worker of "+fakeIface+" queue 1 has not gone round for") {
		t.Errorf("the error does not name the stuck worker: %q", msg)
	}
	live := proxy.Livez()
	if live.Healthy || len(live.Problems) != 1 || !strings.HasPrefix(live.Problems[0], "workers: the worker of "+fakeIface+" queue 1") {
		t.Errorf("/livez with a stuck worker: %+v", live)
	}

	release()
	waitFor("the worker going round again", 2*time.Second, func() bool { return a.workersAlive() == nil })
	if live := proxy.Livez(); !live.Healthy {
		t.Errorf("/livez after the worker recovered: %+v", live)
	}
}
