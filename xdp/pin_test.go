package xdp

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// privateBPFFS mounts a bpffs instance of the test's own (each mount of
// bpffs is a separate instance) and unmounts it when the test ends.
func privateBPFFS(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, ""); err != nil {
		t.Fatalf("mounting a bpffs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return filepath.Join(dir, "xdproxy")
}

// xdpProgOn says which XDP program netlink shows on ifname in ns, 0 for
// none.
func xdpProgOn(t *testing.T, ns, ifname string) uint32 {
	t.Helper()
	var id uint32
	if err := inNetns(ns, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		if x := l.Attrs().Xdp; x != nil && x.Attached {
			id = x.ProgId
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return id
}

// TestPinnedStateOutlivesTheProcess plays two generations of xdproxy: the
// first pins its tables and link and goes away without detaching; the
// program keeps running; the second adopts the tables with their contents
// and the link, swapping its own program in.
func TestPinnedStateOutlivesTheProcess(t *testing.T) {
	requireRoot(t)
	pins := privateBPFFS(t)
	a, _ := vethPair(t)
	opts := Options{MaxFrontends: 16, MaxAddrs: 16, MaxFlows: 16, PinDir: pins}

	o1, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	if o1.Adopted() != 0 {
		t.Fatalf("first Load adopted %d tables from an empty pin directory", o1.Adopted())
	}
	fe := Key{packet.MustParseAddr(vip4), 80, packet.ProtoTCP}
	if err := o1.SetTables([]Key{fe}, nil); err != nil {
		t.Fatal(err)
	}
	w := o1.NewFlowWriter(1)
	w.Add(flowKeys(1, 0)[0])
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	at1, err := attachIn(a, "a0", o1, Generic)
	if err != nil {
		t.Fatal(err)
	}
	info1, err := at1.link.Info()
	if err != nil {
		t.Fatal(err)
	}
	// The first generation exits without detaching.
	at1.Close()
	o1.Close()
	prog1 := xdpProgOn(t, a, "a0")
	if prog1 == 0 {
		t.Fatal("the program left with its process although its link is pinned")
	}

	o2, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	if o2.Adopted() != 9 {
		t.Errorf("second Load adopted %d tables, want all 9", o2.Adopted())
	}
	if got := flowSet(t, o2); !got[flowKeys(1, 0)[0]] {
		t.Error("the flow written by the first generation is gone")
	}
	if got := dump(t, o2.frontends); !equal(got, strs([]Key{fe})) {
		t.Errorf("frontends after adoption %v", got)
	}
	at2, err := attachIn(a, "a0", o2, Native)
	if err != nil {
		t.Fatal(err)
	}
	info2, err := at2.link.Info()
	if err != nil {
		t.Fatal(err)
	}
	if !at2.Adopted() || info2.ID != info1.ID {
		t.Errorf("second Attach adopted %v, link %d; want the pinned link %d", at2.Adopted(), info2.ID, info1.ID)
	}
	if at2.Mode() != Generic {
		t.Errorf("adopted link reports mode %v, want the generic mode it was attached in", at2.Mode())
	}
	if p := xdpProgOn(t, a, "a0"); p == prog1 || p == 0 {
		t.Errorf("program %d after adoption, want the second generation's (not %d)", p, prog1)
	}
	// A table of another size is not adopted.
	small := opts
	small.MaxFlows = 8
	o3, err := Load(small)
	if err != nil {
		t.Fatal(err)
	}
	if o3.Adopted() != 7 {
		t.Errorf("Load with another flow table size adopted %d tables, want 7", o3.Adopted())
	}
	o3.Close()

	if err := at2.Detach(); err != nil {
		t.Fatal(err)
	}
	if p := xdpProgOn(t, a, "a0"); p != 0 {
		t.Errorf("program %d still attached after Detach", p)
	}
	if err := RemovePins(pins); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pins); !os.IsNotExist(err) {
		t.Errorf("pin directory left behind: %v", err)
	}
}

// TestPinnedLinkOfAnotherInterface: a link pinned for an interface that
// was deleted and created again (another ifindex) is not adopted.
func TestPinnedLinkOfAnotherInterface(t *testing.T) {
	requireRoot(t)
	pins := privateBPFFS(t)
	a, b := vethPair(t)
	o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16, MaxFlows: 16, PinDir: pins})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	at, err := attachIn(a, "a0", o, Generic)
	if err != nil {
		t.Fatal(err)
	}
	at.Close()
	run(t, "ip", "-n", a, "link", "del", "a0")
	run(t, "ip", "link", "add", "a0", "netns", a, "type", "veth", "peer", "b1", "netns", b)
	at, err = attachIn(a, "a0", o, Generic)
	if err != nil {
		t.Fatal(err)
	}
	defer at.Detach()
	if at.Adopted() {
		t.Error("adopted the link of a deleted interface")
	}
}

func TestPinDirMustBeBPFFS(t *testing.T) {
	requireRoot(t)
	if _, err := Load(Options{PinDir: t.TempDir()}); err == nil {
		t.Error("Load pinned into a directory that is not on a bpffs")
	}
}
