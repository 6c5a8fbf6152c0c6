package conntrack

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The state file is mapped memory that the per-packet path reads at
// random, like the heap slab, but huge pages for it are the file system's
// to give: a tmpfs gives them only when mounted with huge=within_size (or
// always, or advise with the MADV_HUGEPAGE prepareMapped asks for), and a
// plain /run or /dev/shm has huge=never. On 4 KiB pages every new flow's
// entry and most lookups also miss the TLB: BenchmarkStateFilePages, on
// this project's VM, costs an insert about twice as much on a 4 KiB tmpfs
// as on a huge one. MountStateDir makes the right tmpfs; the table reports
// what it got (RestoreInfo.HugePages).

// StateMountOptions are the tmpfs options MountStateDir mounts with.
const StateMountOptions = "huge=within_size,mode=0700"

// StateDirMount describes the file system at a state directory.
type StateDirMount struct {
	// Mounted is true when MountStateDir mounted it just now.
	Mounted bool
	// FSType is the file system's type (tmpfs, ext4, ...), Source what
	// was mounted (stateMountSource for MountStateDir's), Options its
	// super-block options (huge=within_size, ...). All are empty when the
	// directory is not a mount point of its own.
	FSType, Source, Options string
}

// stateMountSource names MountStateDir's tmpfs in the mount table, so that
// UnmountStateDir takes away only what it made.
const stateMountSource = "xdproxy-state"

// HugePages reports whether the file system gives huge pages to a file
// mapped the way openState maps it.
func (m StateDirMount) HugePages() bool {
	if m.FSType != "tmpfs" {
		return false
	}
	for _, o := range strings.Split(m.Options, ",") {
		switch o {
		case "huge=within_size", "huge=always", "huge=advise":
			return true
		}
	}
	return false
}

func (m StateDirMount) String() string {
	switch {
	case m.FSType == "":
		return "not a mount point"
	case m.Mounted:
		return fmt.Sprintf("mounted %s (%s)", m.FSType, m.Options)
	default:
		return fmt.Sprintf("already a mount point: %s (%s)", m.FSType, m.Options)
	}
}

// MountStateDir mounts a tmpfs with huge pages (StateMountOptions) at
// dir, creating dir, unless dir is a mount point already: that one is
// left as it is, and reported. The mount outlives the process, so the
// state file in it outlives every restart until the node reboots, which
// a state file does not survive anyway (its header keeps the boot ID).
// It needs CAP_SYS_ADMIN; in a pod, a privileged init container with
// Bidirectional mount propagation on the directory's hostPath volume
// (deploy/daemonset.yaml), so that the node's mount namespace has it.
func MountStateDir(dir string) (StateDirMount, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return StateDirMount{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: state directory: %w", err)
	}
	if m, err := StateDirMountOf(dir); err != nil || m.FSType != "" {
		return m, err
	}
	if err := unix.Mount(stateMountSource, dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, StateMountOptions); err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: mounting a tmpfs at %s: %w", dir, err)
	}
	m, err := StateDirMountOf(dir)
	m.Mounted = true
	return m, err
}

// UnmountStateDir unmounts the tmpfs MountStateDir mounted at dir, for
// xdproxy cleanup; anything else mounted there is left alone. It reports
// whether it unmounted one.
func UnmountStateDir(dir string) (bool, error) {
	m, err := StateDirMountOf(dir)
	if err != nil || m.FSType != "tmpfs" || m.Source != stateMountSource {
		return false, err
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return false, fmt.Errorf("conntrack: unmounting the state directory %s: %w", dir, err)
	}
	return true, nil
}

// StateDirMountOf describes the mount at dir (the last one mounted
// there), from /proc/self/mountinfo; an empty FSType when dir is not a
// mount point.
func StateDirMountOf(dir string) (StateDirMount, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return StateDirMount{}, err
	}
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: reading mounts: %w", err)
	}
	return mountAt(b, dir), nil
}

// OnTmpfs reports whether dir is on a tmpfs: memory that the kernel does
// not write back to a disk as the table changes, as it would a state file
// on ext4 or xfs.
func OnTmpfs(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.TMPFS_MAGIC
}

// mountAt finds dir in a mountinfo listing (proc(5)): "id parent dev root
// mountpoint options [optional...] - fstype source superoptions".
func mountAt(mountinfo []byte, dir string) StateDirMount {
	var m StateDirMount
	sc := bufio.NewScanner(bytes.NewReader(mountinfo))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || len(f) < sep+4 {
			continue
		}
		if unescapeMountPath(f[4]) == dir {
			m = StateDirMount{FSType: f[sep+1], Source: f[sep+2], Options: f[sep+3]}
		}
	}
	return m
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// mappedHuge reports whether any of the mapping at data is mapped with
// huge pages, from /proc/self/smaps (the PmdMapped lines of its entry).
func mappedHuge(data []byte) bool {
	if len(data) == 0 {
		return false
	}
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return false
	}
	defer f.Close()
	head := strconv.FormatUint(uint64(uintptr(unsafe.Pointer(&data[0]))), 16) + "-"
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := sc.Text()
		name, val, attr := strings.Cut(line, ":")
		if first, _, _ := strings.Cut(line, " "); !strings.HasSuffix(first, ":") {
			// A mapping's header, "start-end perms offset dev inode
			// path", rather than one of its "Name: value" lines.
			in = strings.HasPrefix(line, head)
			continue
		}
		if !in || !attr || !strings.HasSuffix(name, "PmdMapped") {
			continue
		}
		if kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(val), " kB")); err == nil && kb > 0 {
			return true
		}
	}
	return false
}
