package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

// Helpers of the restart and pressure tests (restart_e2e_test.go,
// pressure_e2e_test.go): an echo server in the backends that checks every
// byte, client streams that check every echoed byte and time their
// progress, a paced UDP stream, and a packet capture.

// echoPort is where the tests' echo servers listen in every backend.
const echoPort = 7007

// echoSvc is a TCP service in front of the echo servers.
var echoSvc = svc{name: "echo", clusterIP: "198.19.0.70", port: echoPort, target: echoPort, backends: []int{0, 1, 2}}

// echoServers are TCP servers, one in each backend namespace, that echo
// what a connection sends after checking it against testserver's Pattern
// from the connection's first byte on. They run in the test process (the
// listening sockets live in the backend namespaces), so a test reads their
// counts directly.
type echoServers struct {
	lns      []net.Listener
	wg       sync.WaitGroup
	verified atomic.Int64 // bytes that matched the pattern, all connections
	accepted atomic.Int64
	resets   atomic.Int64 // connections that ended with an error instead of EOF

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
	errs   []string // pattern mismatches
}

func startEchoServers(t *testing.T, tb *testbed.Testbed) *echoServers {
	t.Helper()
	s := &echoServers{conns: map[net.Conn]struct{}{}}
	t.Cleanup(s.close)
	for i := range tb.NumBackends() {
		var ln net.Listener
		err := tb.Do(tb.BackendNS(i), func() (err error) {
			ln, err = net.Listen("tcp4", fmt.Sprintf(":%d", echoPort))
			return err
		})
		if err != nil {
			t.Fatalf("echo server in backend %d: %v", i, err)
		}
		s.lns = append(s.lns, ln)
		s.wg.Add(1)
		go s.accept(ln)
	}
	return s
}

func (s *echoServers) accept(ln net.Listener) {
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		s.accepted.Add(1)
		go func() {
			defer s.wg.Done()
			s.serve(c)
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
		}()
	}
}

func (s *echoServers) serve(c net.Conn) {
	defer c.Close()
	buf, want := make([]byte, 32<<10), make([]byte, 32<<10)
	var off int64
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if i := patternMismatch(buf[:n], want[:n], off); i >= 0 {
				s.mu.Lock()
				s.errs = append(s.errs, fmt.Sprintf("from %v: byte %d differs from the pattern", c.RemoteAddr(), off+int64(i)))
				s.mu.Unlock()
				return
			}
			off += int64(n)
			s.verified.Add(int64(n))
			if _, werr := c.Write(buf[:n]); werr != nil {
				s.resets.Add(1)
				return
			}
		}
		if err == io.EOF {
			_ = c.(*net.TCPConn).CloseWrite()
			return
		}
		if err != nil {
			s.mu.Lock()
			if !s.closed {
				s.resets.Add(1)
			}
			s.mu.Unlock()
			return
		}
	}
}

// mismatches returns the pattern mismatches the servers saw.
func (s *echoServers) mismatches() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.errs...)
}

func (s *echoServers) close() {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	for _, ln := range s.lns {
		ln.Close()
	}
	s.wg.Wait()
}

// patternMismatch fills want with the pattern at off and returns the index
// of the first byte of got that differs, or -1.
func patternMismatch(got, want []byte, off int64) int {
	testserver.FillPattern(want, off)
	if bytes.Equal(got, want) {
		return -1
	}
	i := 0
	for got[i] == want[i] {
		i++
	}
	return i
}

// dialFrom opens a TCP connection from the client namespace, from the
// client address local (any when invalid), to addr.
func dialFrom(tb *testbed.Testbed, local netip.Addr, addr string, timeout time.Duration) (*net.TCPConn, error) {
	var c net.Conn
	err := tb.Do(tb.ClientNS(), func() (err error) {
		d := net.Dialer{Timeout: timeout}
		if local.IsValid() {
			d.LocalAddr = &net.TCPAddr{IP: local.AsSlice()}
		}
		c, err = d.Dial("tcp4", addr)
		return err
	})
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// echoRound sends n bytes of the pattern from offset off on an echo
// connection and reads them back, checking them, all within timeout.
func echoRound(c net.Conn, off int64, n int, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	buf, want := make([]byte, n), make([]byte, n)
	testserver.FillPattern(buf, off)
	if _, err := c.Write(buf); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if _, err := io.ReadFull(c, buf); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if i := patternMismatch(buf, want, off); i >= 0 {
		return fmt.Errorf("echoed byte %d differs from the pattern", off+int64(i))
	}
	return nil
}

// progress times the progress of a stream: the longest interval without
// any, per period.
type progress struct {
	mu     sync.Mutex
	last   time.Time
	maxGap time.Duration
}

func (p *progress) mark(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.last.IsZero() {
		p.maxGap = max(p.maxGap, now.Sub(p.last))
	}
	p.last = now
}

// take returns the longest interval without progress since the last take
// (an interval still open counts up to now) and starts a new period.
func (p *progress) take(now time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	g := max(p.maxGap, now.Sub(p.last))
	p.maxGap = 0
	return g
}

// since says whether there was progress after t.
func (p *progress) since(t time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last.After(t)
}

// A tcpStream keeps an echo connection busy both ways: a chunk of the
// pattern every streamEvery (with at most streamWindow bytes not yet
// echoed), and a reader that checks every echoed byte.
type tcpStream struct {
	c    *net.TCPConn
	sent atomic.Int64 // bytes written
	recv atomic.Int64 // bytes echoed back, all checked
	prog progress
	done chan struct{} // closed when the reader has ended

	mu  sync.Mutex
	err error
}

const (
	streamChunk  = 2 << 10
	streamEvery  = 10 * time.Millisecond
	streamWindow = 64 << 10
)

func newTCPStream(c *net.TCPConn) *tcpStream {
	return &tcpStream{c: c, done: make(chan struct{})}
}

func (s *tcpStream) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.err = err
	}
}

func (s *tcpStream) failed() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// run streams until stop closes; then it half-closes and the reader ends
// at the echo server's EOF.
func (s *tcpStream) run(stop <-chan struct{}) {
	s.prog.mark(time.Now())
	go s.write(stop)
	go s.read()
}

func (s *tcpStream) write(stop <-chan struct{}) {
	buf := make([]byte, streamChunk)
	tick := time.NewTicker(streamEvery)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			if err := s.c.CloseWrite(); err != nil {
				s.fail(fmt.Errorf("half-close: %w", err))
			}
			return
		case <-tick.C:
		}
		if s.failed() != nil {
			return
		}
		off := s.sent.Load()
		if off-s.recv.Load() > streamWindow {
			continue
		}
		testserver.FillPattern(buf, off)
		if _, err := s.c.Write(buf); err != nil {
			s.fail(fmt.Errorf("write at byte %d: %w", off, err))
			return
		}
		s.sent.Add(int64(len(buf)))
	}
}

func (s *tcpStream) read() {
	defer close(s.done)
	buf, want := make([]byte, 32<<10), make([]byte, 32<<10)
	for {
		n, err := s.c.Read(buf)
		if n > 0 {
			off := s.recv.Load()
			if i := patternMismatch(buf[:n], want[:n], off); i >= 0 {
				s.fail(fmt.Errorf("echoed byte %d differs from the pattern", off+int64(i)))
				return
			}
			s.recv.Add(int64(n))
			s.prog.mark(time.Now())
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			s.fail(fmt.Errorf("read at byte %d: %w", s.recv.Load(), err))
			return
		}
	}
}

// finish waits for the reader (stop must be closed) and returns why the
// stream broke, if it did: an error, or an echo shorter than what was sent.
func (s *tcpStream) finish(timeout time.Duration) error {
	_ = s.c.SetReadDeadline(time.Now().Add(timeout))
	<-s.done
	s.c.Close()
	if err := s.failed(); err != nil {
		return err
	}
	if s.recv.Load() != s.sent.Load() {
		return fmt.Errorf("sent %d bytes, %d echoed before the server's EOF", s.sent.Load(), s.recv.Load())
	}
	return nil
}

// A udpStream sends sequence-numbered datagrams to the testbed's UDP echo
// server through one socket (one flow) at a fixed pace and records which
// were answered, from which backend.
type udpStream struct {
	c       net.Conn
	every   time.Duration
	sent    atomic.Int64
	got     []atomic.Bool
	prog    progress
	refused atomic.Int64 // ICMP errors the socket reported
	bad     atomic.Int64 // replies that do not carry a datagram we sent
	done    chan struct{}

	mu       sync.Mutex
	backends map[string]int
}

func newUDPStream(c net.Conn, every time.Duration, most int) *udpStream {
	return &udpStream{c: c, every: every, got: make([]atomic.Bool, most), done: make(chan struct{}), backends: map[string]int{}}
}

func (u *udpStream) run(stop <-chan struct{}) {
	u.prog.mark(time.Now())
	go u.send(stop)
	go u.receive()
}

func (u *udpStream) send(stop <-chan struct{}) {
	start := time.Now()
	for i := 0; i < len(u.got); i++ {
		if d := time.Until(start.Add(time.Duration(i) * u.every)); d > 0 {
			select {
			case <-stop:
				return
			case <-time.After(d):
			}
		}
		select {
		case <-stop:
			return
		default:
		}
		// Counted first, so that a quick reply is never taken for one we
		// did not send. A write can fail with ECONNREFUSED, reporting an
		// ICMP error for an earlier datagram; the receiver counts those.
		u.sent.Add(1)
		if _, err := fmt.Fprintf(u.c, "u%d", i); errors.Is(err, unix.ECONNREFUSED) {
			u.refused.Add(1)
		}
	}
}

func (u *udpStream) receive() {
	defer close(u.done)
	buf := make([]byte, 512)
	for {
		n, err := u.c.Read(buf)
		if err != nil {
			if errors.Is(err, unix.ECONNREFUSED) {
				u.refused.Add(1)
				continue
			}
			return // the deadline finish sets, or closed
		}
		name, msg, _ := strings.Cut(string(buf[:n]), " ")
		var seq int
		if _, err := fmt.Sscanf(msg, "u%d", &seq); err != nil || seq < 0 || seq >= len(u.got) || int64(seq) >= u.sent.Load() {
			u.bad.Add(1)
			continue
		}
		u.got[seq].Store(true)
		u.prog.mark(time.Now())
		u.mu.Lock()
		u.backends[name]++
		u.mu.Unlock()
	}
}

// finish waits a little for late replies (stop must be closed) and ends the
// receiver.
func (u *udpStream) finish() {
	_ = u.c.SetReadDeadline(time.Now().Add(time.Second))
	<-u.done
	u.c.Close()
}

// lost counts the datagrams [from, to) that were not answered.
func (u *udpStream) lost(from, to int64) int {
	n := 0
	for i := from; i < to && i < int64(len(u.got)); i++ {
		if !u.got[i].Load() {
			n++
		}
	}
	return n
}

// tcpSeg is one captured TCP segment.
type tcpSeg struct {
	out      bool // sent by this namespace
	src, dst netip.AddrPort
	seq, ack uint32
	flags    uint8
	payload  int
	at       time.Time // when the sniffer read it
}

const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

func (s tcpSeg) String() string {
	flags := ""
	for i, f := range "FSRPAU" {
		if s.flags&(1<<i) != 0 {
			flags += string(f)
		}
	}
	return fmt.Sprintf("%v > %v [%s] seq %d ack %d len %d", s.src, s.dst, flags, s.seq, s.ack, s.payload)
}

// end is the sequence number after the segment.
func (s tcpSeg) end() uint32 {
	e := s.seq + uint32(s.payload)
	if s.flags&(tcpSYN|tcpFIN) != 0 {
		e++
	}
	return e
}

// A sniffer captures the IPv4 TCP segments that every interface of one
// namespace sends and receives (an AF_PACKET socket), all of them or, with
// a host, only those from or to it (a socket filter, so that a flood
// does not bury them).
type sniffer struct {
	fd   int
	stop atomic.Bool
	done chan struct{}
	mu   sync.Mutex
	segs []tcpSeg
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func startSniffer(t *testing.T, ns string, host netip.Addr) *sniffer {
	t.Helper()
	s := &sniffer{done: make(chan struct{})}
	err := testbed.DoIn(ns, func() (err error) {
		s.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		return err
	})
	if err != nil {
		t.Fatalf("packet socket in %s: %v", ns, err)
	}
	if host.IsValid() {
		// Classic BPF on the network header (SOCK_DGRAM): accept when
		// the source or the destination address is host.
		h := binary.BigEndian.Uint32(host.AsSlice())
		prog := []unix.SockFilter{
			{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 12},
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 3, Jf: 0, K: h},
			{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 16},
			{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 1, Jf: 0, K: h},
			{Code: unix.BPF_RET | unix.BPF_K, K: 0},
			{Code: unix.BPF_RET | unix.BPF_K, K: 0xffff},
		}
		fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
		if err := unix.SetsockoptSockFprog(s.fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &fp); err != nil {
			unix.Close(s.fd)
			t.Fatalf("socket filter: %v", err)
		}
	}
	tv := unix.NsecToTimeval(int64(50 * time.Millisecond))
	if err := unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	go s.loop()
	t.Cleanup(func() {
		s.stop.Store(true)
		<-s.done
		unix.Close(s.fd)
	})
	return s
}

func (s *sniffer) loop() {
	defer close(s.done)
	buf := make([]byte, 65536)
	for !s.stop.Load() {
		n, from, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			continue
		}
		ll, ok := from.(*unix.SockaddrLinklayer)
		if !ok || ll.Protocol != htons(unix.ETH_P_IP) || n < 20 || buf[0]>>4 != 4 || buf[9] != 6 {
			continue
		}
		ihl := int(buf[0]&0x0f) * 4
		total := int(binary.BigEndian.Uint16(buf[2:]))
		if total > n || ihl+20 > total {
			continue
		}
		tcp := buf[ihl:total]
		doff := int(tcp[12]>>4) * 4
		src, dst := netip.AddrFrom4([4]byte(buf[12:16])), netip.AddrFrom4([4]byte(buf[16:20]))
		seg := tcpSeg{
			out: ll.Pkttype == unix.PACKET_OUTGOING,
			src: netip.AddrPortFrom(src, binary.BigEndian.Uint16(tcp[0:])),
			dst: netip.AddrPortFrom(dst, binary.BigEndian.Uint16(tcp[2:])),
			seq: binary.BigEndian.Uint32(tcp[4:]), ack: binary.BigEndian.Uint32(tcp[8:]),
			flags: tcp[13], payload: len(tcp) - doff,
		}
		seg.at = time.Now()
		s.mu.Lock()
		s.segs = append(s.segs, seg)
		s.mu.Unlock()
	}
}

// find returns the captured segments that match.
func (s *sniffer) find(match func(tcpSeg) bool) []tcpSeg {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []tcpSeg
	for _, g := range s.segs {
		if match(g) {
			out = append(out, g)
		}
	}
	return out
}

// conntrackStats reads the connection table's counters.
func (a *daemon) conntrackStats() (ctStats, error) {
	var st struct {
		Conntrack ctStats `json:"conntrack"`
	}
	err := a.query("stats", &st)
	return st.Conntrack, err
}

// ctStats is the part of conntrack.Stats the tests read.
type ctStats struct {
	Live, Assured, Unassured, Capacity, Inserts     uint64
	FullDrops, EvictedExpired, EvictedUnassured     uint64
	EvictedUnreplied, OutOfWindowRST, SNATExhausted uint64
}

// flowState finds the tracked flow whose original tuple contains orig and
// returns its state and translation.
func (a *daemon) flowState(orig string) (state, translated string, ok bool) {
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		return "", "", false
	}
	for _, f := range flows {
		if strings.Contains(f.Original, orig) {
			return f.State, f.Translated, true
		}
	}
	return "", "", false
}
