package xdp

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netns"
)

// requireRoot skips tests that need CAP_NET_ADMIN and CAP_BPF.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("needs root: creates network namespaces and loads BPF programs")
		}
		t.Fatal("needs root: creates network namespaces and loads BPF programs; make test runs as root")
	}
}

var nsSeq atomic.Int32

// newNetns creates a named network namespace that is deleted when the test
// ends, pass or fail.
func newNetns(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("xdpt-%d-%d", os.Getpid(), nsSeq.Add(1))
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	return name
}

func run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// inNetns runs fn on an OS thread that is in namespace ns. The thread stays
// locked when fn returns, so the runtime ends it instead of reusing it in
// the wrong namespace.
func inNetns(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(ns)
		if err != nil {
			errc <- err
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// vethPair makes namespaces a and b joined by a veth, a0 198.18.0.1/24 in a
// and b0 198.18.0.2/24 in b, both up.
func vethPair(t *testing.T) (a, b string) {
	t.Helper()
	a, b = newNetns(t), newNetns(t)
	run(t, "ip", "link", "add", "a0", "netns", a, "type", "veth", "peer", "b0", "netns", b)
	run(t, "ip", "-n", a, "addr", "add", "198.18.0.1/24", "dev", "a0")
	run(t, "ip", "-n", b, "addr", "add", "198.18.0.2/24", "dev", "b0")
	for _, ns := range []string{a, b} {
		run(t, "ip", "-n", ns, "link", "set", "lo", "up")
	}
	run(t, "ip", "-n", a, "link", "set", "a0", "up")
	run(t, "ip", "-n", b, "link", "set", "b0", "up")
	return a, b
}
