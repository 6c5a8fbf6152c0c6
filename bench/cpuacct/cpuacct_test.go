package cpuacct

import (
	"os"
	"path/filepath"
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

func TestThreadTimeGrowsWithWork(t *testing.T) {
	pid := os.Getpid()
	before, err := ProcessTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Millisecond)
	x := 0
	for time.Now().Before(deadline) {
		x++
	}
	after, err := ProcessTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	if after-before < 10*time.Millisecond {
		t.Fatalf("30ms of spinning counted as %v (x=%d)", after-before, x)
	}
	if _, err := (Probe{Threads: []int{pid}}).Read(); err != nil {
		t.Fatal(err)
	}
}
