package dataplane

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netns"

	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// The real Kernel against the real kernel, in namespaces of its own.

var nsSeq atomic.Int32

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("needs root")
		}
		t.Fatal("needs root (make test runs as root)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
}

func sh(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// kernelIn makes a namespace with a 4-queue veth pair (k0 in it, p0 in a
// second namespace) and a real Kernel serving k0 in it.
func kernelIn(t *testing.T) (Kernel, string, string) {
	t.Helper()
	needRoot(t)
	var names [2]string
	for i := range names {
		names[i] = fmt.Sprintf("xdpt-%d-k%d", os.Getpid(), nsSeq.Add(1))
		sh(t, "ip", "netns", "add", names[i])
		t.Cleanup(func() { exec.Command("ip", "netns", "del", names[i]).Run() })
	}
	sh(t, "ip", "link", "add", "k0", "numrxqueues", "4", "numtxqueues", "4", "netns", names[0], "type", "veth",
		"peer", "p0", "numrxqueues", "4", "numtxqueues", "4", "netns", names[1])
	sh(t, "ip", "-n", names[0], "addr", "add", "198.18.0.1/24", "dev", "k0")
	sh(t, "ip", "-n", names[0], "link", "set", "k0", "up")
	sh(t, "ip", "-n", names[1], "link", "set", "p0", "up")
	var k Kernel
	err := inNamespace(names[0], func() (err error) {
		k, err = NewKernel(KernelOptions{Interfaces: []string{"k0"}, Tables: xdp.Options{MaxFlows: 1024}, Log: quietLog()})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })
	return k, names[0], names[1]
}

// inNamespace runs fn on a thread in ns; the thread is thrown away after.
func inNamespace(ns string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(ns)
		if err != nil {
			errc <- err
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// TestKernelChannels: the real Kernel sees the channel count ethtool
// reports (not the allocated queues), and SetChannels changes it, from any
// thread.
func TestKernelChannels(t *testing.T) {
	k, ns, peer := kernelIn(t)
	l, err := k.Link("k0")
	if err != nil || l.Queues != 4 {
		t.Fatalf("Link: %+v, %v; want 4 queues", l, err)
	}
	// With no XDP program on k0, its rx count may go below the peer's tx.
	if err := k.SetChannels("k0", 2); err != nil {
		t.Fatal(err)
	}
	if l, _ := k.Link("k0"); l.Queues != 2 {
		t.Fatalf("after SetChannels 2: %d queues", l.Queues)
	}
	if out := sh(t, "ip", "netns", "exec", ns, "ethtool", "-l", "k0"); !strings.Contains(out, "RX:\t\t2") {
		t.Errorf("ethtool -l after SetChannels 2:\n%s", out)
	}
	sh(t, "ip", "netns", "exec", ns, "ethtool", "-L", "k0", "rx", "3")
	if l, _ := k.Link("k0"); l.Queues != 3 {
		t.Fatalf("after ethtool -L rx 3: %d queues", l.Queues)
	}
	if _, err := k.Link("nope"); err == nil || !strings.Contains(err.Error(), "no such interface") {
		t.Errorf("Link of a missing interface: %v", err)
	}
	_ = peer
}

// TestKernelExceptionLink: the veth pair is made once, reused by the next
// run, and its kernel end accepts frames from anywhere.
func TestKernelExceptionLink(t *testing.T) {
	k, ns, _ := kernelIn(t)
	sh(t, "ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=1")
	ke, xe, err := k.ExceptionLink("xdpx0")
	if err != nil {
		t.Fatal(err)
	}
	if ke.Name != "xdpx0" || xe.Name != "xdpx0-dp" || len(ke.MAC) != 6 {
		t.Fatalf("ends %+v, %+v", ke, xe)
	}
	for key, want := range map[string]string{
		"net.ipv4.conf.xdpx0.rp_filter":       "2", // loose, since all is strict
		"net.ipv4.conf.xdpx0.accept_local":    "1",
		"net.ipv4.conf.xdpx0.forwarding":      "1",
		"net.ipv6.conf.xdpx0-dp.disable_ipv6": "1",
	} {
		if got := strings.TrimSpace(sh(t, "ip", "netns", "exec", ns, "sysctl", "-n", key)); got != want {
			t.Errorf("%s = %s, want %s", key, got, want)
		}
	}
	if out := sh(t, "ip", "-n", ns, "addr", "show", "xdpx0"); !strings.Contains(out, "169.254.42.1/32") {
		t.Errorf("kernel end has no address for rp_filter:\n%s", out)
	}
	ke2, xe2, err := k.ExceptionLink("xdpx0")
	if err != nil || ke2.Index != ke.Index || xe2.Index != xe.Index {
		t.Errorf("second ExceptionLink made a new pair or failed: %v", err)
	}
	sh(t, "ip", "-n", ns, "link", "add", "taken", "type", "bridge")
	if _, _, err := k.ExceptionLink("taken"); err == nil {
		t.Error("ExceptionLink adopted a bridge that is not xdproxy's")
	}
	if _, err := k.OpenSocket(xe.Index, 0, afxdp.DefaultConfig()); err != nil {
		t.Errorf("socket on xdproxy's end: %v", err)
	}
}

func TestKernelPorts(t *testing.T) {
	k, ns, _ := kernelIn(t)
	sh(t, "ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=32768 60999")
	r, err := k.LocalPortRange()
	if err != nil || r != (conntrack.PortRange{First: 32768, Last: 60999}) {
		t.Fatalf("LocalPortRange %v, %v", r, err)
	}
	sh(t, "ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_local_reserved_ports=8080")
	ours := conntrack.PortRange{First: 40000, Last: 40999}
	for i := range 2 {
		added, err := k.ReservePorts(ours)
		if err != nil || added != (i == 0) {
			t.Fatalf("ReservePorts %d: added %v, %v", i, added, err)
		}
	}
	reserved := func() string {
		return strings.TrimSpace(sh(t, "ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.ip_local_reserved_ports"))
	}
	if got := reserved(); got != "8080,40000-40999" {
		t.Errorf("ip_local_reserved_ports %q, want the old entry kept and ours added once", got)
	}
	if got, err := k.ReservedPorts(); err != nil || !slices.Equal(got, []conntrack.PortRange{{First: 8080, Last: 8080}, ours}) {
		t.Errorf("ReservedPorts %v, %v", got, err)
	}
	// xdproxy cleanup takes out its own entry and nothing else.
	err = k.(*xdpKernel).inNS(func() error {
		ok, err := unreservePorts(ours)
		if err == nil && !ok {
			err = errors.New("our entry not found")
		}
		return err
	})
	if got := reserved(); err != nil || got != "8080" {
		t.Errorf("after unreservePorts: %q, %v; want the operator's 8080 only", got, err)
	}
}
