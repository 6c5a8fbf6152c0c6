package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// StartIn starts cmd inside the network namespace ns and nothing else: the
// process keeps the caller's mounts, so /sys/fs/bpf and the cgroup2 tree
// are the host's, unlike under "ip netns exec", which mounts a sysfs of the
// namespace over /sys. (That also means /sys/class/net shows the host's
// interfaces, not the namespace's.) The fork happens on a thread that has
// entered ns, and the child keeps that namespace.
func StartIn(ns string, cmd *exec.Cmd) error {
	return DoIn(ns, cmd.Start)
}

// RunIn is StartIn followed by cmd.Wait.
func RunIn(ns string, cmd *exec.Cmd) error {
	if err := StartIn(ns, cmd); err != nil {
		return err
	}
	return cmd.Wait()
}

// startInCgroup is StartIn with the child placed in the cgroup2 directory
// dir from its first instruction on (clone3 with CLONE_INTO_CGROUP).
func startInCgroup(ns, dir string, cmd *exec.Cmd) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("testbed: cgroup %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.UseCgroupFD = true
	cmd.SysProcAttr.CgroupFD = fd
	return StartIn(ns, cmd)
}

// Cgroup2Mount returns where the cgroup v2 hierarchy is mounted (e.g.
// /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host), read from
// /proc/self/mountinfo.
func Cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "36 30 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, fsType := strings.Fields(pre), strings.Fields(post)
		if ok && len(fields) >= 5 && len(fsType) >= 1 && fsType[0] == "cgroup2" && fields[3] == "/" {
			return unescapeMountPath(fields[4]), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", errors.New("testbed: no cgroup2 file system is mounted (mount -t cgroup2 none /sys/fs/cgroup/unified)")
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
// nat/conntrack has the same for the state directory; the testbed keeps
// its own because the benchmark, which builds on it, links no engine
// package (bench/runner's TestBenchLinksNoEngine).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// newCgroup creates the cgroup <cgroup2 mount>/name.
func newCgroup(name string) (string, error) {
	mnt, err := Cgroup2Mount()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(mnt, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", fmt.Errorf("testbed: create cgroup: %w", err)
	}
	return dir, nil
}

// cgroupPIDs lists the processes in the cgroup dir.
func cgroupPIDs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// removeCgroup kills every process in the cgroup dir, waits for them to
// go and removes it. A cgroup that is not there is fine.
func removeCgroup(dir string) error {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	// cgroup.kill (Linux 5.14) also catches processes forking meanwhile;
	// the loop below covers older kernels.
	_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0o644)
	var pids []int
	err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		var err error
		pids, err = cgroupPIDs(dir)
		if errors.Is(err, os.ErrNotExist) {
			return true, nil
		}
		live := 0
		for _, pid := range pids {
			if !isZombie(pid) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				live++
			}
		}
		// A zombie still counts until its parent reaps it; rmdir tells.
		if live == 0 {
			err := unix.Rmdir(dir)
			if err == nil || errors.Is(err, unix.ENOENT) {
				return true, nil
			}
			if !errors.Is(err, unix.EBUSY) {
				return false, fmt.Errorf("testbed: remove cgroup %s: %w", dir, err)
			}
		}
		return false, nil
	})
	if wait.Interrupted(err) {
		return fmt.Errorf("testbed: remove cgroup %s: processes %v still in it", dir, pids)
	}
	return err
}
