package config

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Host is what validation needs to know about the machine a configuration
// is for. Parse and Load use ThisHost; tests pass their own in Options.
type Host struct {
	// CPUs are the CPUs the process may run on (its affinity mask), in
	// increasing order. Empty skips the checks of interfaces[].cpus.
	CPUs []int
	// OnlineCPUs are the CPUs the machine has online; empty means the
	// same as CPUs. They only make the error for a CPU outside CPUs say
	// whether it does not exist or is merely out of reach.
	OnlineCPUs []int
}

// ThisHost describes the machine and the process it runs in: CPUs from
// sched_getaffinity, OnlineCPUs from /sys/devices/system/cpu/online.
func ThisHost() (Host, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return Host{}, fmt.Errorf("config: reading the CPU affinity: %w", err)
	}
	var h Host
	for cpu := range maxCPUs {
		if set.IsSet(cpu) {
			h.CPUs = append(h.CPUs, cpu)
		}
	}
	if b, err := os.ReadFile("/sys/devices/system/cpu/online"); err == nil {
		h.OnlineCPUs, _ = parseCPUList(string(b)) // unreadable: fall back to CPUs
	}
	return h, nil
}

// maxCPUs is the size of the kernel's default CPU mask (CPU_SETSIZE), and
// of unix.CPUSet.
const maxCPUs = 1024

// checkCPU says why cpu cannot run a worker on h, or "" if it can.
func (h Host) checkCPU(cpu int) string {
	if len(h.CPUs) == 0 || slices.Contains(h.CPUs, cpu) {
		return ""
	}
	online := h.OnlineCPUs
	if len(online) == 0 {
		online = h.CPUs
	}
	if !slices.Contains(online, cpu) {
		return fmt.Sprintf("CPU %d does not exist (this machine has CPUs %s)", cpu, formatCPUList(online))
	}
	return fmt.Sprintf("CPU %d is outside this process's CPU affinity (it may run on CPUs %s)", cpu, formatCPUList(h.CPUs))
}

// parseCPUList reads the kernel's CPU list format ("0-3,8,10-11").
func parseCPUList(s string) ([]int, error) {
	var out []int
	for part := range strings.SplitSeq(strings.TrimSpace(s), ",") {
		if part == "" {
			continue
		}
		a, b, isRange := strings.Cut(part, "-")
		lo, err1 := strconv.Atoi(a)
		hi, err2 := lo, error(nil)
		if isRange {
			hi, err2 = strconv.Atoi(b)
		}
		if err1 != nil || err2 != nil || lo < 0 || hi < lo || hi >= maxCPUs {
			return nil, fmt.Errorf("config: %q is not a CPU list", s)
		}
		for c := lo; c <= hi; c++ {
			out = append(out, c)
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// formatCPUList writes sorted CPU numbers in the kernel's list format.
func formatCPUList(cpus []int) string {
	var b strings.Builder
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(cpus[i]))
		if j > i {
			b.WriteString("-" + strconv.Itoa(cpus[j]))
		}
		i = j + 1
	}
	return b.String()
}
