package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// nsHandles holds an open namespace and a netlink handle inside it while the
// topology is built.
type nsHandles struct {
	name string
	ns   netns.NsHandle
	nl   *netlink.Handle
}

func (h *nsHandles) close() {
	if h.nl != nil {
		h.nl.Close()
	}
	h.ns.Close()
}

// newNamespace creates the named namespace on a thread of its own, so the
// caller's thread keeps its namespace.
func newNamespace(name string) (*nsHandles, error) {
	type result struct {
		ns  netns.NsHandle
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer orig.Close()
		ns, err := netns.NewNamed(name)
		// NewNamed may have switched the thread even when it failed.
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		ch <- result{ns, err}
	}()
	r := <-ch
	if r.err != nil {
		return nil, fmt.Errorf("testbed: create namespace %s: %w", name, r.err)
	}
	h, err := netlink.NewHandleAt(r.ns)
	if err != nil {
		r.ns.Close()
		return nil, fmt.Errorf("testbed: netlink in %s: %w", name, err)
	}
	return &nsHandles{name: name, ns: r.ns, nl: h}, nil
}

// deleteNamespace kills what still runs in ns and removes its bind mount;
// the kernel frees the namespace and its veths once nothing holds it.
func deleteNamespace(name string) error {
	path := filepath.Join("/run/netns", name)
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	killProcessesIn(path)
	if err := netns.DeleteNamed(name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("testbed: delete namespace %s: %w", name, err)
	}
	return nil
}

// killProcessesIn sends SIGKILL to every process whose network namespace is
// the one bound at nsPath, and waits briefly for them to go.
func killProcessesIn(nsPath string) {
	var want unix.Stat_t
	if unix.Stat(nsPath, &want) != nil {
		return
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) != nil {
			continue
		}
		if st.Dev == want.Dev && st.Ino == want.Ino {
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	_ = wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 2*time.Second, true, func(context.Context) (bool, error) {
		for _, pid := range pids {
			if syscall.Kill(pid, 0) == nil && !isZombie(pid) {
				return false, nil
			}
		}
		return true, nil
	})
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command name, which is in parentheses.
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] == 'Z'
}

func (tb *Testbed) build() error {
	handles := map[string]*nsHandles{}
	defer func() {
		for _, h := range handles {
			h.close()
		}
	}()
	for _, ns := range tb.Namespaces() {
		h, err := newNamespace(ns)
		if err != nil {
			return err
		}
		handles[ns] = h
	}
	client, node, lan := handles[tb.client.NS], handles[tb.nodeC.NS], handles[tb.lan]
	for _, h := range handles {
		if err := linkUp(h, "lo"); err != nil {
			return err
		}
		if tb.opts.IPv6 {
			if err := noDAD(h); err != nil {
				return err
			}
		}
	}

	if err := tb.sysctls(node); err != nil {
		return err
	}
	bridge := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: LANBridge, MTU: tb.opts.MTU}}
	if err := lan.nl.LinkAdd(bridge); err != nil {
		return fmt.Errorf("testbed: bridge: %w", err)
	}
	if err := linkUp(lan, LANBridge); err != nil {
		return err
	}

	q, mtu := tb.opts.Queues, tb.opts.MTU
	if err := addVeth(node, NodeClientIface, client, ClientIface, q, mtu); err != nil {
		return err
	}
	if err := addVeth(node, NodeLANIface, lan, LANNodePort, q, mtu); err != nil {
		return err
	}
	for i, b := range tb.backends {
		if err := addVeth(handles[b.NS], BackendIface, lan, fmt.Sprintf("lb%d", i), 1, mtu); err != nil {
			return err
		}
	}

	// Ports join the bridge before anything is addressed, so the first ARP
	// already crosses it.
	ports := []string{LANNodePort}
	for i := range tb.backends {
		ports = append(ports, fmt.Sprintf("lb%d", i))
	}
	for _, p := range ports {
		l, err := lan.nl.LinkByName(p)
		if err != nil {
			return fmt.Errorf("testbed: lan %s: %w", p, err)
		}
		if err := lan.nl.LinkSetMasterByIndex(l, bridgeIndex(lan)); err != nil {
			return fmt.Errorf("testbed: enslave %s: %w", p, err)
		}
		if err := linkUp(lan, p); err != nil {
			return err
		}
	}

	if err := address(client, &tb.client, 24, 64); err != nil {
		return err
	}
	if err := address(node, &tb.nodeC, 24, 64); err != nil {
		return err
	}
	if err := address(node, &tb.nodeL, 24, 64); err != nil {
		return err
	}
	if err := defaultRoute(client, tb.client.IfIndex, NodeClientAddr, NodeClientAddr6, tb.opts.IPv6); err != nil {
		return err
	}
	for i := range tb.backends {
		b := &tb.backends[i]
		h := handles[b.NS]
		if err := address(h, b, 24, 64); err != nil {
			return err
		}
		if err := defaultRoute(h, b.IfIndex, NodeLANAddr, NodeLANAddr6, tb.opts.IPv6); err != nil {
			return err
		}
	}
	hosts := append([]Host{tb.client, tb.nodeC, tb.nodeL}, tb.backends...)
	for _, host := range hosts {
		if err := waitReady(handles[host.NS], host.Iface, tb.opts.IPv6); err != nil {
			return err
		}
	}
	return nil
}

// readyTimeout bounds the wait for carrier and link-local addresses.
const readyTimeout = 5 * time.Second

// waitReady waits until iface has carrier and, with v6, a link-local
// address that is not tentative: carrier comes up asynchronously, and
// until it does (and IPv6 has its link-local address) the first packets
// or neighbour solicitations are lost.
func waitReady(h *nsHandles, iface string, v6 bool) error {
	var why string
	if wait.PollUntilContextTimeout(context.Background(), 2*time.Millisecond, readyTimeout, true, func(context.Context) (bool, error) {
		var ready bool
		ready, why = isReady(h, iface, v6)
		return ready, nil
	}) != nil {
		return fmt.Errorf("testbed: %s/%s not ready after %v: %s", h.name, iface, readyTimeout, why)
	}
	return nil
}

func isReady(h *nsHandles, iface string, v6 bool) (bool, string) {
	l, err := h.nl.LinkByName(iface)
	if err != nil {
		return false, err.Error()
	}
	if l.Attrs().OperState != netlink.OperUp {
		return false, "operstate " + l.Attrs().OperState.String()
	}
	if !v6 {
		return true, ""
	}
	addrs, err := h.nl.AddrList(l, netlink.FAMILY_V6)
	if err != nil {
		return false, err.Error()
	}
	for _, a := range addrs {
		if a.IP.IsLinkLocalUnicast() && a.Flags&unix.IFA_F_TENTATIVE == 0 {
			return true, ""
		}
	}
	return false, "no usable IPv6 link-local address"
}

func bridgeIndex(lan *nsHandles) int {
	l, err := lan.nl.LinkByName(LANBridge)
	if err != nil {
		return 0
	}
	return l.Attrs().Index
}

func linkUp(h *nsHandles, name string) error {
	l, err := h.nl.LinkByName(name)
	if err == nil {
		err = h.nl.LinkSetUp(l)
	}
	if err != nil {
		return fmt.Errorf("testbed: %s: up %s: %w", h.name, name, err)
	}
	return nil
}

// addVeth creates name in a with its peer in b, both with q queues and the
// MTU mtu (0: the kernel's default).
func addVeth(a *nsHandles, name string, b *nsHandles, peer string, q, mtu int) error {
	v := &netlink.Veth{
		LinkAttrs:       netlink.LinkAttrs{Name: name, MTU: mtu, NumTxQueues: q, NumRxQueues: q},
		PeerName:        peer,
		PeerNamespace:   netlink.NsFd(b.ns),
		PeerNumTxQueues: uint32(q),
		PeerNumRxQueues: uint32(q),
		PeerMTU:         uint32(mtu),
	}
	if err := a.nl.LinkAdd(v); err != nil {
		return fmt.Errorf("testbed: veth %s/%s - %s/%s: %w", a.name, name, b.name, peer, err)
	}
	return nil
}

// address brings h's interface up with its addresses and fills in the
// index and MAC.
func address(h *nsHandles, host *Host, bits4, bits6 int) error {
	l, err := h.nl.LinkByName(host.Iface)
	if err != nil {
		return fmt.Errorf("testbed: %s: %s: %w", h.name, host.Iface, err)
	}
	add := func(a netip.Addr, bits int) error {
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}}
		if a.Is6() {
			addr.Flags = unix.IFA_F_NODAD // usable at once, not tentative
		}
		if err := h.nl.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("testbed: %s: address %s on %s: %w", h.name, a, host.Iface, err)
		}
		return nil
	}
	if err := add(host.Addr, bits4); err != nil {
		return err
	}
	if host.Addr6.IsValid() {
		if err := add(host.Addr6, bits6); err != nil {
			return err
		}
	}
	if err := h.nl.LinkSetUp(l); err != nil {
		return fmt.Errorf("testbed: %s: up %s: %w", h.name, host.Iface, err)
	}
	host.IfIndex = l.Attrs().Index
	host.MAC = l.Attrs().HardwareAddr
	return nil
}

func defaultRoute(h *nsHandles, ifindex int, gw4, gw6 netip.Addr, v6 bool) error {
	r := &netlink.Route{LinkIndex: ifindex, Gw: gw4.AsSlice()}
	if err := h.nl.RouteAdd(r); err != nil {
		return fmt.Errorf("testbed: %s: default route: %w", h.name, err)
	}
	if v6 {
		r6 := &netlink.Route{LinkIndex: ifindex, Gw: gw6.AsSlice()}
		if err := h.nl.RouteAdd(r6); err != nil {
			return fmt.Errorf("testbed: %s: default route v6: %w", h.name, err)
		}
	}
	return nil
}

// noDAD makes link-local addresses usable at once on interfaces made
// later. The kernel sends neighbour solicitations that no packet asked for
// (those route.Cache triggers) from the link-local address, and skips them
// while that address is still tentative.
func noDAD(h *nsHandles) error {
	return doAt(h.ns, func() error {
		for _, f := range []string{"/proc/sys/net/ipv6/conf/default/accept_dad", "/proc/sys/net/ipv6/conf/all/accept_dad"} {
			if err := os.WriteFile(f, []byte("0"), 0o644); err != nil {
				return fmt.Errorf("testbed: %s: %s: %w", h.name, f, err)
			}
		}
		return nil
	})
}

// sysctls turns the node into a router. /proc/sys/net belongs to the
// namespace of the thread that opens it, so Do reaches the node's copy.
func (tb *Testbed) sysctls(node *nsHandles) error {
	settings := [][2]string{
		{"net/ipv4/ip_forward", "1"},
		{"net/ipv4/conf/all/rp_filter", "0"},
		{"net/ipv4/conf/default/rp_filter", "0"},
	}
	if tb.opts.IPv6 {
		settings = append(settings, [2]string{"net/ipv6/conf/all/forwarding", "1"})
	}
	return writeSysctls(node, settings)
}

// writeSysctls sets each {path under /proc/sys, value} in h's namespace.
func writeSysctls(h *nsHandles, settings [][2]string) error {
	return doAt(h.ns, func() error {
		for _, s := range settings {
			if err := os.WriteFile("/proc/sys/"+s[0], []byte(s[1]), 0o644); err != nil {
				return fmt.Errorf("testbed: %s: sysctl %s: %w", h.name, s[0], err)
			}
		}
		return nil
	})
}
