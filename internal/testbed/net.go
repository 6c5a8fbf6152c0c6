package testbed

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"time"
)

// Dial opens a connection from inside ns. The socket stays in ns, so the
// connection can be used from any goroutine afterwards.
func (tb *Testbed) Dial(ctx context.Context, ns, network, addr string) (net.Conn, error) {
	return dialIn(ctx, ns, network, addr)
}

func dialIn(ctx context.Context, ns, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := DoIn(ns, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// HTTPClient returns an HTTP client whose connections are made in ns.
// Keep-alives are off so every request opens a fresh connection (and so a
// fresh flow through the node).
func (tb *Testbed) HTTPClient(ns string, timeout time.Duration) *http.Client {
	return httpClientIn(ns, timeout)
}

func httpClientIn(ns string, timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return dialIn(ctx, ns, network, addr)
			},
			DisableKeepAlives: true,
		},
	}
}

// Ping sends one ICMP echo request from ns to dst (IPv4 or IPv6) and waits
// for the matching reply. The machines have no ping binary, so this is the
// testbed's own.
func (tb *Testbed) Ping(ns string, dst netip.Addr, timeout time.Duration) error {
	return pingIn(ns, dst, timeout)
}

func pingIn(ns string, dst netip.Addr, timeout time.Duration) error {
	network, reqType, replyType := "ip4:icmp", byte(8), byte(0)
	if dst.Is6() && !dst.Is4In6() {
		network, reqType, replyType = "ip6:ipv6-icmp", 128, 129
	}
	var conn net.PacketConn
	err := DoIn(ns, func() error {
		var err error
		conn, err = net.ListenPacket(network, "")
		return err
	})
	if err != nil {
		return fmt.Errorf("testbed: ping socket in %s: %w", ns, err)
	}
	defer conn.Close()

	id := uint16(os.Getpid())
	seq := uint16(time.Now().UnixNano())
	msg := []byte{reqType, 0, 0, 0, byte(id >> 8), byte(id), byte(seq >> 8), byte(seq), 'x', 'd', 'p', 't'}
	if reqType == 8 {
		// The kernel fills in the ICMPv6 checksum itself, not the ICMPv4 one.
		binary.BigEndian.PutUint16(msg[2:], inetChecksum(msg))
	}
	to := &net.IPAddr{IP: dst.AsSlice()}
	if _, err := conn.WriteTo(msg, to); err != nil {
		return fmt.Errorf("testbed: ping %s from %s: %w", dst, ns, err)
	}
	deadline := time.Now().Add(timeout)
	if err := conn.SetReadDeadline(deadline); err != nil {
		return err
	}
	buf := make([]byte, 1500)
	for {
		n, from, err := conn.ReadFrom(buf)
		if err != nil {
			return fmt.Errorf("testbed: ping %s from %s: %w", dst, ns, err)
		}
		// Raw ICMPv4 sockets deliver the IP header too; ICMPv6 ones do not.
		b := buf[:n]
		if reqType == 8 && len(b) > 20 && b[0]>>4 == 4 {
			b = b[int(b[0]&0x0f)*4:]
		}
		if len(b) >= 8 && b[0] == replyType && binary.BigEndian.Uint16(b[4:]) == id &&
			binary.BigEndian.Uint16(b[6:]) == seq && from.String() == dst.String() {
			return nil
		}
	}
}

func inetChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
