package conntrack

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// mountTmpfs mounts a tmpfs with options at a new directory, unmounted
// when the test ends, pass or fail.
func mountTmpfs(tb testing.TB, options string) string {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root: mounts a tmpfs")
	}
	dir := filepath.Join(tb.TempDir(), "state")
	if err := os.Mkdir(dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := unix.Mount("xdproxy-test", dir, "tmpfs", 0, options); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// thpAvailable reports whether this kernel gives a tmpfs mounted with
// huge= transparent huge pages (shmem_enabled deny or force overrides the
// mount).
func thpAvailable() bool {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	return err == nil && !strings.Contains(string(b), "[deny]")
}

// TestMountStateDir: MountStateDir mounts a tmpfs with huge pages once,
// leaves a mount point it finds alone, and a table whose state file is
// there reports huge pages; one on a tmpfs without them reports 4 KiB
// pages.
func TestMountStateDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs")
	}
	dir := filepath.Join(t.TempDir(), "run", "xdproxy") // not there yet
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	m, err := MountStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !m.Mounted || m.FSType != "tmpfs" || !m.HugePages() {
		t.Fatalf("first call: %+v (%s), want a tmpfs with huge pages, mounted", m, m)
	}
	again, err := MountStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if again.Mounted || again.FSType != "tmpfs" || !again.HugePages() {
		t.Fatalf("second call: %+v (%s), want the first one's mount, left alone", again, again)
	}
	// Exactly one tmpfs is mounted there.
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("%d mounts at %s, want 1", n, dir)
	}

	plain := mountTmpfs(t, "huge=never")
	if pm, err := StateDirMountOf(plain); err != nil || pm.FSType != "tmpfs" || pm.HugePages() {
		t.Fatalf("StateDirMountOf(huge=never tmpfs) = %+v, %v", pm, err)
	}
	for _, c := range []struct {
		dir  string
		huge bool
	}{{dir, thpAvailable()}, {plain, false}} {
		tb := newTable(t, Config{Capacity: 1 << 16, StatePath: filepath.Join(c.dir, "ct.state")})
		got := tb.Restored().HugePages
		if err := tb.Close(); err != nil {
			t.Fatal(err)
		}
		if got != c.huge {
			t.Errorf("state file in %s: HugePages %v, want %v", c.dir, got, c.huge)
		}
	}

	// A whole file system mounted there by someone else stays.
	if m, err := MountStateDir(plain); err != nil || m.Mounted || m.FSType != "tmpfs" {
		t.Errorf("MountStateDir(a tmpfs of someone else's) = %+v, %v; want it left alone", m, err)
	}

	// xdproxy cleanup takes away only the tmpfs MountStateDir made.
	if ok, err := UnmountStateDir(plain); ok || err != nil {
		t.Errorf("UnmountStateDir(a tmpfs of someone else's) = %v, %v; want it left alone", ok, err)
	}
	if ok, err := UnmountStateDir(dir); !ok || err != nil {
		t.Fatalf("UnmountStateDir = %v, %v", ok, err)
	}
	if m, err := StateDirMountOf(dir); err != nil || m.FSType != "" {
		t.Errorf("after UnmountStateDir: %+v, %v; want no mount", m, err)
	}
	if ok, err := UnmountStateDir(dir); ok || err != nil {
		t.Errorf("second UnmountStateDir = %v, %v; want nothing to do", ok, err)
	}
}

// TestMountStateDirOverHostPath: a pod sees its hostPath volume as a bind
// mount of the node's directory. MountStateDir mounts its tmpfs over that
// bind and moves the files an older xdproxy kept there into it, so that
// their connections live on; while a running xdproxy holds the connection
// table's lock it refuses, and mounts nothing.
func TestMountStateDirOverHostPath(t *testing.T) {
	host := mountTmpfs(t, "huge=never") // the node's /run
	nodeDir := filepath.Join(host, "xdproxy")
	if err := os.Mkdir(nodeDir, 0o700); err != nil {
		t.Fatal(err)
	}
	state := []byte("an older xdproxy's connections")
	if err := os.WriteFile(filepath.Join(nodeDir, "conntrack.state"), state, 0o600); err != nil {
		t.Fatal(err)
	}
	podDir := filepath.Join(t.TempDir(), "run-xdproxy")
	if err := os.Mkdir(podDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(nodeDir, podDir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(podDir, unix.MNT_DETACH) }) // then the bind
	t.Cleanup(func() { _ = unix.Unmount(podDir, unix.MNT_DETACH) }) // the tmpfs first
	if m, err := StateDirMountOf(podDir); err != nil || m.Root != "/xdproxy" || m.ours() {
		t.Fatalf("the bind mount reads as %+v, %v", m, err)
	}

	// A running xdproxy's lock: refused, nothing mounted.
	held, err := os.Open(filepath.Join(nodeDir, "conntrack.state"))
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(held.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if _, err := MountStateDir(podDir); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("with the state file locked: %v, want a refusal", err)
	}
	held.Close()
	if m, _ := StateDirMountOf(podDir); m.ours() {
		t.Fatal("mounted although refused")
	}

	m, err := MountStateDir(podDir)
	if err != nil || !m.Mounted || !m.ours() {
		t.Fatalf("MountStateDir over the bind = %+v, %v", m, err)
	}
	if got, err := os.ReadFile(filepath.Join(podDir, "conntrack.state")); err != nil || string(got) != string(state) {
		t.Errorf("the state file in the tmpfs: %q, %v; want the older one's", got, err)
	}
	if left, _ := os.ReadDir(nodeDir); len(left) != 0 {
		t.Errorf("left under the tmpfs: %v", left)
	}
	if again, err := MountStateDir(podDir); err != nil || again.Mounted {
		t.Errorf("second call: %+v, %v; want its own tmpfs left alone", again, err)
	}
}

// TestMountAt reads mountinfo lines: the last mount at a path wins,
// optional fields and escaped paths are handled, and a path with no mount
// of its own has none.
func TestMountAt(t *testing.T) {
	info := []byte(`22 1 0:21 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1609212k,mode=755
30 22 0:40 / /run/xdproxy rw,relatime shared:9 - ext4 /dev/sda1 rw
31 30 0:41 / /run/xdproxy rw,nosuid,nodev,noexec,relatime shared:10 - tmpfs xdproxy-state rw,mode=700,huge=within_size
32 1 0:42 / /var/lib/my\040state rw - tmpfs x rw,huge=advise
33 1 0:43 / /broken
40 1 0:21 /xdproxy /pod/run/xdproxy rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1609212k,mode=755
`)
	for _, c := range []struct {
		dir, fs, root string
		huge, ours    bool
	}{
		{"/run/xdproxy", "tmpfs", "/", true, true},
		{"/run", "tmpfs", "/", false, false},
		{"/var/lib/my state", "tmpfs", "/", true, false},
		{"/run/other", "", "", false, false},
		{"/broken", "", "", false, false},
		{"/pod/run/xdproxy", "tmpfs", "/xdproxy", false, false}, // a hostPath volume
	} {
		m := mountAt(info, c.dir)
		if m.FSType != c.fs || m.Root != c.root || m.HugePages() != c.huge || m.ours() != c.ours {
			t.Errorf("mountAt(%q) = %+v (huge %v, ours %v), want %q at %q, huge %v, ours %v",
				c.dir, m, m.HugePages(), m.ours(), c.fs, c.root, c.huge, c.ours)
		}
	}
}

// BenchmarkStateFilePages is an insert into a table whose state file is on
// a tmpfs with huge pages, and on one without: the cost of 4 KiB pages
// (TLB misses) for the slab a node's table lives in.
func BenchmarkStateFilePages(b *testing.B) {
	for _, c := range []struct{ name, options string }{{"huge", "huge=within_size"}, {"4k", "huge=never"}} {
		b.Run(c.name, func(b *testing.B) {
			const capacity = 1 << 20
			dir := mountTmpfs(b, c.options)
			open := func() *Table {
				path := filepath.Join(dir, "ct.state")
				_ = os.Remove(path)
				return newTable(b, Config{Capacity: capacity, StatePath: path})
			}
			tb := open()
			if want := c.name == "huge" && thpAvailable(); tb.Restored().HugePages != want {
				b.Fatalf("HugePages %v, want %v", tb.Restored().HugePages, want)
			}
			i := 0
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if i == capacity/2 {
					b.StopTimer()
					_ = tb.Close()
					tb, i = open(), 0
					b.StartTimer()
				}
				// Spread over the shards like real flows (benchOrig's
				// tuples are in order, and so would be their entries).
				j := int(uint32(i) * 2654435761 % capacity)
				if _, res := tb.Insert(benchOrig(j), benchTranslated(j), DNAT, 1, 0); res != Inserted {
					b.Fatalf("insert %d: %v", i, res)
				}
				i++
			}
			b.StopTimer()
			_ = tb.Close()
		})
	}
}
