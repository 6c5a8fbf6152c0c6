package xdp

import (
	"net"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestEgressCatchesOnlyFlows: on a NIC's egress, the program sends a packet
// to the exception link exactly when its tuple is a reply xdproxy waits
// for (a local backend answering a client that kept its address), and lets
// everything else leave.
func TestEgressCatchesOnlyFlows(t *testing.T) {
	requireRoot(t)
	a, b := vethPair(t)
	run(t, "ip", "link", "add", "x0", "netns", a, "type", "veth", "peer", "x1", "netns", a)
	run(t, "ip", "-n", a, "link", "set", "x0", "up")
	run(t, "ip", "-n", a, "link", "set", "x1", "up")
	o := loadSmall(t)
	var x0 int
	var at *Attachment
	if err := inNetns(a, func() error {
		l, err := netlink.LinkByName("x0")
		if err != nil {
			return err
		}
		x0 = l.Attrs().Index
		a0, err := netlink.LinkByName("a0")
		if err != nil {
			return err
		}
		at, err = o.AttachEgress(a0.Attrs().Index)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer at.Detach()
	if err := at.RegisterSocket(0, 3); err == nil {
		t.Error("an egress attachment accepted a socket")
	}
	if err := o.SetEgressRedirect(x0); err != nil {
		t.Fatal(err)
	}
	w := o.NewFlowWriter(1)
	w.Add(FlowKey{Src: packet.MustParseAddr("198.18.0.1"), Dst: packet.MustParseAddr("198.18.0.2"),
		SrcPort: 4000, DstPort: 5000, Proto: packet.ProtoUDP})
	if _, err := w.Flush(); err != nil {
		t.Fatal(err)
	}

	var srv net.PacketConn
	if err := inNetns(b, func() (err error) {
		srv, err = net.ListenPacket("udp4", "198.18.0.2:5000")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	send := func(port int) {
		t.Helper()
		if err := inNetns(a, func() error {
			c, err := net.DialUDP("udp4", &net.UDPAddr{IP: net.ParseIP("198.18.0.1"), Port: port},
				&net.UDPAddr{IP: net.ParseIP("198.18.0.2"), Port: 5000})
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write([]byte{byte(port)})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	send(4000) // a reply xdproxy waits for: caught
	send(4001) // anything else: leaves
	got := map[byte]bool{}
	buf := make([]byte, 16)
	srv.SetReadDeadline(time.Now().Add(time.Second))
	for {
		n, _, err := srv.ReadFrom(buf)
		if err != nil {
			break
		}
		got[buf[n-1]] = true
	}
	if got[byte(4000&0xff)] || !got[byte(4001&0xff)] {
		t.Errorf("received %v: want only the datagram from port 4001", got)
	}
	c, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.EgressRedirected != 1 || c.EgressSeen < 2 {
		t.Errorf("counters %+v: want 1 redirected of at least 2 seen", c)
	}
}
