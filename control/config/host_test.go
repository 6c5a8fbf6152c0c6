package config

import (
	"reflect"
	"testing"
)

func TestCPUList(t *testing.T) {
	cases := []struct {
		in, out string
		cpus    []int
	}{
		{"0-1\n", "0-1", []int{0, 1}},
		{"0", "0", []int{0}},
		{"0-3,8,10-11", "0-3,8,10-11", []int{0, 1, 2, 3, 8, 10, 11}},
		{"4,0-1,1", "0-1,4", []int{0, 1, 4}},
		{"", "", nil},
	}
	for _, c := range cases {
		got, err := parseCPUList(c.in)
		if err != nil || !reflect.DeepEqual(got, c.cpus) {
			t.Errorf("parseCPUList(%q) = %v, %v; want %v", c.in, got, err, c.cpus)
		}
		if s := formatCPUList(got); s != c.out {
			t.Errorf("formatCPUList(%v) = %q, want %q", got, s, c.out)
		}
	}
	for _, bad := range []string{"a", "1-", "3-1", "-1", "0-5000"} {
		if _, err := parseCPUList(bad); err == nil {
			t.Errorf("parseCPUList(%q): no error", bad)
		}
	}
}

func TestCheckCPU(t *testing.T) {
	h := Host{CPUs: []int{0, 1}, OnlineCPUs: []int{0, 1, 2, 3}}
	for cpu, want := range map[int]string{
		1: "",
		3: "CPU 3 is outside this process's CPU affinity (it may run on CPUs 0-1)",
		4: "CPU 4 does not exist (this machine has CPUs 0-3)",
	} {
		if got := h.checkCPU(cpu); got != want {
			t.Errorf("CPU %d: %q, want %q", cpu, got, want)
		}
	}
	if got := (Host{CPUs: []int{0, 1}}).checkCPU(2); got != "CPU 2 does not exist (this machine has CPUs 0-1)" {
		t.Errorf("without OnlineCPUs: %q", got)
	}
	if got := (Host{}).checkCPU(77); got != "" {
		t.Errorf("the zero Host checks nothing, got %q", got)
	}
}
