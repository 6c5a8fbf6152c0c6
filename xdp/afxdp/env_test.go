package afxdp

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// The test topology: namespace A holds interface "xa" where the AF_XDP
// sockets live; namespace B holds its veth peer "xb", the test's stand-in
// for a pod, with 198.18.0.2 and a permanent neighbour entry for A's address
// so that no ARP is needed (A's frames all go to the XSK).
var (
	macA = net.HardwareAddr{0x02, 0xaf, 0, 0, 0, 0x01}
	macB = net.HardwareAddr{0x02, 0xaf, 0, 0, 0, 0x02}
	ipA  = net.IPv4(198, 18, 0, 1).To4()
	ipB  = net.IPv4(198, 18, 0, 2).To4()
)

type testEnv struct {
	nsA, nsB   string
	idxA, idxB int
	xsks       *ebpf.Map // XSKMAP on xa, keyed by RX queue
}

func run(t testing.TB, args ...string) {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// newEnv builds the two namespaces and the veth pair with queues RX and TX
// queues each and attaches a redirect-to-XSKMAP program to xa. Everything
// is removed when the test ends.
func newEnv(t testing.TB, queues int) *testEnv {
	t.Helper()
	if os.Geteuid() != 0 {
		if testing.Short() {
			t.Skip("needs root for network namespaces and AF_XDP")
		}
		t.Fatal("needs root for network namespaces and AF_XDP; make test runs as root")
	}
	var rnd [4]byte
	rand.Read(rnd[:])
	suffix := fmt.Sprintf("%d-%s", os.Getpid(), hex.EncodeToString(rnd[:]))
	e := &testEnv{nsA: "afxdp-a-" + suffix, nsB: "afxdp-b-" + suffix}
	for _, ns := range []string{e.nsA, e.nsB} {
		run(t, "ip", "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		// No IPv6 means no router solicitations or DAD frames as noise.
		run(t, "ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
	}
	q := fmt.Sprint(queues)
	run(t, "ip", "link", "add", "xa", "netns", e.nsA, "address", macA.String(), "numrxqueues", q, "numtxqueues", q,
		"type", "veth", "peer", "name", "xb", "netns", e.nsB, "address", macB.String(), "numrxqueues", q, "numtxqueues", q)
	run(t, "ip", "-n", e.nsA, "addr", "add", "198.18.0.1/24", "dev", "xa")
	run(t, "ip", "-n", e.nsB, "addr", "add", "198.18.0.2/24", "dev", "xb")
	run(t, "ip", "-n", e.nsA, "link", "set", "xa", "up")
	run(t, "ip", "-n", e.nsB, "link", "set", "xb", "up")
	run(t, "ip", "-n", e.nsB, "neigh", "add", "198.18.0.1", "lladdr", macA.String(), "dev", "xb", "nud", "permanent")

	inNetns(t, e.nsA, func() error {
		ifc, err := net.InterfaceByName("xa")
		if err != nil {
			return err
		}
		e.idxA = ifc.Index
		e.xsks, err = ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.XSKMap, KeySize: 4, ValueSize: 4, MaxEntries: uint32(queues)})
		if err != nil {
			return err
		}
		t.Cleanup(func() { e.xsks.Close() })
		prog, err := redirectProgram(e.xsks)
		if err != nil {
			return err
		}
		t.Cleanup(func() { prog.Close() })
		l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifc.Index})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	})
	inNetns(t, e.nsB, func() error {
		ifc, err := net.InterfaceByName("xb")
		if err == nil {
			e.idxB = ifc.Index
		}
		return err
	})
	return e
}

// redirectProgram sends every frame to the XSK registered for its RX queue
// and passes it to the stack when there is none.
func redirectProgram(xsks *ebpf.Map) (*ebpf.Program, error) {
	return ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.XDP,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, 16, asm.Word), // ctx->rx_queue_index
			asm.LoadMapPtr(asm.R1, xsks.FD()),
			asm.Mov.Imm(asm.R3, 2), // XDP_PASS when the key has no socket
			asm.FnRedirectMap.Call(),
			asm.Return(),
		},
	})
}

// inNetns runs fn on a thread that has entered namespace ns. The thread is
// never unlocked, so the Go runtime discards it afterwards instead of
// reusing it in the wrong namespace.
func inNetns(t testing.TB, ns string, fn func() error) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		f, err := os.Open("/run/netns/" + ns)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", ns, err)
			return
		}
		errc <- fn()
	}()
	if err := <-errc; err != nil {
		t.Fatalf("in netns %s: %v", ns, err)
	}
}

// open opens a socket on xa's queue and registers it in the XSKMAP.
func (e *testEnv) open(t testing.TB, queue int, cfg Config) *Socket {
	t.Helper()
	var s *Socket
	inNetns(t, e.nsA, func() (err error) {
		s, err = Open(e.idxA, queue, cfg)
		return err
	})
	t.Cleanup(func() { s.Close() })
	if err := e.xsks.Put(uint32(queue), uint32(s.FD())); err != nil {
		t.Fatalf("XSKMAP put: %v", err)
	}
	return s
}

// udpB opens a UDP socket in namespace B on 198.18.0.2:port (0 picks one).
func (e *testEnv) udpB(t testing.TB, port int) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	inNetns(t, e.nsB, func() (err error) {
		c, err = net.ListenUDP("udp4", &net.UDPAddr{IP: ipB, Port: port})
		return err
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// buildUDP writes an Ethernet/IPv4/UDP frame into b and returns its length.
// The UDP checksum is 0 (none), which IPv4 allows.
func buildUDP(b []byte, srcMAC, dstMAC net.HardwareAddr, src, dst net.IP, sport, dport uint16, payload []byte) int {
	copy(b[0:6], dstMAC)
	copy(b[6:12], srcMAC)
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	total := 20 + 8 + len(payload)
	ip[0], ip[1] = 0x45, 0
	binary.BigEndian.PutUint16(ip[2:], uint16(total))
	binary.BigEndian.PutUint32(ip[4:], 0)
	ip[8], ip[9] = 64, unix.IPPROTO_UDP
	copy(ip[12:16], src.To4())
	copy(ip[16:20], dst.To4())
	setIPv4Checksum(ip[:20])
	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	binary.BigEndian.PutUint16(udp[6:], 0)
	copy(udp[8:], payload)
	return 14 + total
}

func setIPv4Checksum(h []byte) {
	h[10], h[11] = 0, 0
	var sum uint32
	for i := 0; i < len(h); i += 2 {
		sum += uint32(h[i])<<8 | uint32(h[i+1])
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(h[10:], ^uint16(sum))
}

// udpPayload returns the UDP payload and ports of an Ethernet/IPv4/UDP
// frame, or ok=false for anything else.
func udpPayload(f []byte) (sport, dport uint16, payload []byte, ok bool) {
	if len(f) < 42 || binary.BigEndian.Uint16(f[12:]) != 0x0800 || f[14+9] != unix.IPPROTO_UDP {
		return 0, 0, nil, false
	}
	ihl := int(f[14]&0x0f) * 4
	udp := f[14+ihl:]
	ulen := int(binary.BigEndian.Uint16(udp[4:]))
	if ulen < 8 || ulen > len(udp) {
		return 0, 0, nil, false
	}
	return binary.BigEndian.Uint16(udp[0:]), binary.BigEndian.Uint16(udp[2:]), udp[8:ulen], true
}
