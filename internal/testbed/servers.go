package testbed

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// TestServerPackage is the import path of the backend server command.
const TestServerPackage = "github.com/xdproxy/xdproxy/internal/testbed/cmd/xdproxy-testserver"

// Ports the backend servers listen on.
const (
	HTTPPort   = 80
	UDPPort    = 53
	StreamPort = 5001
)

// builtBinary is the server binary, built once per process and shared by
// the testbeds that use it; the last one to let go removes it.
type builtBinary struct {
	path string
	dir  string
	refs int
}

var (
	binMu  sync.Mutex
	binCur *builtBinary
)

func acquireBinary() (*builtBinary, error) {
	binMu.Lock()
	defer binMu.Unlock()
	if binCur != nil {
		binCur.refs++
		return binCur, nil
	}
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-server-", Prefix, os.Getpid()))
	if err != nil {
		return nil, err
	}
	path, err := BuildTestServer(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	binCur = &builtBinary{path: path, dir: dir, refs: 1}
	return binCur, nil
}

func (b *builtBinary) release() {
	binMu.Lock()
	defer binMu.Unlock()
	b.refs--
	if b.refs == 0 {
		os.RemoveAll(b.dir)
		if binCur == b {
			binCur = nil
		}
	}
}

// BuildTestServer builds the backend server into dir and returns its path.
// It runs "go build", so the working directory must be inside the xdproxy
// module (tests run in their package's folder, which is).
func BuildTestServer(dir string) (string, error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	out := filepath.Join(dir, "xdproxy-testserver")
	cmd := exec.Command(goTool, "build", "-o", out, TestServerPackage)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("testbed: go build %s: %w: %s", TestServerPackage, err, bytes.TrimSpace(msg))
	}
	return out, nil
}

type server struct {
	cmd    *exec.Cmd
	done   chan struct{}
	stderr bytes.Buffer
}

func (s *server) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(2 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// StartServers starts the backend server in every backend namespace: HTTP
// on :80 and UDP echo on :53 answering BackendName(i), and the stream
// server on :5001 (see package testserver). It returns when all of them
// listen; Close stops them. The binary is built once per process.
func (tb *Testbed) StartServers() error { return tb.StartServersWith("") }

// StartServersWith is StartServers with a prebuilt server binary ("" builds
// one).
func (tb *Testbed) StartServersWith(binary string) error {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.closed {
		return errors.New("testbed: closed")
	}
	if len(tb.servers) > 0 {
		return errors.New("testbed: servers already started")
	}
	if binary == "" {
		if tb.serverBin == nil {
			b, err := acquireBinary()
			if err != nil {
				return err
			}
			tb.serverBin = b
		}
		binary = tb.serverBin.path
	}
	for i, b := range tb.backends {
		s, err := tb.startServer(b.NS, binary, BackendName(i))
		if err != nil {
			for _, s := range tb.servers {
				s.stop()
			}
			tb.servers = nil
			return err
		}
		tb.servers = append(tb.servers, s)
	}
	return nil
}

func (tb *Testbed) startServer(ns, binary, name string) (*server, error) {
	s := &server{done: make(chan struct{})}
	s.cmd = tb.Command(ns, binary, "-name", name,
		"-http", fmt.Sprintf(":%d", HTTPPort),
		"-udp", fmt.Sprintf(":%d", UDPPort),
		"-tcp", fmt.Sprintf(":%d", StreamPort))
	s.cmd.Stderr = &s.stderr
	stdout, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("testbed: start server in %s: %w", ns, err)
	}
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("unexpected first line %q", line)
		}
		ready <- err
		// Drain so a chatty server never blocks on a full pipe.
		_, _ = bufio.NewReader(stdout).WriteTo(discard{})
	}()
	go func() {
		_ = s.cmd.Wait()
		close(s.done)
	}()
	select {
	case err := <-ready:
		if err == nil {
			return s, nil
		}
		s.stop()
		return nil, fmt.Errorf("testbed: server in %s: %v: %s", ns, err, bytes.TrimSpace(s.stderr.Bytes()))
	case <-time.After(30 * time.Second):
		s.stop()
		return nil, fmt.Errorf("testbed: server in %s not ready after 30s: %s", ns, bytes.TrimSpace(s.stderr.Bytes()))
	}
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }
