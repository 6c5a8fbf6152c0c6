package testbed

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sort"
	"strings"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// ErrNoNAPIThreads is returned by PinNAPI when the interface has no threaded
// NAPI instance yet. A veth creates its NAPI instances only while an XDP
// program is attached or GRO is on, so pin after attaching.
var ErrNoNAPIThreads = errors.New("testbed: interface has no NAPI kthreads (attach XDP or turn GRO on first)")

// hostsOf finds where an interface name lives; BackendIface is in every
// backend.
func (tb *Testbed) hostsOf(iface string) ([]string, error) {
	switch {
	case iface == ClientIface:
		return []string{tb.client.NS}, nil
	case iface == NodeClientIface || iface == NodeLANIface:
		return []string{tb.nodeC.NS}, nil
	case iface == LANNodePort || iface == LANBridge || strings.HasPrefix(iface, "lb"):
		return []string{tb.lan}, nil
	case iface == BackendIface:
		var ns []string
		for _, b := range tb.backends {
			ns = append(ns, b.NS)
		}
		return ns, nil
	}
	return nil, fmt.Errorf("testbed: unknown interface %q", iface)
}

// tune applies the tuning options; map order does not matter.
func (tb *Testbed) tune() error {
	each := func(iface string, fn func(ns string) error) error {
		nss, err := tb.hostsOf(iface)
		if err != nil {
			return err
		}
		for _, ns := range nss {
			if err := fn(ns); err != nil {
				return err
			}
		}
		return nil
	}
	for _, iface := range tb.opts.GRO {
		if err := each(iface, func(ns string) error { return tb.SetGRO(ns, iface, true) }); err != nil {
			return err
		}
	}
	for iface, mask := range tb.opts.RPS {
		if err := each(iface, func(ns string) error { return tb.SetRPS(ns, iface, mask) }); err != nil {
			return err
		}
	}
	for iface, cpu := range tb.opts.Threaded {
		if err := each(iface, func(ns string) error { return tb.SetThreadedNAPI(ns, iface, cpu) }); err != nil {
			return err
		}
	}
	return nil
}

// writeSysfs writes value to a file under /sys/class/net of ns; only
// "ip netns exec" mounts the namespace's own sysfs.
func (tb *Testbed) writeSysfs(ns, rel, value string) error {
	path := filepath.Join("/sys/class/net", rel)
	_, err := tb.Exec(ns, "sh", "-c", fmt.Sprintf("echo %s > %s", value, path))
	return err
}

// SetRPS sets the RPS CPU mask (hex, like "2") of every rx queue of iface.
func (tb *Testbed) SetRPS(ns, iface, mask string) error {
	for _, c := range mask {
		if !strings.ContainsRune("0123456789abcdefABCDEF,", c) {
			return fmt.Errorf("testbed: RPS mask %q is not hex", mask)
		}
	}
	if strings.ContainsAny(iface, "/ ") {
		return fmt.Errorf("testbed: bad interface name %q", iface)
	}
	_, err := tb.Exec(ns, "sh", "-c",
		fmt.Sprintf("for q in /sys/class/net/%s/queues/rx-*; do echo %s > $q/rps_cpus || exit 1; done", iface, mask))
	return err
}

// SetThreadedNAPI turns on threaded NAPI for iface and pins its NAPI
// kthreads to cpu. The threads that exist now are pinned at once; a veth
// without XDP or GRO has none yet, so call PinNAPI again after attaching.
func (tb *Testbed) SetThreadedNAPI(ns, iface string, cpu int) error {
	if err := tb.writeSysfs(ns, iface+"/threaded", "1"); err != nil {
		return err
	}
	if _, err := tb.PinNAPI(ns, iface, cpu); err != nil && !errors.Is(err, ErrNoNAPIThreads) {
		return err
	}
	return nil
}

// PinNAPI pins the NAPI kthreads of iface to cpu and returns their PIDs.
func (tb *Testbed) PinNAPI(ns, iface string, cpu int) ([]int, error) {
	pids, err := tb.NAPIThreads(ns, iface)
	if err != nil {
		return nil, err
	}
	if len(pids) == 0 {
		return nil, ErrNoNAPIThreads
	}
	var set unix.CPUSet
	set.Set(cpu)
	for _, pid := range pids {
		if err := unix.SchedSetaffinity(pid, &set); err != nil {
			return nil, fmt.Errorf("testbed: pin napi thread %d to CPU %d: %w", pid, cpu, err)
		}
	}
	return pids, nil
}

// Generic netlink "netdev" family numbers (include/uapi/linux/netdev.h).
const (
	netdevCmdNAPIGet   = 11
	netdevANAPIIfindex = 1
	netdevANAPIPID     = 4
)

// NAPIThreads returns the PIDs of the NAPI kthreads of iface in ns; see
// NAPIThreadsIn.
func (tb *Testbed) NAPIThreads(ns, iface string) ([]int, error) { return NAPIThreadsIn(ns, iface) }

// NAPIThreadsIn returns the PIDs of the NAPI kthreads of iface in the
// namespace ns, asked from the kernel's netdev generic netlink family:
// kthread names ("napi/n0-8193") repeat across namespaces and cannot tell
// testbeds apart.
func NAPIThreadsIn(ns, iface string) ([]int, error) {
	var pids []int
	err := DoIn(ns, func() error {
		link, err := netlink.LinkByName(iface)
		if err != nil {
			return err
		}
		fam, err := netlink.GenlFamilyGet("netdev")
		if err != nil {
			return fmt.Errorf("testbed: netdev genl family: %w", err)
		}
		req := nl.NewNetlinkRequest(int(fam.ID), unix.NLM_F_DUMP)
		// struct genlmsghdr: cmd, version, reserved (u16, must be 0). Not
		// nl.Genlmsg: its Serialize reads 4 bytes from a 2-byte struct, and
		// the netdev family refuses the garbage in "reserved" (EINVAL,
		// "genlmsghdr.reserved field is not 0") now and then.
		req.AddRawData([]byte{netdevCmdNAPIGet, 1, 0, 0})
		// Filtering the dump by ifindex answers EINVAL on 6.18 for a device
		// in a namespace; filter here instead.
		msgs, err := req.Execute(unix.NETLINK_GENERIC, 0)
		if err != nil {
			return fmt.Errorf("testbed: napi-get %s: %w", iface, err)
		}
		for _, m := range msgs {
			if len(m) < nl.SizeofGenlmsg {
				continue
			}
			attrs, err := nl.ParseRouteAttr(m[nl.SizeofGenlmsg:])
			if err != nil {
				return err
			}
			var ifindex, pid uint32
			for _, a := range attrs {
				if len(a.Value) < 4 {
					continue
				}
				switch a.Attr.Type {
				case netdevANAPIIfindex:
					ifindex = binary.NativeEndian.Uint32(a.Value)
				case netdevANAPIPID:
					pid = binary.NativeEndian.Uint32(a.Value)
				}
			}
			if int(ifindex) == link.Attrs().Index && pid != 0 {
				pids = append(pids, int(pid))
			}
		}
		return nil
	})
	sort.Ints(pids)
	return pids, err
}

// ethtool ioctl numbers (include/uapi/linux/ethtool.h).
const (
	ethtoolGGRO      = 0x2b
	ethtoolSGRO      = 0x2c
	ethtoolGStrings  = 0x1b
	ethtoolGStats    = 0x1d
	ethtoolGSSetInfo = 0x37
	ethSSStats       = 1  // ETH_SS_STATS
	ethGStringLen    = 32 // ETH_GSTRING_LEN
)

type ethtoolValue struct {
	cmd  uint32
	data uint32
}

type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte // struct ifreq is 40 bytes on 64-bit
}

func ethtoolIoctl(iface string, v *ethtoolValue) error {
	return ethtoolCall(iface, unsafe.Pointer(v))
}

// ethtoolCall runs the SIOCETHTOOL ioctl on iface (in the calling thread's
// namespace) with data, whose first 32 bits are the ethtool command.
func ethtoolCall(iface string, data unsafe.Pointer) error {
	if len(iface) >= unix.IFNAMSIZ {
		return fmt.Errorf("testbed: interface name %q too long", iface)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var req ifreqData
	copy(req.name[:], iface)
	req.data = data
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&req))); errno != 0 {
		return errno
	}
	return nil
}

// SetGRO turns GRO of iface in ns on or off (what "ethtool -K iface gro on"
// does).
func (tb *Testbed) SetGRO(ns, iface string, on bool) error {
	v := ethtoolValue{cmd: ethtoolSGRO}
	if on {
		v.data = 1
	}
	return tb.Do(ns, func() error {
		if err := ethtoolIoctl(iface, &v); err != nil {
			return fmt.Errorf("testbed: %s: set GRO on %s: %w", ns, iface, err)
		}
		return nil
	})
}

// GRO reports whether GRO is on for iface in ns.
func (tb *Testbed) GRO(ns, iface string) (bool, error) {
	v := ethtoolValue{cmd: ethtoolGGRO}
	err := tb.Do(ns, func() error { return ethtoolIoctl(iface, &v) })
	return v.data != 0, err
}

// MAC returns the current hardware address of iface in ns.
func (tb *Testbed) MAC(ns, iface string) (net.HardwareAddr, error) {
	var mac net.HardwareAddr
	err := tb.Do(ns, func() error {
		l, err := netlink.LinkByName(iface)
		if err == nil {
			mac = l.Attrs().HardwareAddr
		}
		return err
	})
	return mac, err
}

// EthtoolStats returns the driver statistics of iface in ns, what
// "ethtool -S iface" prints, read with the ethtool ioctl.
func EthtoolStats(ns, iface string) (map[string]uint64, error) {
	stats := map[string]uint64{}
	err := DoIn(ns, func() error {
		// struct ethtool_sset_info: cmd, reserved, sset_mask, then one
		// count per bit set in the mask.
		info := make([]uint64, 3)
		binary.NativeEndian.PutUint32(unsafe.Slice((*byte)(unsafe.Pointer(&info[0])), 8), ethtoolGSSetInfo)
		info[1] = 1 << ethSSStats
		if err := ethtoolCall(iface, unsafe.Pointer(&info[0])); err != nil {
			return fmt.Errorf("testbed: %s: ethtool stats count of %s: %w", ns, iface, err)
		}
		if info[1]&(1<<ethSSStats) == 0 {
			return nil // the driver has no statistics
		}
		n := int(uint32(info[2]))
		if n == 0 {
			return nil
		}
		// struct ethtool_gstrings: cmd, string_set, len, then len names.
		names := make([]uint32, 3+n*ethGStringLen/4)
		names[0], names[1], names[2] = ethtoolGStrings, ethSSStats, uint32(n)
		if err := ethtoolCall(iface, unsafe.Pointer(&names[0])); err != nil {
			return fmt.Errorf("testbed: %s: ethtool stat names of %s: %w", ns, iface, err)
		}
		// struct ethtool_stats: cmd, n_stats, then n values.
		values := make([]uint64, 1+n)
		binary.NativeEndian.PutUint32(unsafe.Slice((*byte)(unsafe.Pointer(&values[0])), 8), ethtoolGStats)
		binary.NativeEndian.PutUint32(unsafe.Slice((*byte)(unsafe.Pointer(&values[0])), 8)[4:], uint32(n))
		if err := ethtoolCall(iface, unsafe.Pointer(&values[0])); err != nil {
			return fmt.Errorf("testbed: %s: ethtool stats of %s: %w", ns, iface, err)
		}
		raw := unsafe.Slice((*byte)(unsafe.Pointer(&names[3])), n*ethGStringLen)
		for i := range n {
			name := raw[i*ethGStringLen : (i+1)*ethGStringLen]
			if j := bytes.IndexByte(name, 0); j >= 0 {
				name = name[:j]
			}
			stats[string(name)] = values[1+i]
		}
		return nil
	})
	return stats, err
}

// RxQueuePackets returns, per rx queue of the veth iface in ns, how many
// packets it received (ethtool's rx_queue_<n>_xdp_packets). A veth counts
// per queue only on its NAPI path: while an XDP program is attached, or
// with GRO on for frames the peer may not aggregate otherwise.
func RxQueuePackets(ns, iface string) ([]uint64, error) {
	stats, err := EthtoolStats(ns, iface)
	if err != nil {
		return nil, err
	}
	var counts []uint64
	for q := 0; ; q++ {
		v, ok := stats[fmt.Sprintf("rx_queue_%d_xdp_packets", q)]
		if !ok {
			break
		}
		counts = append(counts, v)
	}
	if len(counts) == 0 {
		return nil, fmt.Errorf("testbed: %s: %s has no per-queue rx counters (not a veth?)", ns, iface)
	}
	return counts, nil
}
