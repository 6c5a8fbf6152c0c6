package testbed

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ownerPID parses the PID out of a name "xdpt-<pid>-...".
func ownerPID(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, Prefix)
	if !ok {
		return 0, false
	}
	digits, _, _ := strings.Cut(rest, "-")
	pid, err := strconv.Atoi(digits)
	return pid, err == nil && pid > 0
}

func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// CleanupStale deletes the namespaces (and the processes in them) and the
// cgroups (and the processes in them) left by testbeds whose creating
// process no longer exists, such as runs killed by a timeout. It returns
// what it deleted.
func CleanupStale() ([]string, error) {
	var deleted []string
	var errs []error
	entries, err := os.ReadDir("/run/netns")
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range entries {
		pid, ok := ownerPID(e.Name())
		if !ok || processAlive(pid) {
			continue
		}
		if err := deleteNamespace(e.Name()); err != nil {
			errs = append(errs, err)
			continue
		}
		deleted = append(deleted, e.Name())
	}
	if mnt, err := Cgroup2Mount(); err == nil {
		dirs, _ := filepath.Glob(filepath.Join(mnt, Prefix+"*"))
		for _, d := range dirs {
			pid, ok := ownerPID(filepath.Base(d))
			if !ok || processAlive(pid) {
				continue
			}
			if err := removeCgroup(d); err != nil {
				errs = append(errs, err)
				continue
			}
			deleted = append(deleted, d)
		}
	}
	return deleted, errors.Join(errs...)
}
