package testbed

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed/testserver"
)

// Ports the backend servers listen on.
const (
	HTTPPort   = 80
	UDPPort    = 53
	StreamPort = 5001
)

// serverReadyTimeout bounds the wait for a server's first line. A program
// that does not call ServeIfRequested usually gives itself away at once
// (its flag parsing refuses the server's flags), so this matters only for
// one that ignores them.
var serverReadyTimeout = 30 * time.Second

// serverSpec is one server process to start.
type serverSpec struct {
	ns     string
	name   string
	cgroup string // cgroup2 directory to start it in; "" leaves it in ours
}

type server struct {
	spec   serverSpec
	cmd    *exec.Cmd
	done   chan struct{} // closed once the process has been waited for
	ready  chan error    // the first line's verdict
	stderr tailBuffer
}

// startServers starts one server process per spec, all at once, and waits
// until every one listens. binary "" runs this program again (see
// ServeIfRequested); otherwise binary must run testserver.Main, as
// xdproxy-testserver does. On failure it stops the ones it started.
func startServers(binary string, specs []serverSpec) ([]*server, error) {
	if err := startedAsServer(); err != nil {
		return nil, err
	}
	var servers []*server
	var errs []error
	for _, spec := range specs {
		s, err := startServer(binary, spec)
		if err != nil {
			errs = append(errs, err)
			break
		}
		servers = append(servers, s)
	}
	if len(errs) == 0 {
		deadline := time.Now().Add(serverReadyTimeout)
		for _, s := range servers {
			if err := s.waitReady(binary, deadline); err != nil {
				errs = append(errs, err)
				break
			}
		}
	}
	if len(errs) > 0 {
		stopServers(servers)
		return nil, errors.Join(errs...)
	}
	return servers, nil
}

func startServer(binary string, spec serverSpec) (*server, error) {
	path := binary
	if path == "" {
		// The running program's own file, even if it was replaced or
		// deleted since it started.
		path = "/proc/self/exe"
	}
	s := &server{spec: spec, done: make(chan struct{}), ready: make(chan error, 1)}
	s.cmd = exec.Command(path, "-name", spec.name,
		"-http", fmt.Sprintf(":%d", HTTPPort),
		"-udp", fmt.Sprintf(":%d", UDPPort),
		"-tcp", fmt.Sprintf(":%d", StreamPort))
	if binary == "" {
		s.cmd.Args[0] = os.Args[0]
	}
	s.cmd.Env = append(os.Environ(), serveEnv+"=1")
	s.cmd.Stderr = &s.stderr
	// A child of the server holding its stderr must not stall Wait.
	s.cmd.WaitDelay = time.Second
	// Our own pipe, not StdoutPipe: Wait closes StdoutPipe's read end
	// as soon as the process exits, so a server that printed why it
	// failed and exited at once could lose that line to the race.
	stdout, stdoutWriter, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	s.cmd.Stdout = stdoutWriter
	if spec.cgroup != "" {
		err = startInCgroup(spec.ns, spec.cgroup, s.cmd)
	} else {
		err = StartIn(spec.ns, s.cmd)
	}
	stdoutWriter.Close() // the child has its own copy now
	if err != nil {
		stdout.Close()
		return nil, fmt.Errorf("testbed: start server %s in %s: %w", spec.name, spec.ns, err)
	}
	go func() {
		defer stdout.Close()
		r := bufio.NewReader(stdout)
		line, err := r.ReadString('\n')
		switch {
		case err != nil && line == "":
			s.ready <- fmt.Errorf("exited before saying it was ready (%w)", ErrNoServeHook)
		case strings.TrimSuffix(line, "\n") == testserver.ReadyLine:
			s.ready <- nil
		case strings.HasPrefix(line, testserver.FailedLine):
			s.ready <- errors.New(strings.TrimSpace(line))
		default:
			s.ready <- fmt.Errorf("printed %q instead of %q (%w)", strings.TrimSpace(line), testserver.ReadyLine, ErrNoServeHook)
		}
		// Drain, so a chatty process never blocks on a full pipe.
		_, _ = r.WriteTo(io.Discard)
	}()
	go func() {
		_ = s.cmd.Wait()
		close(s.done)
	}()
	return s, nil
}

func (s *server) waitReady(binary string, deadline time.Time) error {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	var err error
	select {
	case err = <-s.ready:
	case <-timer.C:
		err = fmt.Errorf("not ready after %v (%w)", serverReadyTimeout, ErrNoServeHook)
	}
	if err == nil {
		return nil
	}
	if binary == "" {
		binary = os.Args[0]
	}
	s.stop()
	msg := fmt.Sprintf("testbed: server %s (%s) in %s: %v", s.spec.name, binary, s.spec.ns, err)
	if tail := bytes.TrimSpace(s.stderr.Bytes()); len(tail) > 0 {
		msg += "; its stderr: " + string(tail)
	}
	return &serverError{msg: msg, err: err}
}

// serverError keeps ErrNoServeHook visible to errors.Is.
type serverError struct {
	msg string
	err error
}

func (e *serverError) Error() string { return e.msg }
func (e *serverError) Unwrap() error { return e.err }

// stop ends the process: SIGTERM, and SIGKILL if it is still there after
// two seconds.
func (s *server) stop() { stopServers([]*server{s}) }

// stopServers stops every server, all at once.
func stopServers(servers []*server) {
	for _, s := range servers {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
	}
	deadline := time.After(2 * time.Second)
	for _, s := range servers {
		select {
		case <-s.done:
			continue
		case <-deadline:
		}
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// tailBuffer keeps the last 4 KiB written to it, for error messages.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

const tailSize = 4 << 10

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > tailSize {
		b.buf = append(b.buf[:0], b.buf[len(b.buf)-tailSize:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.buf)
}

// StartServers starts the backend server in every backend namespace: HTTP
// on :80 and UDP echo on :53 answering BackendName(i), and the stream
// server on :5001 (see package testserver). It returns when all of them
// listen; Close stops them. The servers are this program run again (see
// ServeIfRequested, which the program must call first).
func (tb *Testbed) StartServers() error {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.closed {
		return errors.New("testbed: closed")
	}
	if len(tb.servers) > 0 {
		return errors.New("testbed: servers already started")
	}
	var specs []serverSpec
	for i, b := range tb.backends {
		specs = append(specs, serverSpec{ns: b.NS, name: BackendName(i)})
	}
	servers, err := startServers("", specs)
	if err != nil {
		return err
	}
	tb.servers = servers
	return nil
}
