package kubeproxy

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// process is a long-running child (etcd, kube-apiserver, kube-proxy) in its
// own process group, its output in a log file.
type process struct {
	name, log string
	cmd       *exec.Cmd
	done      chan struct{}
	err       error // after done
}

// pinned prefixes argv with taskset so that every thread of the program
// runs on cpu; a negative cpu leaves it unpinned.
func pinned(cpu int, argv ...string) []string {
	if cpu < 0 {
		return argv
	}
	return append([]string{"taskset", "-c", strconv.Itoa(cpu)}, argv...)
}

func startProcess(name, log string, argv ...string) (*process, error) {
	f, err := os.Create(log)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the child has its own copy
	fmt.Fprintf(f, "=== %s\n", strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	// Its own group, so that stopping it reaches what it forks; killed by
	// the kernel if the benchmark dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := spawn(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, log: log, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the group, SIGKILL after grace, and reaps it.
func (p *process) stop(grace time.Duration) {
	if p == nil || p.exited() {
		return
	}
	pg := p.cmd.Process.Pid
	_ = syscall.Kill(-pg, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
	}
	_ = syscall.Kill(-pg, syscall.SIGKILL)
	<-p.done
}

// tail is the end of the process's log.
func (p *process) tail(n int64) string {
	f, err := os.Open(p.log)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err.Error()
	}
	off := max(st.Size()-n, 0)
	b, _ := io.ReadAll(io.NewSectionReader(f, off, st.Size()-off))
	return strings.TrimSpace(string(b))
}

// The parent-death signal fires when the forking thread ends, and the
// benchmark's goroutines that enter namespaces may end theirs; so every
// child is forked from one locked thread that lives as long as the
// program.
var (
	spawnOnce sync.Once
	spawnReq  chan spawnCall
)

type spawnCall struct {
	cmd *exec.Cmd
	err chan error
}

func spawn(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnReq = make(chan spawnCall)
		go func() {
			runtime.LockOSThread()
			for c := range spawnReq {
				c.err <- c.cmd.Start()
			}
		}()
	})
	c := spawnCall{cmd, make(chan error, 1)}
	spawnReq <- c
	return <-c.err
}
