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

// thpAvailable reports whether this kernel has transparent huge pages.
func thpAvailable() bool {
	_, err := os.Stat("/sys/kernel/mm/transparent_hugepage/enabled")
	return err == nil
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

// TestMountAt reads mountinfo lines: the last mount at a path wins,
// optional fields and escaped paths are handled, and a path with no mount
// of its own has none.
func TestMountAt(t *testing.T) {
	info := []byte(`22 1 0:21 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1609212k,mode=755
30 22 0:40 / /run/xdproxy rw,relatime shared:9 - ext4 /dev/sda1 rw
31 30 0:41 / /run/xdproxy rw,nosuid,nodev,noexec,relatime shared:10 - tmpfs xdproxy-state rw,mode=700,huge=within_size
32 1 0:42 / /var/lib/my\040state rw - tmpfs x rw,huge=advise
33 1 0:43 / /broken
`)
	for _, c := range []struct {
		dir, fs string
		huge    bool
	}{
		{"/run/xdproxy", "tmpfs", true},
		{"/run", "tmpfs", false},
		{"/var/lib/my state", "tmpfs", true},
		{"/run/other", "", false},
		{"/broken", "", false},
	} {
		m := mountAt(info, c.dir)
		if m.FSType != c.fs || m.HugePages() != c.huge {
			t.Errorf("mountAt(%q) = %+v (huge %v), want %q, huge %v", c.dir, m, m.HugePages(), c.fs, c.huge)
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
