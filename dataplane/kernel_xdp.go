package dataplane

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/dataplane/route"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// KernelOptions configure the real Kernel.
type KernelOptions struct {
	// Interfaces are the NICs xdproxy serves: the egress candidates of
	// the route cache.
	Interfaces []string
	// Tables sizes the XDP program's maps.
	Tables xdp.Options
	// LocalClients, when set, loads the socket-level translation for
	// clients on the node (xdp/socklb) with these options; its PinDir
	// defaults to Tables.PinDir's "socklb" subdirectory.
	LocalClients *socklb.Options
	Log          *slog.Logger
}

// xdpKernel is the real Kernel: the XDP program and its maps (package
// xdp), AF_XDP sockets (xdp/afxdp), the route cache (dataplane/route) and
// netlink, all in the network namespace of the thread that made it.
type xdpKernel struct {
	ns     netns.NsHandle
	nl     *netlink.Handle
	objs   *xdp.Objects
	lb     *socklb.LB
	routes *route.Cache
	log    *slog.Logger
}

// NewKernel loads the XDP program's tables and starts the route cache in
// the calling thread's network namespace. Every later operation runs in
// that namespace, whichever thread calls it.
func NewKernel(opts KernelOptions) (Kernel, error) {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	k := &xdpKernel{log: opts.Log}
	var err error
	if k.ns, err = netns.Get(); err != nil {
		return nil, fmt.Errorf("network namespace: %w", err)
	}
	if k.nl, err = netlink.NewHandleAt(k.ns); err != nil {
		k.ns.Close()
		return nil, fmt.Errorf("netlink: %w", err)
	}
	if k.objs, err = xdp.Load(opts.Tables); err != nil {
		k.Close()
		return nil, fmt.Errorf("loading the XDP program: %w", err)
	}
	if lo := opts.LocalClients; lo != nil {
		o := *lo
		if o.PinDir == "" && opts.Tables.PinDir != "" {
			o.PinDir = filepath.Join(opts.Tables.PinDir, "socklb")
		}
		// Load reads the node's netns cookie from the calling thread: this
		// one, in the node's namespace.
		if k.lb, err = socklb.Load(o); err != nil {
			k.Close()
			return nil, fmt.Errorf("loading the socket programs for local clients: %w", err)
		}
	}
	k.routes, err = route.New(route.Options{Interfaces: opts.Interfaces, Namespace: &k.ns,
		ErrorLog: func(err error) { k.log.Warn("route cache", "err", err) }})
	if err != nil {
		k.Close()
		return nil, fmt.Errorf("route cache: %w", err)
	}
	return k, nil
}

// inNS runs fn on a thread in the Kernel's namespace: AF_XDP binds,
// bpf_link attachments, ethtool ioctls and /proc/sys/net all resolve names
// and indexes in the namespace of the calling thread.
func (k *xdpKernel) inNS(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cur, err := netns.Get()
	if err != nil {
		return err
	}
	defer cur.Close()
	if cur.Equal(k.ns) {
		return fn()
	}
	if err := netns.Set(k.ns); err != nil {
		return err
	}
	ferr := fn()
	if err := netns.Set(cur); err != nil {
		// A thread stuck in another namespace must not run other
		// goroutines: leaving it locked ends it with this goroutine.
		runtime.LockOSThread()
	}
	return ferr
}

func (k *xdpKernel) Link(name string) (Link, error) {
	l, err := k.nl.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) || errors.Is(err, unix.ENODEV) {
			return Link{}, fmt.Errorf("%w: %s", ErrNoLink, name)
		}
		return Link{}, fmt.Errorf("interface %s: %w", name, err)
	}
	a := l.Attrs()
	out := Link{Name: a.Name, Index: a.Index, MAC: a.HardwareAddr, Queues: max(a.NumRxQueues, 1), MTU: a.MTU}
	err = k.inNS(func() error {
		ch, err := getChannels(name)
		if err == nil && ch.rx+ch.combined > 0 {
			out.Queues = int(ch.rx + ch.combined)
		}
		return nil // no ethtool channels: the allocated queues it is
	})
	if err != nil {
		return Link{}, err
	}
	addrs, err := k.nl.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return Link{}, fmt.Errorf("interface %s addresses: %w", name, err)
	}
	for _, ad := range addrs {
		if ad.IP.IsLinkLocalUnicast() {
			continue
		}
		if pa, ok := addrFromIP(ad.IP); ok {
			out.Addrs = append(out.Addrs, pa)
		}
	}
	return out, nil
}

func addrFromIP(ip net.IP) (packet.Addr, bool) {
	if ip4 := ip.To4(); ip4 != nil {
		return packet.AddrFromSlice4(ip4), true
	}
	if len(ip) == net.IPv6len {
		var a packet.Addr
		copy(a[:], ip)
		return a, true
	}
	return packet.Addr{}, false
}

func (k *xdpKernel) WatchLinks(changed func()) (func(), error) {
	ch := make(chan netlink.LinkUpdate, 64)
	done := make(chan struct{})
	opts := netlink.LinkSubscribeOptions{Namespace: &k.ns, ErrorCallback: func(err error) {
		select {
		case <-done:
			// Closing the subscription interrupts its receive: not
			// a problem worth a warning.
		default:
			k.log.Warn("link events", "err", err)
		}
	}}
	if err := netlink.LinkSubscribeWithOptions(ch, done, opts); err != nil {
		return nil, fmt.Errorf("subscribing to link events: %w", err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range ch {
			changed()
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			wg.Wait()
		})
	}, nil
}

func (k *xdpKernel) SetChannels(name string, queues int) error {
	// The kernel lets go of a closed AF_XDP socket's hold on its queue a
	// moment after close: until then it refuses to remove the queue.
	deadline := time.Now().Add(3 * time.Second)
	for {
		err := k.inNS(func() error { return setChannels(name, uint32(queues)) })
		if !errors.Is(err, unix.EINVAL) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (k *xdpKernel) Attach(ifindex int, mode xdp.Mode) (Attachment, error) {
	var a *xdp.Attachment
	err := k.inNS(func() (err error) {
		a, err = k.objs.Attach(ifindex, mode)
		return err
	})
	if err != nil {
		return nil, err
	}
	return a, nil
}

func (k *xdpKernel) AttachEgress(ifindex int) (Attachment, error) {
	var a *xdp.Attachment
	err := k.inNS(func() (err error) {
		a, err = k.objs.AttachEgress(ifindex)
		return err
	})
	if err != nil {
		return nil, err
	}
	return a, nil
}

func (k *xdpKernel) SetEgressRedirect(ifindex int) error { return k.objs.SetEgressRedirect(ifindex) }

func (k *xdpKernel) OpenSocket(ifindex, queue int, cfg afxdp.Config) (Socket, error) {
	var s *afxdp.Socket
	err := k.inNS(func() (err error) {
		s, err = afxdp.Open(ifindex, queue, cfg)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// exceptionAddr is the address of the exception link's kernel end. Loose
// reverse-path filtering (rp_filter=2) drops every frame that arrives on a
// device without an IPv4 address; a link-local /32 satisfies it and routes
// nothing.
var exceptionAddr = &net.IPNet{IP: net.IPv4(169, 254, 42, 1), Mask: net.CIDRMask(32, 32)}

// exceptionMTU is the exception link's MTU: the largest a veth takes with
// a native XDP program (its frames must fit a page with the XDP headroom),
// above what a 2048-byte UMEM frame holds.
const exceptionMTU = 3500

// xdproxyEndName names the exception link's end that xdproxy transmits on.
func xdproxyEndName(name string) string { return name + "-dp" }

func (k *xdpKernel) ExceptionLink(name string) (Link, Link, error) {
	peer := xdproxyEndName(name)
	if len(peer) > 15 {
		return Link{}, Link{}, fmt.Errorf("exception interface name %q: at most 12 characters", name)
	}
	if l, err := k.nl.LinkByName(name); err == nil {
		// Left by an earlier run: exception links outlive restarts.
		if _, err := k.nl.LinkByName(peer); l.Type() != "veth" || err != nil {
			return Link{}, Link{}, fmt.Errorf("exception interface %s exists and is not xdproxy's veth pair with %s (%s)", name, peer, l.Type())
		}
	} else {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer}
		if err := k.nl.LinkAdd(veth); err != nil && !errors.Is(err, unix.EEXIST) {
			return Link{}, Link{}, fmt.Errorf("creating exception link %s: %w", name, err)
		}
	}
	kl, err := k.nl.LinkByName(name)
	if err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s: %w", name, err)
	}
	pl, err := k.nl.LinkByName(peer)
	if err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s: %w", peer, err)
	}
	// Frames handed over are as long as the NICs' frames can be.
	for _, l := range []netlink.Link{kl, pl} {
		if l.Attrs().MTU != exceptionMTU {
			if err := k.nl.LinkSetMTU(l, exceptionMTU); err != nil {
				return Link{}, Link{}, fmt.Errorf("exception link %s MTU: %w", l.Attrs().Name, err)
			}
		}
	}
	for _, l := range []netlink.Link{pl, kl} {
		if err := k.nl.LinkSetUp(l); err != nil {
			return Link{}, Link{}, fmt.Errorf("exception link %s up: %w", l.Attrs().Name, err)
		}
	}
	if err := k.nl.AddrReplace(kl, &netlink.Addr{IPNet: exceptionAddr, Scope: int(netlink.SCOPE_LINK)}); err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s address: %w", name, err)
	}
	// Replies to LocalSNATAddress go out of the kernel end, to xdproxy's.
	local := net.IP(LocalSNATAddress.Netip().AsSlice())
	route := &netlink.Route{LinkIndex: kl.Attrs().Index, Dst: &net.IPNet{IP: local, Mask: net.CIDRMask(32, 32)},
		Scope: netlink.SCOPE_LINK}
	if err := k.nl.RouteReplace(route); err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s route: %w", name, err)
	}
	neigh := &netlink.Neigh{LinkIndex: kl.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: local, HardwareAddr: pl.Attrs().HardwareAddr}
	if err := k.nl.NeighSet(neigh); err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s neighbour: %w", name, err)
	}
	err = k.inNS(func() error {
		// The frames xdproxy hands over were received from a NIC: their
		// sources are remote clients and sometimes node addresses (an
		// ICMP error from the node itself), and their destinations may
		// be elsewhere (a pod behind a veth).
		all, err := readSysctl("net/ipv4/conf/all/rp_filter")
		if err != nil {
			return err
		}
		rp := "0"
		if strings.TrimSpace(all) != "0" {
			rp = "2" // the effective value is max(all, dev): loose at worst
		}
		for key, v := range map[string]string{
			"net/ipv4/conf/" + name + "/rp_filter":    rp,
			"net/ipv4/conf/" + name + "/accept_local": "1",
			"net/ipv4/conf/" + name + "/forwarding":   "1",
			"net/ipv6/conf/" + name + "/accept_ra":    "0",
			// xdproxy's end takes no part in IPv6 (no solicitations or
			// reports land on its socket).
			"net/ipv6/conf/" + peer + "/disable_ipv6": "1",
		} {
			if err := writeSysctl(key, v); err != nil {
				return err
			}
		}
		// IPv6 forwarding is a global switch, which a node with IPv6
		// pods has on; kernels from 6.17 also forward what one device
		// receives (force_forwarding), which is all xdproxy needs.
		// Not fatal, unlike the settings above: it costs IPv6 only.
		forward6 := "net/ipv6/conf/" + name + "/force_forwarding"
		if _, err := readSysctl(forward6); err == nil {
			if err := writeSysctl(forward6, "1"); err == nil {
				return nil
			}
		}
		if v, err := readSysctl("net/ipv6/conf/all/forwarding"); err == nil && strings.TrimSpace(v) == "0" {
			k.log.Warn("IPv6 forwarding is off and could not be turned on for the exception link alone: "+
				"IPv6 frames xdproxy hands to the kernel for delivery (local pods, unresolved next hops) are dropped by it",
				"sysctl", "net.ipv6.conf.all.forwarding", "deviceSysctl", forward6)
		}
		return nil
	})
	if err != nil {
		return Link{}, Link{}, fmt.Errorf("exception link %s: %w", name, err)
	}
	ke, err := k.Link(name)
	if err != nil {
		return Link{}, Link{}, err
	}
	xe, err := k.Link(peer)
	return ke, xe, err
}

// RemoveExceptionLink deletes the exception link (xdproxy cleanup).
func RemoveExceptionLink(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return nil
	}
	return netlink.LinkDel(l)
}

func readSysctl(key string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/proc/sys", key))
	return string(b), err
}

func writeSysctl(key, v string) error {
	return os.WriteFile(filepath.Join("/proc/sys", key), []byte(v), 0)
}

func (k *xdpKernel) LocalPortRange() (conntrack.PortRange, error) {
	var r conntrack.PortRange
	err := k.inNS(func() error {
		v, err := readSysctl("net/ipv4/ip_local_port_range")
		if err != nil {
			return err
		}
		var lo, hi uint16
		if _, err := fmt.Sscan(v, &lo, &hi); err != nil {
			return fmt.Errorf("net.ipv4.ip_local_port_range %q: %w", strings.TrimSpace(v), err)
		}
		r = conntrack.PortRange{First: lo, Last: hi}
		return nil
	})
	return r, err
}

const reservedPortsKey = "net/ipv4/ip_local_reserved_ports"

func (k *xdpKernel) ReservePorts(r conntrack.PortRange) (added bool, err error) {
	err = k.inNS(func() error {
		v, err := readSysctl(reservedPortsKey)
		if err != nil {
			return err
		}
		ours := fmt.Sprintf("%d-%d", r.First, r.Last)
		have := strings.TrimSpace(v)
		for _, part := range strings.Split(have, ",") {
			if part == ours {
				return nil
			}
		}
		if have != "" {
			ours = have + "," + ours
		}
		added = true
		return writeSysctl(reservedPortsKey, ours)
	})
	return added && err == nil, err
}

func (k *xdpKernel) ReservedPorts() ([]conntrack.PortRange, error) {
	var rs []conntrack.PortRange
	err := k.inNS(func() error {
		v, err := readSysctl(reservedPortsKey)
		if err != nil {
			return err
		}
		rs, err = parsePortList(v)
		return err
	})
	return rs, err
}

// parsePortList parses a port list as net.ipv4.ip_local_reserved_ports
// prints it: "8080,40000-49999", empty when none.
func parsePortList(v string) ([]conntrack.PortRange, error) {
	var rs []conntrack.PortRange
	for _, part := range strings.Split(strings.TrimSpace(v), ",") {
		if part == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(part, "-")
		if !isRange {
			hi = lo
		}
		first, err1 := strconv.ParseUint(lo, 10, 16)
		last, err2 := strconv.ParseUint(hi, 10, 16)
		if err1 != nil || err2 != nil || first > last {
			return nil, fmt.Errorf("port list %q: bad entry %q", strings.TrimSpace(v), part)
		}
		rs = append(rs, conntrack.PortRange{First: uint16(first), Last: uint16(last)})
	}
	return rs, nil
}

// unreservePorts takes r out of net.ipv4.ip_local_reserved_ports in the
// current network namespace, if the list holds it as an entry of its own
// (the kernel merges adjacent entries: then it stays, and ok says so).
func unreservePorts(r conntrack.PortRange) (ok bool, err error) {
	v, err := readSysctl(reservedPortsKey)
	if err != nil {
		return false, err
	}
	ours := fmt.Sprintf("%d-%d", r.First, r.Last)
	var keep []string
	for _, part := range strings.Split(strings.TrimSpace(v), ",") {
		if part == ours {
			ok = true
		} else if part != "" {
			keep = append(keep, part)
		}
	}
	if !ok {
		return false, nil
	}
	return true, writeSysctl(reservedPortsKey, strings.Join(keep, ",")+"\n")
}

func (k *xdpKernel) Tables() Tables { return xdpTables{k.objs} }

func (k *xdpKernel) LocalClients() LocalClients {
	if k.lb == nil {
		return nil
	}
	return k.lb
}

func (k *xdpKernel) Resolver() Resolver { return routeResolver{k.routes} }

func (k *xdpKernel) Close() error {
	var errs []error
	if k.routes != nil {
		errs = append(errs, k.routes.Close())
	}
	if k.objs != nil {
		errs = append(errs, k.objs.Close())
	}
	if k.lb != nil {
		errs = append(errs, k.lb.Close())
	}
	if k.nl != nil {
		k.nl.Close()
	}
	errs = append(errs, k.ns.Close())
	return errors.Join(errs...)
}

// xdpTables adapts *xdp.Objects to Tables.
type xdpTables struct{ o *xdp.Objects }

func (t xdpTables) SetTables(frontends []xdp.Key, vips []packet.Addr) error {
	return t.o.SetTables(frontends, vips)
}
func (t xdpTables) NewFlowWriter(n int) FlowWriter              { return t.o.NewFlowWriter(n) }
func (t xdpTables) DeleteFlows(keys []xdp.FlowKey) error        { return t.o.DeleteFlows(keys) }
func (t xdpTables) ForEachFlow(fn func(xdp.FlowKey) bool) error { return t.o.ForEachFlow(fn) }
func (t xdpTables) Counters() (xdp.Counters, error)             { return t.o.Counters() }
func (t xdpTables) SetSYNGuard(g xdp.SYNGuard) error            { return t.o.SetSYNGuard(g) }

// routeResolver adapts the route cache to Resolver.
type routeResolver struct{ c *route.Cache }

// Generation is the route cache's snapshot generation: every change of
// routes, links or neighbours publishes a new snapshot.
func (r routeResolver) Generation() uint64 { return r.c.Generation() }

func (r routeResolver) Resolve(dst packet.Addr) (NextHop, packet.Reason) {
	h, st := r.c.Lookup(dst)
	switch st {
	case route.Found:
		return NextHop{Ifindex: int(h.IfIndex), Src: h.SrcMAC, Dst: h.DstMAC}, packet.OK
	case route.NeedsResolution:
		// The interface still says which address a masqueraded flow
		// leaves with (snatSource).
		return NextHop{Ifindex: int(h.IfIndex), Src: h.SrcMAC}, packet.DropNeighbor
	case route.NotManaged:
		// Behind an interface xdproxy does not serve (a local pod's
		// veth, a bridge, the node itself): the kernel delivers it.
		return NextHop{ViaKernel: true}, packet.OK
	}
	return NextHop{}, packet.DropNoRoute
}

// ethtoolChannels is struct ethtool_channels.
type ethtoolChannels struct {
	cmd                                 uint32
	maxRx, maxTx, maxOther, maxCombined uint32
	rx, tx, other, combined             uint32
}

// ifreqData is struct ifreq with a pointer in its union, as SIOCETHTOOL
// takes it.
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte
}

func channelsIoctl(name string, ch *ethtoolChannels) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr := ifreqData{data: unsafe.Pointer(ch)}
	copy(ifr.name[:unix.IFNAMSIZ-1], name)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(&ifr)
	runtime.KeepAlive(ch)
	if errno != 0 {
		return errno
	}
	return nil
}

func getChannels(name string) (ethtoolChannels, error) {
	ch := ethtoolChannels{cmd: unix.ETHTOOL_GCHANNELS}
	err := channelsIoctl(name, &ch)
	return ch, err
}

// setChannels sets the receive and transmit queue counts: combined
// channels where the device has them, separate rx and tx ones otherwise
// (veth).
func setChannels(name string, n uint32) error {
	ch, err := getChannels(name)
	if err != nil {
		return fmt.Errorf("ethtool channels of %s: %w", name, err)
	}
	ch.cmd = unix.ETHTOOL_SCHANNELS
	if ch.combined > 0 || ch.maxCombined > 0 && ch.maxRx == 0 {
		ch.combined = n
	} else {
		ch.rx, ch.tx = n, n
	}
	if err := channelsIoctl(name, &ch); err != nil {
		return fmt.Errorf("ethtool -L %s %d: %w", name, n, err)
	}
	return nil
}
