package testserver

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Config says what to serve. An empty address turns that server off.
type Config struct {
	Name     string
	HTTPAddr string // e.g. ":80"
	UDPAddr  string // e.g. ":53"
	TCPAddr  string // e.g. ":5001"
}

// Server is a running set of listeners.
type Server struct {
	cfg   Config
	http  *http.Server
	httpL net.Listener
	udp   net.PacketConn
	tcp   net.Listener
	wg    sync.WaitGroup
	quit  chan struct{} // closed by Close: delayed replies and tick loops end

	closeOnce sync.Once
	closeErr  error

	mu      sync.Mutex
	closing bool
	conns   map[net.Conn]struct{} // open stream connections, cut by Close
	delayed atomic.Int32          // delayed UDP replies waiting
}

// Listen opens every configured listener and starts serving. The listeners
// are open when it returns, so a caller can announce readiness.
func Listen(cfg Config) (*Server, error) {
	s := &Server{cfg: cfg, quit: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	var err error
	if cfg.HTTPAddr != "" {
		if s.httpL, err = net.Listen("tcp", cfg.HTTPAddr); err != nil {
			return nil, s.closeWith(err)
		}
		s.http = &http.Server{Handler: s.handler(), ReadHeaderTimeout: 10 * time.Second}
		s.wg.Add(1)
		go func() { defer s.wg.Done(); _ = s.http.Serve(s.httpL) }()
	}
	if cfg.UDPAddr != "" {
		if s.udp, err = net.ListenPacket("udp", cfg.UDPAddr); err != nil {
			return nil, s.closeWith(err)
		}
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.serveUDP() }()
	}
	if cfg.TCPAddr != "" {
		if s.tcp, err = net.Listen("tcp", cfg.TCPAddr); err != nil {
			return nil, s.closeWith(err)
		}
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.serveTCP() }()
	}
	return s, nil
}

// HTTPAddr returns where the HTTP server listens (useful with port 0), or
// nil when it is off.
func (s *Server) HTTPAddr() net.Addr {
	if s.httpL == nil {
		return nil
	}
	return s.httpL.Addr()
}

// UDPAddr returns where the UDP echo server listens, or nil.
func (s *Server) UDPAddr() net.Addr {
	if s.udp == nil {
		return nil
	}
	return s.udp.LocalAddr()
}

// StreamAddr returns where the TCP stream server listens, or nil.
func (s *Server) StreamAddr() net.Addr {
	if s.tcp == nil {
		return nil
	}
	return s.tcp.Addr()
}

func (s *Server) closeWith(err error) error { return errors.Join(err, s.Close()) }

// Close stops every listener and waits for the serving loops to end.
// Connections in progress are cut and delayed UDP replies dropped. It is
// idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.close() })
	return s.closeErr
}

func (s *Server) close() error {
	close(s.quit)
	var errs []error
	if s.http != nil {
		errs = append(errs, s.http.Close())
	}
	if s.udp != nil {
		errs = append(errs, s.udp.Close())
	}
	if s.tcp != nil {
		errs = append(errs, s.tcp.Close())
	}
	s.mu.Lock()
	s.closing = true
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return errors.Join(errs...)
}

func (s *Server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Backend", s.cfg.Name)
		_, _ = io.WriteString(w, s.cfg.Name)
	})
	// /whoami answers "name client-address:port": the address the
	// backend sees, which says whether the connection was masqueraded.
	mux.HandleFunc("GET /whoami", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Backend", s.cfg.Name)
		_, _ = io.WriteString(w, s.cfg.Name+" "+r.RemoteAddr)
	})
	mux.HandleFunc("GET /bytes", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		if err != nil || n < 0 {
			http.Error(w, "n must be a byte count", http.StatusBadRequest)
			return
		}
		w.Header().Set("X-Backend", s.cfg.Name)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		_, _ = io.Copy(w, Pattern(n))
	})
	return mux
}

func (s *Server) serveUDP() {
	buf := make([]byte, 65536)
	prefix := []byte(s.cfg.Name + " ")
	out := make([]byte, 0, len(prefix)+len(buf))
	for {
		n, from, err := s.udp.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		out = append(append(out[:0], prefix...), buf[:n]...)
		if d, ok := parseDelay(buf[:n]); ok {
			s.replyLater(d, bytes.Clone(out), from)
			continue
		}
		_, _ = s.udp.WriteTo(out, from)
	}
}

// Bounds of the delayed UDP echo.
const (
	MaxDelay        = 10 * time.Minute
	maxDelayed      = 4096 // replies waiting at once; more are dropped
	delayCommandMax = 32   // "delay <ms> " must fit in this many bytes
)

// parseDelay reads the "delay <ms> " prefix of a datagram.
func parseDelay(b []byte) (time.Duration, bool) {
	rest, ok := bytes.CutPrefix(b[:min(len(b), delayCommandMax)], []byte("delay "))
	if !ok {
		return 0, false
	}
	digits, _, ok := bytes.Cut(rest, []byte(" "))
	if !ok {
		return 0, false
	}
	ms, err := strconv.ParseInt(string(digits), 10, 64)
	if err != nil || ms < 0 || time.Duration(ms)*time.Millisecond > MaxDelay {
		return 0, false
	}
	return time.Duration(ms) * time.Millisecond, true
}

// replyLater sends msg to the client after d from the same socket, unless
// the server closes first.
func (s *Server) replyLater(d time.Duration, msg []byte, to net.Addr) {
	if s.delayed.Add(1) > maxDelayed {
		s.delayed.Add(-1)
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.delayed.Add(-1)
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			_, _ = s.udp.WriteTo(msg, to)
		case <-s.quit:
		}
	}()
}

func (s *Server) serveTCP() {
	for {
		c, err := s.tcp.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		s.mu.Lock()
		if s.closing {
			s.mu.Unlock()
			_ = c.Close()
			continue
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveStream(c)
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
		}()
	}
}

// maxLine bounds the command line of the stream protocol.
const maxLine = 64

func (s *Server) serveStream(c net.Conn) {
	defer c.Close()
	r := bufio.NewReaderSize(c, 64<<10)
	line, err := readLine(r)
	if err != nil {
		return
	}
	cmd, arg, _ := strings.Cut(line, " ")
	switch cmd {
	case "SEND":
		n, err := strconv.ParseInt(arg, 10, 64)
		if err != nil || n < 0 {
			fmt.Fprintf(c, "ERR bad count %q\n", arg)
			return
		}
		if _, err := io.Copy(c, Pattern(n)); err != nil {
			return
		}
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		// Wait for the client to close, so the last bytes are not cut by a
		// reset.
		_, _ = io.Copy(io.Discard, r)
	case "RECV":
		n, mismatch, err := VerifyPattern(r)
		if err != nil {
			return
		}
		fmt.Fprintf(c, "%d %d\n", n, mismatch)
	case "TICK":
		ms, err := strconv.ParseInt(arg, 10, 64)
		if err != nil || ms < 1 || time.Duration(ms)*time.Millisecond > MaxDelay {
			fmt.Fprintf(c, "ERR bad interval %q\n", arg)
			return
		}
		s.tick(c, r, time.Duration(ms)*time.Millisecond)
	default:
		fmt.Fprintf(c, "ERR unknown command %q\n", cmd)
	}
}

// tick writes "<seq> <name>\n" to c every interval, seq counting from 1,
// until a write fails, the client closes its side or the server closes.
func (s *Server) tick(c net.Conn, r *bufio.Reader, every time.Duration) {
	gone := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, r)
		close(gone)
	}()
	t := time.NewTicker(every)
	defer t.Stop()
	for seq := 1; ; seq++ {
		select {
		case <-t.C:
		case <-gone:
			return
		case <-s.quit:
			return
		}
		if _, err := fmt.Fprintf(c, "%d %s\n", seq, s.cfg.Name); err != nil {
			return
		}
	}
}

func readLine(r *bufio.Reader) (string, error) {
	var b []byte
	for len(b) <= maxLine {
		c, err := r.ReadByte()
		if err != nil {
			return "", err
		}
		if c == '\n' {
			return string(b), nil
		}
		b = append(b, c)
	}
	return "", errors.New("testserver: command line too long")
}

// Fetch asks the stream server on c for n bytes and checks them against
// Pattern. It returns how many bytes came and the first mismatching offset
// (-1 when all match). c is closed.
func Fetch(ctx context.Context, c net.Conn, n int64) (got, mismatch int64, err error) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := fmt.Fprintf(c, "SEND %d\n", n); err != nil {
		return 0, -1, err
	}
	return VerifyPattern(c)
}

// Push sends n bytes of Pattern to the stream server on c and returns what
// the server counted and its first mismatching offset (-1 when all match).
// c is closed.
func Push(ctx context.Context, c net.Conn, n int64) (got, mismatch int64, err error) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := io.WriteString(c, "RECV\n"); err != nil {
		return 0, -1, err
	}
	if _, err := io.Copy(c, Pattern(n)); err != nil {
		return 0, -1, err
	}
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		return 0, -1, errors.New("testserver: Push needs a connection with CloseWrite")
	}
	if err := cw.CloseWrite(); err != nil {
		return 0, -1, err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return 0, -1, fmt.Errorf("testserver: reading the server's count: %w", err)
	}
	if _, err := fmt.Sscanf(line, "%d %d", &got, &mismatch); err != nil {
		return 0, -1, fmt.Errorf("testserver: bad reply %q", strings.TrimSpace(line))
	}
	return got, mismatch, nil
}

// EchoDelayed sends "delay <ms> <payload>" to the UDP echo server on c, which
// answers after delay, and returns the server's name from the reply. The
// timeout counts from the send and must cover the delay.
func EchoDelayed(c net.Conn, delay time.Duration, payload string, timeout time.Duration) (string, error) {
	return Echo(c, fmt.Sprintf("delay %d %s", delay.Milliseconds(), payload), timeout)
}

// Ticks is the client side of the stream server's "TICK <ms>" command.
type Ticks struct {
	c net.Conn
	r *bufio.Reader
}

// StartTicks asks the stream server on c to write a line every interval
// (whole milliseconds, at least 1) until the connection closes.
func StartTicks(c net.Conn, every time.Duration) (*Ticks, error) {
	if _, err := fmt.Fprintf(c, "TICK %d\n", every.Milliseconds()); err != nil {
		return nil, err
	}
	return &Ticks{c: c, r: bufio.NewReader(c)}, nil
}

// Next waits up to timeout for the next line and returns its sequence
// number (1 for the first) and the server's name.
func (t *Ticks) Next(timeout time.Duration) (seq int64, name string, err error) {
	if err := t.c.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return 0, "", err
	}
	line, err := t.r.ReadString('\n')
	if err != nil {
		return 0, "", err
	}
	if _, err := fmt.Sscanf(line, "%d %s", &seq, &name); err != nil {
		return 0, "", fmt.Errorf("testserver: bad tick %q", strings.TrimSpace(line))
	}
	return seq, name, nil
}

// Close closes the connection; the server stops ticking.
func (t *Ticks) Close() error { return t.c.Close() }

// Echo sends payload to the UDP echo server on c and returns the server's
// name from the reply, checking that the payload came back.
func Echo(c net.Conn, payload string, timeout time.Duration) (string, error) {
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return "", err
	}
	if _, err := io.WriteString(c, payload); err != nil {
		return "", err
	}
	buf := make([]byte, 65536)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	name, echoed, ok := strings.Cut(string(buf[:n]), " ")
	if !ok || echoed != payload {
		return "", fmt.Errorf("testserver: echo reply %q does not carry %q", buf[:n], payload)
	}
	return name, nil
}
