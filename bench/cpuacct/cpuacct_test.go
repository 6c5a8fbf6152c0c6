package cpuacct

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

func TestReadCPUFrom(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stat")
	data := "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\ncpu1 10 20 30 40 50 60 70 80 0 0\nintr 1\n"
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := readCPUFrom(path, 1)
	if err != nil {
		t.Fatal(err)
	}
	if c.Busy() != 10+20+30+60+70 || c.Total() != 10+20+30+40+50+60+70+80 {
		t.Fatalf("busy %d total %d", c.Busy(), c.Total())
	}
	if c.BusyTime() != 1900*time.Millisecond {
		t.Fatalf("busy time %v", c.BusyTime())
	}
	d := c.Sub(CPUTimes{User: 10})
	if d.User != 0 || d.Nice != 20 {
		t.Fatalf("sub %+v", d)
	}
	if _, err := readCPUFrom(path, 7); err == nil {
		t.Fatal("missing cpu7 not reported")
	}
}

// TestThreadTimeGrowsWithWork: 20ms of CPU time (by getrusage, so that a
// busy machine descheduling the test does not matter) shows in
// ProcessTime.
func TestThreadTimeGrowsWithWork(t *testing.T) {
	pid := os.Getpid()
	before, err := ProcessTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	cpu := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	start, deadline := cpu(), time.Now().Add(10*time.Second)
	x := 0
	for cpu()-start < 20*time.Millisecond && time.Now().Before(deadline) {
		for range 10000 {
			x++
		}
	}
	after, err := ProcessTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	if after-before < 15*time.Millisecond {
		t.Fatalf("20ms of CPU time (getrusage) counted as %v (x=%d)", after-before, x)
	}
	if _, err := (Probe{Threads: []int{pid}}).Read(); err != nil {
		t.Fatal(err)
	}
}
