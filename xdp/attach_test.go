package xdp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	asavie "github.com/asavie/xdp"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// xdpState is what netlink reports about an interface's XDP program.
type xdpState struct {
	attached bool
	mode     uint32 // XDP_ATTACHED_*
	name     string
}

func linkXDP(ifname string) (xdpState, error) {
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return xdpState{}, err
	}
	x := l.Attrs().Xdp
	if x == nil || !x.Attached {
		return xdpState{}, nil
	}
	name, err := programName(x.ProgId)
	return xdpState{attached: true, mode: x.AttachMode, name: name}, err
}

func mustLinkXDP(t *testing.T, ns, ifname string) xdpState {
	t.Helper()
	var st xdpState
	if err := inNetns(ns, func() (err error) { st, err = linkXDP(ifname); return err }); err != nil {
		t.Fatal(err)
	}
	return st
}

func ifindex(ifname string) (int, error) {
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return 0, err
	}
	return l.Attrs().Index, nil
}

// attachIn attaches o's program to ifname in namespace ns.
func attachIn(ns, ifname string, o *Objects, mode Mode) (a *Attachment, err error) {
	err = inNetns(ns, func() error {
		idx, err := ifindex(ifname)
		if err != nil {
			return err
		}
		a, err = o.Attach(idx, mode)
		return err
	})
	return a, err
}

func loadSmall(t *testing.T) *Objects {
	t.Helper()
	o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16, MaxFlows: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

func TestAttachModes(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		mode     Mode
		want     Mode
		attached uint32
	}{
		{Native, Native, 1 /* XDP_ATTACHED_DRV */},
		{Generic, Generic, 2 /* XDP_ATTACHED_SKB */},
		{Auto, Native, 1}, // veth has native XDP
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			_, b := vethPair(t)
			o := loadSmall(t)
			a, err := attachIn(b, "b0", o, tc.mode)
			if err != nil {
				t.Fatal(err)
			}
			if a.Mode() != tc.want || a.Interface() != "b0" {
				t.Errorf("attached to %s in %v, want b0 in %v", a.Interface(), a.Mode(), tc.want)
			}
			st := mustLinkXDP(t, b, "b0")
			if want := (xdpState{true, tc.attached, ProgramName}); st != want {
				t.Errorf("netlink shows %+v, want %+v", st, want)
			}
			if err := a.Close(); err != nil {
				t.Fatal(err)
			}
			if st := mustLinkXDP(t, b, "b0"); st.attached {
				t.Errorf("still attached after Close: %+v", st)
			}
		})
	}
}

// TestAttachSharesTablesPerInterfaceSockets attaches to two interfaces:
// one SetTables serves both, and each has its own queue 0.
func TestAttachSharesTablesPerInterfaceSockets(t *testing.T) {
	requireRoot(t)
	a, b := vethPair(t)
	o := loadSmall(t)
	atA, err := attachIn(a, "a0", o, Generic)
	if err != nil {
		t.Fatal(err)
	}
	defer atA.Close()
	atB, err := attachIn(b, "b0", o, Generic)
	if err != nil {
		t.Fatal(err)
	}
	defer atB.Close()
	if err := o.SetTables([]Key{{packet.MustParseAddr(vip4), 80, packet.ProtoTCP}}, nil); err != nil {
		t.Fatal(err)
	}
	if err := atA.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	frame := tcp4(t, client4, 1000, vip4, 80)
	for _, c := range []struct {
		at   *Attachment
		want uint32
	}{{atA, xdpRedirect}, {atB, xdpDrop}} {
		ret, got := runFrame(t, o, c.at, frame)
		if ret != c.want || got.MatchFrontend != 1 {
			t.Errorf("%s: verdict %d, counters %+v; want verdict %d and a frontend match", c.at.Interface(), ret, got, c.want)
		}
	}
	var queues int
	if err := inNetns(b, func() error {
		l, err := netlink.LinkByName("b0")
		queues = l.Attrs().NumRxQueues
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := atB.RegisterSocket(queues-1, xskSocket(t)); err != nil {
		t.Errorf("RegisterSocket on the last of %d queues: %v", queues, err)
	}
	if err := atB.RegisterSocket(queues, xskSocket(t)); err == nil {
		t.Errorf("RegisterSocket accepted queue %d of a veth with %d queues", queues, queues)
	}
}

// otherProgram loads a trivial XDP program under a name that is not ours.
func otherProgram(t *testing.T) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "someone_else", Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, xdpPass), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// setXdpNetlink attaches prog the old way, through netlink, which outlives
// the program's file descriptor.
func setXdpNetlink(t *testing.T, ns, ifname string, fd, flags int) {
	t.Helper()
	err := inNetns(ns, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		return netlink.LinkSetXdpFdWithFlags(l, fd, flags)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestAttachRefusesForeignProgram(t *testing.T) {
	requireRoot(t)
	_, b := vethPair(t)
	o := loadSmall(t)
	setXdpNetlink(t, b, "b0", otherProgram(t).FD(), unix.XDP_FLAGS_SKB_MODE)
	t.Cleanup(func() {
		inNetns(b, func() error {
			l, _ := netlink.LinkByName("b0")
			return netlink.LinkSetXdpFdWithFlags(l, -1, unix.XDP_FLAGS_SKB_MODE)
		})
	})

	_, err := attachIn(b, "b0", o, Auto)
	if !errors.Is(err, ErrForeignProgram) {
		t.Fatalf("Attach: %v, want ErrForeignProgram", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "b0") || !strings.Contains(msg, "someone_else") {
		t.Errorf("error %q names neither the interface nor the program", msg)
	}
	if st := mustLinkXDP(t, b, "b0"); st.name != "someone_else" {
		t.Errorf("the other program was touched: %+v", st)
	}
}

func TestAttachReplacesStaleNetlinkProgram(t *testing.T) {
	requireRoot(t)
	_, b := vethPair(t)
	o := loadSmall(t)
	for _, stale := range []struct {
		name  string
		flags int
	}{{"native", unix.XDP_FLAGS_DRV_MODE}, {"generic", unix.XDP_FLAGS_SKB_MODE}} {
		t.Run(stale.name, func(t *testing.T) {
			// What an older xdproxy that attached through netlink
			// and then died leaves behind.
			inst, err := o.newInstance(1)
			if err != nil {
				t.Fatal(err)
			}
			setXdpNetlink(t, b, "b0", inst.prog.FD(), stale.flags)
			inst.close()
			if st := mustLinkXDP(t, b, "b0"); !st.attached || st.name != ProgramName {
				t.Fatalf("stale program not in place: %+v", st)
			}

			a, err := attachIn(b, "b0", o, Generic)
			if err != nil {
				t.Fatalf("Attach over a stale program: %v", err)
			}
			if st := mustLinkXDP(t, b, "b0"); st.mode != 2 {
				t.Errorf("after Attach: %+v, want our program in generic mode", st)
			}
			a.Close()
			if st := mustLinkXDP(t, b, "b0"); st.attached {
				t.Errorf("still attached after Close: %+v", st)
			}
		})
	}
}

func TestAttachTwiceIsBusy(t *testing.T) {
	requireRoot(t)
	_, b := vethPair(t)
	o := loadSmall(t)
	a, err := attachIn(b, "b0", o, Native)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := attachIn(b, "b0", o, Native); !errors.Is(err, ErrBusy) {
		t.Fatalf("second Attach: %v, want ErrBusy", err)
	}
	if st := mustLinkXDP(t, b, "b0"); !st.attached {
		t.Error("the live attachment was removed")
	}
}

const helperEnv = "XDP_TEST_HELPER_NETNS"

// TestHelperAttachAndWait is not a test: TestAttachAfterKill runs the test
// binary again with it, as the process that attaches and is killed.
func TestHelperAttachAndWait(t *testing.T) {
	ns := os.Getenv(helperEnv)
	if ns == "" {
		t.Skip("helper process for TestAttachAfterKill")
	}
	o, err := Load(Options{MaxFrontends: 16, MaxAddrs: 16, MaxFlows: 16})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	if _, err := attachIn(ns, "b0", o, Native); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("attached")
	time.Sleep(time.Minute) // killed long before
	os.Exit(1)
}

func TestAttachAfterKill(t *testing.T) {
	requireRoot(t)
	_, b := vethPair(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperAttachAndWait$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+b)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "attached\n" {
		t.Fatalf("helper said %q (%v)", line, err)
	}
	if st := mustLinkXDP(t, b, "b0"); !st.attached || st.name != ProgramName {
		t.Fatalf("helper's program not attached: %+v", st)
	}

	if err := cmd.Process.Signal(unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if st := mustLinkXDP(t, b, "b0"); st.attached {
		t.Errorf("program still attached after its process died: %+v", st)
	}
	o := loadSmall(t)
	a, err := attachIn(b, "b0", o, Native)
	if err != nil {
		t.Fatalf("Attach after the previous owner was killed: %v", err)
	}
	a.Close()
}

// TestTrafficPassesWithoutSocket attaches to a veth end with no AF_XDP
// socket registered: the host behind it must still answer ping and TCP on
// every port that is not a frontend, while frames to a frontend are
// dropped and counted (xdproxy restarting: the kernel must not reset
// connections it knows nothing about).
func TestTrafficPassesWithoutSocket(t *testing.T) {
	requireRoot(t)
	for _, mode := range []Mode{Native, Generic} {
		t.Run(mode.String(), func(t *testing.T) {
			a, b := vethPair(t)
			o := loadSmall(t)
			frontends := []Key{{packet.MustParseAddr("198.18.0.2"), 8080, packet.ProtoTCP}}
			if err := o.SetTables(frontends, nil); err != nil {
				t.Fatal(err)
			}
			at, err := attachIn(b, "b0", o, mode)
			if err != nil {
				t.Fatal(err)
			}
			defer at.Close()

			if err := inNetns(a, func() error { return ping("198.18.0.1", "198.18.0.2") }); err != nil {
				t.Fatalf("ping: %v", err)
			}

			for _, port := range []int{9090, 8080} {
				var ln net.Listener
				if err := inNetns(b, func() (err error) {
					ln, err = net.Listen("tcp4", fmt.Sprintf("198.18.0.2:%d", port))
					return err
				}); err != nil {
					t.Fatal(err)
				}
				go func() {
					c, err := ln.Accept()
					if err == nil {
						c.Write([]byte("hello\n"))
						c.Close()
					}
				}()
				var reply string
				timeout := 5 * time.Second
				if port == 8080 {
					timeout = time.Second // expected to time out
				}
				err := inNetns(a, func() error {
					c, err := net.DialTimeout("tcp4", ln.Addr().String(), timeout)
					if err != nil {
						return err
					}
					defer c.Close()
					c.SetDeadline(time.Now().Add(5 * time.Second))
					reply, err = bufio.NewReader(c).ReadString('\n')
					return err
				})
				ln.Close()
				if port == 8080 {
					if err == nil {
						t.Fatalf("TCP to the frontend port %d reached the kernel: %q", port, reply)
					}
					continue
				}
				if err != nil || reply != "hello\n" {
					t.Fatalf("TCP to port %d: %q, %v", port, reply, err)
				}
			}
			c, err := o.Counters()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%v: %+v", mode, c)
			if c.Redirected != 0 || c.NoSocket == 0 || c.MatchFrontend != c.NoSocket || c.Passed == 0 {
				t.Errorf("counters %+v: want frontend frames counted no_socket (dropped) and the rest passed", c)
			}
		})
	}
}

// ping sends ICMP echo requests from src to dst over a raw socket until one
// is answered, for up to three seconds.
func ping(src, dst string) error {
	c, err := net.ListenPacket("ip4:icmp", src)
	if err != nil {
		return err
	}
	defer c.Close()
	const id = 0x4242
	buf := gopacket.NewSerializeBuffer()
	err = gopacket.SerializeLayers(buf, gopacket.SerializeOptions{ComputeChecksums: true},
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(layers.ICMPv4TypeEchoRequest, 0), Id: id, Seq: 1},
		gopacket.Payload("xdproxy"))
	if err != nil {
		return err
	}
	to := &net.IPAddr{IP: net.ParseIP(dst)}
	reply := make([]byte, 1500)
	// Each try waits up to 300 ms for the reply, so the poll needs no
	// interval of its own.
	err = wait.PollUntilContextTimeout(context.Background(), 0, 3*time.Second, true, func(context.Context) (bool, error) {
		if _, err := c.WriteTo(buf.Bytes(), to); err != nil {
			return false, err
		}
		c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		for {
			n, from, err := c.ReadFrom(reply)
			if err != nil {
				return false, nil // timed out: send again
			}
			// The raw socket sees every ICMP message; the reply is an
			// echo reply with our id from dst.
			if n >= 8 && reply[0] == layers.ICMPv4TypeEchoReply && reply[4] == id>>8 && reply[5] == id&0xff &&
				from.String() == dst {
				return true, nil
			}
		}
	})
	if wait.Interrupted(err) {
		return fmt.Errorf("no echo reply from %s", dst)
	}
	return err
}

// TestTrafficReachesSockets attaches with an AF_XDP socket on every queue:
// UDP to a frontend must arrive in the sockets, not in the kernel, while
// ping to the same host still works.
func TestTrafficReachesSockets(t *testing.T) {
	requireRoot(t)
	for _, mode := range []Mode{Native, Generic} {
		t.Run(mode.String(), func(t *testing.T) {
			a, b := vethPair(t)
			o := loadSmall(t)
			const port = 7777
			frontends := []Key{{packet.MustParseAddr("198.18.0.2"), port, packet.ProtoUDP}}
			if err := o.SetTables(frontends, nil); err != nil {
				t.Fatal(err)
			}
			_, socks := attachWithSockets(t, o, b, "b0", mode)
			// The kernel's listener on the same port must get nothing.
			var kernel net.PacketConn
			if err := inNetns(b, func() (err error) {
				kernel, err = net.ListenPacket("udp4", fmt.Sprintf("198.18.0.2:%d", port))
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer kernel.Close()

			const sent = 20
			if err := inNetns(a, func() error {
				c, err := net.Dial("udp4", fmt.Sprintf("198.18.0.2:%d", port))
				if err != nil {
					return err
				}
				defer c.Close()
				for range sent {
					if _, err := c.Write([]byte("to xdproxy")); err != nil {
						return err
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}

			got := receive(t, socks, sent, func(p *packet.Packet) bool { return p.DstPort == port })
			if got != sent {
				t.Errorf("sockets received %d of %d datagrams", got, sent)
			}
			kernel.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			if n, _, err := kernel.ReadFrom(make([]byte, 100)); err == nil {
				t.Errorf("the kernel's socket got a %d-byte datagram meant for xdproxy", n)
			}
			if err := inNetns(a, func() error { return ping("198.18.0.1", "198.18.0.2") }); err != nil {
				t.Errorf("ping with sockets registered: %v", err)
			}
			c, err := o.Counters()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%v: %+v", mode, c)
			if c.Redirected != sent || c.NoSocket != 0 {
				t.Errorf("counters %+v: want %d redirected, none without socket", c, sent)
			}
		})
	}
}

// attachWithSockets attaches o's program to ifname in namespace ns with an
// AF_XDP socket on every receive queue in use. Cleanup closes them all.
func attachWithSockets(t *testing.T, o *Objects, ns, ifname string, mode Mode) (*Attachment, []*asavie.Socket) {
	t.Helper()
	var at *Attachment
	var socks []*asavie.Socket
	err := inNetns(ns, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		if at, err = o.Attach(l.Attrs().Index, mode); err != nil {
			return err
		}
		// NumRxQueues counts allocated queues; binding fails past the
		// ones in use (one, for a default veth).
		for q := range l.Attrs().NumRxQueues {
			s, err := asavie.NewSocket(l.Attrs().Index, q, nil)
			if err != nil && q > 0 {
				break
			}
			if err != nil {
				return fmt.Errorf("queue %d: %w", q, err)
			}
			socks = append(socks, s)
			s.Fill(s.GetDescs(s.NumFreeFillSlots()))
			if err := at.RegisterSocket(q, s.FD()); err != nil {
				return err
			}
		}
		return nil
	})
	t.Cleanup(func() {
		if at != nil {
			at.Close()
		}
		for _, s := range socks {
			s.Close()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return at, socks
}

// receive polls socks until want frames that match have arrived, or for
// three seconds, and returns how many did.
func receive(t *testing.T, socks []*asavie.Socket, want int, match func(*packet.Packet) bool) int {
	t.Helper()
	got := 0
	var p packet.Packet
	// Each round waits up to 20 ms on every socket, so the poll needs no
	// interval of its own.
	_ = wait.PollUntilContextTimeout(context.Background(), 0, 3*time.Second, true, func(context.Context) (bool, error) {
		for _, s := range socks {
			n, _, err := s.Poll(20)
			if err != nil {
				t.Fatal(err)
			}
			descs := s.Receive(n)
			for _, d := range descs {
				if packet.Parse(s.GetFrame(d), &p) == packet.OK && match(&p) {
					got++
				}
			}
			s.Fill(descs)
		}
		return got >= want, nil
	})
	return got
}
