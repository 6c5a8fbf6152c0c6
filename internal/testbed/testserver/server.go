package testserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
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
}

// Listen opens every configured listener and starts serving. The listeners
// are open when it returns, so a caller can announce readiness.
func Listen(cfg Config) (*Server, error) {
	s := &Server{cfg: cfg}
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
// Connections in progress are cut.
func (s *Server) Close() error {
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
	s.wg.Wait()
	return errors.Join(errs...)
}

func (s *Server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Backend", s.cfg.Name)
		_, _ = io.WriteString(w, s.cfg.Name)
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
		_, _ = s.udp.WriteTo(out, from)
	}
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
		s.wg.Add(1)
		go func() { defer s.wg.Done(); serveStream(c) }()
	}
}

// maxLine bounds the command line of the stream protocol.
const maxLine = 64

func serveStream(c net.Conn) {
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
	default:
		fmt.Fprintf(c, "ERR unknown command %q\n", cmd)
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
