package cpuacct

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// CPUTimes are one CPU's /proc/stat counters in USER_HZ ticks.
type CPUTimes struct {
	User, Nice, System, Idle, IOWait, IRQ, SoftIRQ, Steal uint64
}

// Busy is the time the CPU did work: user, nice, system, irq and softirq
// (steal and iowait are not work done here).
func (c CPUTimes) Busy() uint64 { return c.User + c.Nice + c.System + c.IRQ + c.SoftIRQ }

// Total counts every tick, idle included.
func (c CPUTimes) Total() uint64 { return c.Busy() + c.Idle + c.IOWait + c.Steal }

// Sub returns the counters of the interval between o and c.
func (c CPUTimes) Sub(o CPUTimes) CPUTimes {
	return CPUTimes{c.User - o.User, c.Nice - o.Nice, c.System - o.System, c.Idle - o.Idle,
		c.IOWait - o.IOWait, c.IRQ - o.IRQ, c.SoftIRQ - o.SoftIRQ, c.Steal - o.Steal}
}

// UserHZ is the tick of /proc/stat on Linux.
const UserHZ = 100

// BusyTime converts Busy ticks to a duration.
func (c CPUTimes) BusyTime() time.Duration { return time.Duration(c.Busy()) * time.Second / UserHZ }

// ReadCPU reads the line "cpuN" of /proc/stat.
func ReadCPU(cpu int) (CPUTimes, error) { return readCPUFrom("/proc/stat", cpu) }

func readCPUFrom(path string, cpu int) (CPUTimes, error) {
	f, err := os.Open(path)
	if err != nil {
		return CPUTimes{}, err
	}
	defer f.Close()
	want := "cpu" + strconv.Itoa(cpu)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 9 || fields[0] != want {
			continue
		}
		var v [8]uint64
		for i := range v {
			if v[i], err = strconv.ParseUint(fields[i+1], 10, 64); err != nil {
				return CPUTimes{}, fmt.Errorf("cpuacct: %s field %d: %w", want, i+1, err)
			}
		}
		return CPUTimes{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]}, nil
	}
	if err := sc.Err(); err != nil {
		return CPUTimes{}, err
	}
	return CPUTimes{}, fmt.Errorf("cpuacct: no %s line in %s", want, path)
}

// ThreadTime returns the time a thread (or process main thread) has run,
// from /proc/<tid>/schedstat.
func ThreadTime(tid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", tid))
	if err != nil {
		return 0, err
	}
	fields := strings.Fields(string(b))
	if len(fields) < 1 {
		return 0, fmt.Errorf("cpuacct: empty schedstat for %d", tid)
	}
	ns, err := strconv.ParseUint(fields[0], 10, 64)
	return time.Duration(ns), err
}

// ProcessTime sums ThreadTime over every thread of pid.
func ProcessTime(pid int) (time.Duration, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	if err != nil {
		return 0, err
	}
	if len(tasks) == 0 {
		return 0, fmt.Errorf("cpuacct: process %d has no tasks", pid)
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(t, "schedstat"))
		if err != nil {
			continue // the thread exited
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			ns, _ := strconv.ParseUint(f[0], 10, 64)
			sum += time.Duration(ns)
		}
	}
	return sum, nil
}

// Probe sums the run time of a fixed set of threads and processes.
type Probe struct {
	Threads   []int
	Processes []int
}

// Read returns the summed run time now.
func (p Probe) Read() (time.Duration, error) {
	var sum time.Duration
	for _, t := range p.Threads {
		d, err := ThreadTime(t)
		if err != nil {
			return 0, err
		}
		sum += d
	}
	for _, pid := range p.Processes {
		d, err := ProcessTime(pid)
		if err != nil {
			return 0, err
		}
		sum += d
	}
	return sum, nil
}
