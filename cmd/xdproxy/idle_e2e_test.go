package main

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// processCPU is the CPU time (user and system, every thread) process pid
// has used so far, from /proc/<pid>/stat (in clock ticks of 10 ms).
func processCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	// The command name may hold spaces: the fields after it start
	// after the last ')'; utime and stime are fields 14 and 15.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// TestIdleDaemonCostsLittle: the daemon, serving two interfaces and the
// exception link with a table published and no traffic, uses well under
// 1% of a CPU over 10 s, every thread counted (workers asleep in poll(),
// the SYN guard's and the reconciler's timers, link checks); the CPU
// clock's 10 ms ticks make 1% of 10 s ten ticks.
func TestIdleDaemonCostsLittle(t *testing.T) {
	tb := newTopology(t, testbed.Options{})
	a := newAgent(t, tb, serviceFile(webSvc), agentOptions{})
	if _, err := get(tb, "http://198.19.0.10/"); err != nil {
		t.Fatalf("the service does not answer: %v\n%s", err, a.dump())
	}
	time.Sleep(time.Second) // the request's flow settles
	pid := a.cmd.Process.Pid
	before, start := processCPU(t, pid), time.Now()
	time.Sleep(10 * time.Second)
	used, el := processCPU(t, pid)-before, time.Since(start)
	share := float64(used) / float64(el)
	t.Logf("idle: %v of CPU in %v (%.2f%% of a CPU)", used, el.Round(time.Millisecond), 100*share)
	if share >= 0.01 {
		t.Errorf("the idle daemon used %.2f%% of a CPU, want well under 1%%\n%s", 100*share, a.dump())
	}
}
