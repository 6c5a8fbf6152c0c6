package conntrack

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
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
	// super-block options (huge=within_size, ...), Root the directory of
	// that file system mounted there ("/" for a whole one; a bind mount
	// of a subdirectory, such as a pod's hostPath volume, has its path).
	// All are empty when the directory is not a mount point.
	FSType, Source, Options, Root string
}

// ours reports whether m is a tmpfs MountStateDir mounted (here, or where
// a bind mount of it came from).
func (m StateDirMount) ours() bool { return m.FSType == "tmpfs" && m.Source == stateMountSource }

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
// dir, creating dir, and moves the files dir held into it (an older
// xdproxy's state: the connections it tracked live on). It leaves alone a
// tmpfs it mounted before (seen through a bind mount too) and any other
// whole file system mounted at dir, and says what it found. A bind mount
// of a subdirectory, which is what a pod's hostPath volume is, gets the
// tmpfs over it: with Bidirectional propagation the node's directory gets
// it. The mount outlives the process, so the state in it outlives every
// restart until the node reboots, which a state file does not survive
// anyway (its header keeps the boot ID). It refuses while a running
// xdproxy holds the directory's connection table (its flock).
// It needs CAP_SYS_ADMIN; in a pod, a privileged init container
// (deploy/daemonset.yaml).
func MountStateDir(dir string) (StateDirMount, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return StateDirMount{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: state directory: %w", err)
	}
	m, err := StateDirMountOf(dir)
	if err != nil || m.ours() || m.HugePages() || (m.FSType != "" && m.Root == "/") {
		return m, err
	}
	// What is there now stays reachable through old once the tmpfs
	// covers the path.
	old, err := os.Open(dir)
	if err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: state directory: %w", err)
	}
	defer old.Close()
	files, err := stateFiles(old)
	if err != nil {
		return StateDirMount{}, err
	}
	if err := unix.Mount(stateMountSource, dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, StateMountOptions); err != nil {
		return StateDirMount{}, fmt.Errorf("conntrack: mounting a tmpfs at %s: %w", dir, err)
	}
	if err := moveStateFiles(old, dir, files); err != nil {
		// Uncover the files, which are still whole there.
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		return StateDirMount{}, err
	}
	m, err = StateDirMountOf(dir)
	m.Mounted = true
	return m, err
}

// stateFiles lists the regular files in the directory old, and fails if a
// running xdproxy holds one of them locked (the connection table's file).
func stateFiles(old *os.File) ([]os.DirEntry, error) {
	entries, err := old.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("conntrack: reading the state directory: %w", err)
	}
	var files []os.DirEntry
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue // the admin socket: its next owner makes a new one
		}
		fd, err := unix.Openat(int(old.Fd()), e.Name(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("conntrack: state file %s: %w", e.Name(), err)
		}
		err = unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		unix.Close(fd) // and the lock with it
		if err != nil {
			return nil, fmt.Errorf("conntrack: state file %s is in use (a running xdproxy?); stop it first: %w", e.Name(), err)
		}
		files = append(files, e)
	}
	return files, nil
}

// moveStateFiles copies files from the covered directory old into dir,
// with their modes, and then removes them from old, which nobody can
// reach any more.
func moveStateFiles(old *os.File, dir string, files []os.DirEntry) error {
	for _, e := range files {
		if err := copyStateFile(old, dir, e.Name()); err != nil {
			return err
		}
	}
	for _, e := range files {
		_ = unix.Unlinkat(int(old.Fd()), e.Name(), 0)
	}
	return nil
}

func copyStateFile(old *os.File, dir, name string) error {
	fd, err := unix.Openat(int(old.Fd()), name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("conntrack: moving state file %s: %w", name, err)
	}
	src := os.NewFile(uintptr(fd), name)
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return fmt.Errorf("conntrack: moving state file %s: %w", name, err)
	}
	dst, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, st.Mode().Perm())
	if err != nil {
		return fmt.Errorf("conntrack: moving state file %s: %w", name, err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return fmt.Errorf("conntrack: moving state file %s: %w", name, err)
	}
	if err := dst.Close(); err != nil {
		return fmt.Errorf("conntrack: moving state file %s: %w", name, err)
	}
	return nil
}

// UnmountStateDir unmounts the tmpfs MountStateDir mounted at dir, for
// xdproxy cleanup; anything else mounted there is left alone. It reports
// whether it unmounted one.
func UnmountStateDir(dir string) (bool, error) {
	m, err := StateDirMountOf(dir)
	if err != nil || !m.ours() {
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
			m = StateDirMount{FSType: f[sep+1], Source: f[sep+2], Options: f[sep+3], Root: unescapeMountPath(f[3])}
		}
	}
	return m
}

// unescapeMountPath undoes /proc/self/mountinfo's octal escapes (\040 for
// a space) in a mount point or root.
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
