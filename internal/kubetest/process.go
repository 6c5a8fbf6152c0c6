package kubetest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Process is a long-running child (etcd, kube-apiserver, kube-proxy) in its
// own process group, with stdout and stderr appended to a log file. The
// kernel kills it if this program dies without stopping it.
type Process struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{} // closed once the process has exited
	waitErr error         // valid after done is closed
}

// StartProcess starts path with args, appending its output to logPath.
func StartProcess(name, path string, args []string, logPath string) (*Process, error) {
	log, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	// Restarts append to the same log; the header tells the runs apart.
	fmt.Fprintf(log, "=== %s %s %s\n", time.Now().Format(time.RFC3339Nano), path, strings.Join(args, " "))

	cmd := exec.Command(path, args...)
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// A group of its own, so that stopping it reaches anything it forks.
		Setpgid: true,
		// Cleanups do not run when the test binary is killed or times out;
		// the kernel then kills the child instead.
		Pdeathsig: syscall.SIGKILL,
	}
	err = spawn(cmd)
	log.Close() // the child holds its own copy
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM to the process group, and SIGKILL if it is still there
// after grace. It returns once the process has been reaped. A nil Process
// is already stopped.
func (p *Process) Stop(grace time.Duration) {
	if p == nil || p.Exited() {
		return
	}
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
	}
	// Kill the group even after a clean exit of its leader: a child it forked
	// would otherwise outlive the test.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	<-p.done
}

// Err is the process's exit status once it has exited.
func (p *Process) Err() error {
	if !p.Exited() {
		return nil
	}
	return p.waitErr
}

// LogTail returns at most the last maxBytes of the process's log.
func (p *Process) LogTail(maxBytes int64) string {
	return fileTail(p.logPath, maxBytes)
}

func fileTail(path string, maxBytes int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return err.Error()
	}
	offset := max(info.Size()-maxBytes, 0)
	data, err := io.ReadAll(io.NewSectionReader(f, offset, info.Size()-offset))
	if err != nil {
		return err.Error()
	}
	if offset > 0 {
		// Start at a line boundary.
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			data = data[i+1:]
		}
		return fmt.Sprintf("(last %d bytes of %s)\n%s", len(data), path, data)
	}
	return string(data)
}

// The parent-death signal fires when the thread that forked the child exits,
// not when the process does. Go ends a thread when a goroutine that locked it
// returns without unlocking, which tests that enter network namespaces do, so a
// child forked from an arbitrary thread could be killed mid-test. All children
// are therefore forked from one locked thread that never exits.
var (
	spawnOnce     sync.Once
	spawnRequests chan spawnRequest
)

type spawnRequest struct {
	cmd    *exec.Cmd
	result chan error
}

func spawn(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnRequests = make(chan spawnRequest)
		go func() {
			runtime.LockOSThread() // never unlocked: the thread outlives every child
			for req := range spawnRequests {
				req.result <- req.cmd.Start()
			}
		}()
	})
	req := spawnRequest{cmd: cmd, result: make(chan error, 1)}
	spawnRequests <- req
	return <-req.result
}

// errExited is returned by readiness checks when the process ended first.
var errExited = errors.New("process exited")
