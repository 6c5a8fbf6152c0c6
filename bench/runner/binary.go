package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/bench/topo"
)

// binaryOptions shape the config file of the xdproxy binary.
type binaryOptions struct {
	Dir          string // holds the services file, the admin socket and the state
	ServicesFile string
	CPU          int // the workers' CPU
	BusyPoll     bool
	// IOFloorPeer, when valid, turns the I/O floor on: every frame goes
	// untranslated to this address's next hop.
	IOFloorPeer netip.Addr
}

// AdminSocket is the admin socket of a config written for dir.
func adminSocket(dir string) string { return filepath.Join(dir, "admin.sock") }

// binaryConfig is the xdproxy config file of the benchmark: both node
// interfaces, one queue each, workers on the forwarding CPU, copy mode.
// Everything it keeps lives in o.Dir (bpffsDir too, which is not a bpf
// file system, so nothing is pinned and nothing outlives the process), and
// it leaves the machine's cgroups alone (localClients off).
func binaryConfig(o binaryOptions) string {
	iface := func(name string) string {
		return fmt.Sprintf(`  - name: %s
    queues: [0]
    cpus: [%d]
    xdpMode: native
    bindMode: copy
`, name, o.CPU)
	}
	extra := ""
	if o.BusyPoll {
		extra += "busyPoll: true\n"
	}
	if o.IOFloorPeer.IsValid() {
		extra += fmt.Sprintf("# Benchmarking only: forward every frame untranslated.\nbenchmark:\n  ioFloor: true\n  ioFloorPeer: %s\n", o.IOFloorPeer)
	}
	return fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: bench-node
interfaces:
%s%sservices:
  file: %s
clusterCIDR: %s
# The range of the earlier runs, inside the node's ephemeral ports:
# reserved for SNAT while xdproxy runs.
masquerade:
  portRange: 32768-60999
  reservePorts: true
conntrack:
  maxEntries: 1048576
metricsAddress: 127.0.0.1:10249
healthzAddress: 127.0.0.1:10256
adminSocket: %s
stateDir: %s
bpffsDir: %s
localClients:
  enabled: false
batchSize: 64
# Room for the largest service count the benchmark loads (100,000).
xdpTables:
  maxFrontends: 262144
  maxAddresses: 524288
%s`, iface(topo.NodeInIface), iface(topo.NodeOutIface), o.ServicesFile, topo.PodCIDR, adminSocket(o.Dir),
		filepath.Join(o.Dir, "state"), filepath.Join(o.Dir, "bpf"), extra)
}

// xdproxyProc is the running xdproxy binary of a variant.
type xdproxyProc struct {
	cmd    *exec.Cmd
	dir    string
	admin  string
	logs   *tailBuffer
	exited chan struct{} // closed when the process has exited
	err    error         // Wait's, once exited is closed
	health string        // /health when it was ready, if not healthy
}

// ReadyTimeout bounds the wait for the binary to publish the table.
const ReadyTimeout = 180 * time.Second

// startXDProxy runs the xdproxy binary in the node namespace with a config
// and a services file written for this variant, and waits until its admin
// socket shows the published table holding every frontend of set.
func startXDProxy(cfg *Config, t *topo.Topology, path string, set kernelrules.ServiceSet) (_ *xdproxyProc, err error) {
	// On a tmpfs: the connection table's state file is mapped memory.
	dir, err := os.MkdirTemp(shmDir, fmt.Sprintf("%s%d-", dirPrefix, os.Getpid()))
	if err != nil {
		return nil, err
	}
	x := &xdproxyProc{dir: dir, admin: adminSocket(dir), logs: &tailBuffer{max: 64 << 10}, exited: make(chan struct{})}
	defer func() {
		if err != nil {
			x.stop()
		}
	}()
	var svc bytes.Buffer
	if err := set.WriteManifests(&svc); err != nil {
		return nil, err
	}
	o := binaryOptions{Dir: dir, ServicesFile: filepath.Join(dir, "services.yaml"), CPU: cfg.Plan.ForwardCPU,
		BusyPoll: path == report.PathBusyPoll}
	if path == report.PathIOFloor {
		o.IOFloorPeer = IOFloorPeer
	}
	cfgFile := filepath.Join(dir, "xdproxy.yaml")
	if err := os.WriteFile(o.ServicesFile, svc.Bytes(), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(cfgFile, []byte(binaryConfig(o)), 0o644); err != nil {
		return nil, err
	}
	// The state file on a tmpfs with huge pages, as deploy/daemonset.yaml's
	// init container (xdproxy mount-state-dir) gives it. Mounted here, in
	// this process's mount namespace, and not by the binary measured, so
	// that any binary gets it: ip netns exec gives its command a mount
	// namespace of its own, and a mount made there would go with it.
	if err := mountStateDir(filepath.Join(dir, "state")); err != nil {
		return nil, err
	}
	x.cmd = exec.Command("ip", "netns", "exec", t.Node, "nice", "-n", strconv.Itoa(cfg.Nice), cfg.XDProxyBin, "run", "--config", cfgFile)
	x.cmd.Stdout, x.cmd.Stderr = x.logs, x.logs
	if err := x.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		x.err = x.cmd.Wait()
		close(x.exited)
	}()
	return x, x.waitReady(set, ReadyTimeout)
}

// Where the xdproxy binaries of a run keep their files:
// shmDir/dirPrefix<pid>-<random>.
const (
	shmDir    = "/dev/shm"
	dirPrefix = "xdproxy-bench-"
)

// RemoveDirs removes the directories of xdproxy binaries that this process
// started (all, for a signal handler), or, with stale, those of processes
// that no longer run (a killed benchmark's).
func RemoveDirs(stale bool) { removeDirs(shmDir, stale) }

func removeDirs(root string, stale bool) {
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), dirPrefix)
		if !ok {
			continue
		}
		pidStr, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidStr)
		if err != nil {
			continue
		}
		alive := syscall.Kill(pid, 0) == nil
		if stale && !alive || !stale && pid == os.Getpid() {
			removeDir(filepath.Join(root, e.Name()))
		}
	}
}

// IOFloorPeer is the address the I/O floor forwards every frame towards:
// the sink, whose next hop from the node is s0.
var IOFloorPeer = topo.SinkAddrs[0]

// pid is the process's (ip netns exec and nice exec into xdproxy).
func (x *xdproxyProc) pid() int { return x.cmd.Process.Pid }

// get asks the admin socket.
func (x *xdproxyProc) get(path string) ([]byte, error) {
	return adminGet(x.admin, path, 60*time.Second)
}

// adminGet sends GET path to the admin socket of a running xdproxy (HTTP
// over a unix socket, what `xdproxy admin` speaks) and returns the body; a
// status other than 200 is an error. The benchmark talks to the binary
// only through its files, signals and this socket, so it links none of
// xdproxy's packages.
func adminGet(socket, path string, timeout time.Duration) ([]byte, error) {
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://xdproxy" + path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return b, fmt.Errorf("GET %s: %s: %s", path, resp.Status, strings.TrimSpace(string(b)))
	}
	return b, nil
}

// waitReady polls the admin socket until the published table has as many
// frontends as set has services, then checks that every one of them is
// there, so that no trial starts against a half-programmed proxy. Log
// lines play no part.
func (x *xdproxyProc) waitReady(set kernelrules.ServiceSet, timeout time.Duration) error {
	frontends := -1
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		select {
		case <-x.exited:
			return false, fmt.Errorf("xdproxy exited (%v) before it published %d services: %s", x.err, set.Count, tail(x.logs.String(), 1500))
		default:
		}
		b, err := x.get("/stats")
		if err != nil {
			return false, nil
		}
		var st struct {
			Table struct {
				Frontends int `json:"frontends"`
			} `json:"table"`
		}
		if err := json.Unmarshal(b, &st); err != nil {
			return false, fmt.Errorf("xdproxy's /stats: %w", err)
		}
		frontends = st.Table.Frontends
		return frontends >= set.Count, nil
	})
	if wait.Interrupted(err) {
		return fmt.Errorf("xdproxy's table had %d of %d frontends after %v: %s", max(frontends, 0), set.Count, timeout, tail(x.logs.String(), 1500))
	}
	if err != nil {
		return err
	}
	b, err := x.get("/services")
	if err != nil {
		return err
	}
	if missing := missingFrontends(b, set); len(missing) > 0 {
		return fmt.Errorf("xdproxy published %d frontends but not %s", frontends, strings.Join(missing, ", "))
	}
	if b, err := x.get("/health"); err == nil {
		var h struct {
			Healthz struct {
				Healthy  bool     `json:"healthy"`
				Problems []string `json:"problems"`
			} `json:"healthz"`
		}
		if json.Unmarshal(b, &h) == nil && !h.Healthz.Healthy {
			x.health = "unhealthy: " + strings.Join(h.Healthz.Problems, "; ")
		}
	}
	return nil
}

// missingFrontends reads an admin /services reply and returns the
// frontends of set (VIP:port) it lacks, at most five.
func missingFrontends(services []byte, set kernelrules.ServiceSet) []string {
	var svcs []struct {
		Frontends []string `json:"frontends"`
	}
	if err := json.Unmarshal(services, &svcs); err != nil {
		return []string{"any (the reply is not JSON: " + err.Error() + ")"}
	}
	have := map[string]bool{}
	for _, s := range svcs {
		for _, f := range s.Frontends {
			// "<kind> <addr>:<port>"
			fs := strings.Fields(f)
			have[fs[len(fs)-1]] = true
		}
	}
	var missing []string
	for i := range set.Count {
		k := netip.AddrPortFrom(set.VIP(i), set.Port(i)).String()
		if !have[k] {
			missing = append(missing, k)
			if len(missing) == 5 {
				break
			}
		}
	}
	return missing
}

// profile takes a CPU profile of seconds through the admin socket.
func (x *xdproxyProc) profile(seconds int) ([]byte, error) {
	return x.get(fmt.Sprintf("/debug/pprof/profile?seconds=%d", seconds))
}

// stop reads the counters, stops the process (SIGTERM, then SIGKILL after
// ten seconds), removes its directory and returns a summary of the
// counters.
func (x *xdproxyProc) stop() string {
	summary := ""
	if x.cmd != nil && x.cmd.Process != nil {
		if b, err := x.get("/stats"); err == nil {
			summary = statsSummary(b)
		}
		_ = x.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-x.exited:
		case <-time.After(10 * time.Second):
			_ = x.cmd.Process.Kill()
			<-x.exited
		}
		x.cmd = nil
	}
	removeDir(x.dir)
	return summary
}

// mountStateDir mounts a tmpfs with huge pages at dir, with the options of
// xdproxy mount-state-dir (conntrack.StateMountOptions).
func mountStateDir(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	if err := syscall.Mount("xdproxy-bench-state", dir, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, "huge=within_size,mode=0700"); err != nil {
		return fmt.Errorf("mounting a tmpfs for the state file at %s: %w", dir, err)
	}
	return nil
}

// removeDir removes a variant's directory, unmounting its state
// directory's tmpfs first (see startXDProxy).
func removeDir(dir string) {
	_ = syscall.Unmount(filepath.Join(dir, "state"), syscall.MNT_DETACH)
	_ = os.RemoveAll(dir)
}

// statsSummary shortens an admin /stats reply to the counters that say
// where frames went.
func statsSummary(b []byte) string {
	var st map[string]map[string]any
	if err := json.Unmarshal(b, &st); err != nil {
		return ""
	}
	var parts []string
	for _, sec := range []struct {
		name string
		keys []string
	}{
		{"workers", []string{"RxFrames", "TxFrames", "Forwarded", "NewFlows", "Batches", "Wakeups", "ByReason"}},
		{"xdp", []string{"Redirected", "Passed", "NoSocket"}},
		{"conntrack", []string{"Live", "Inserts", "EvictedUnreplied", "EvictedExpired", "FullDrops"}},
	} {
		var kv []string
		for _, k := range sec.keys {
			switch v := st[sec.name][k].(type) {
			case float64:
				if v != 0 {
					kv = append(kv, fmt.Sprintf("%s %.0f", k, v))
				}
			case map[string]any:
				var rs []string
				for r, n := range v {
					rs = append(rs, fmt.Sprintf("%s %v", r, n))
				}
				sort.Strings(rs)
				if len(rs) > 0 {
					kv = append(kv, k+" {"+strings.Join(rs, ", ")+"}")
				}
			}
		}
		if len(kv) > 0 {
			parts = append(parts, sec.name+": "+strings.Join(kv, ", "))
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "xdproxy counters: " + strings.Join(parts, "; ") + "."
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// profileTrial runs one extra trial of cfg.ProfileTrial at rate while the
// running xdproxy binary profiles itself, writes the profile into the
// results directory and lists its hottest functions.
func (e *env) profileTrial(rate float64, tr Traffic) (report.Profile, error) {
	pr := report.Profile{File: profileName(e.feed.Kind, tr)}
	if e.xdproxy == nil {
		return pr, fmt.Errorf("no xdproxy process")
	}
	secs := max(1, int(e.cfg.ProfileTrial.Round(time.Second)/time.Second))
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := e.xdproxy.profile(secs)
		done <- result{b, err}
	}()
	// The profile starts once the request arrives; the trial outlasts it
	// on both ends.
	time.Sleep(100 * time.Millisecond)
	if _, err := e.trial(rate, time.Duration(secs)*time.Second+400*time.Millisecond, tr); err != nil {
		<-done
		return pr, err
	}
	res := <-done
	if res.err != nil {
		return pr, fmt.Errorf("profile: %w", res.err)
	}
	file := filepath.Join(e.cfg.OutDir, pr.File)
	if err := os.WriteFile(file, res.b, 0o644); err != nil {
		return pr, err
	}
	top, err := exec.Command("go", "tool", "pprof", "-top", "-nodecount=25", e.cfg.XDProxyBin, file).CombinedOutput()
	if err != nil {
		pr.Top = fmt.Sprintf("go tool pprof failed (%v): %s", err, top)
	} else {
		pr.Top = string(top)
	}
	return pr, nil
}

// checkMode makes sure, from the counters after some traffic, that the
// binary runs in the mode path asks for: translating (new flows tracked),
// busy polling (no poll() wake-ups), or the I/O floor (frames forwarded,
// nothing tracked). A binary that ignored its config would otherwise be
// measured under the wrong name.
func (x *xdproxyProc) checkMode(path string) error {
	b, err := x.get("/stats")
	if err != nil {
		return err
	}
	var st struct {
		Workers struct {
			Forwarded, NewFlows, Wakeups, Batches uint64
		} `json:"workers"`
		Conntrack struct {
			Inserts uint64
		} `json:"conntrack"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("xdproxy's /stats: %w", err)
	}
	w := st.Workers
	switch {
	case w.Forwarded == 0:
		return errors.New("xdproxy forwarded nothing")
	case path == report.PathIOFloor && (w.NewFlows > 0 || st.Conntrack.Inserts > 0):
		return fmt.Errorf("xdproxy tracked %d new flows with benchmark.ioFloor set: the binary does not run the I/O floor", w.NewFlows)
	case path != report.PathIOFloor && w.NewFlows == 0:
		return errors.New("xdproxy forwarded frames without tracking a flow: it runs the I/O floor without being asked to")
	case path == report.PathBusyPoll && w.Wakeups*100 > w.Batches:
		// A busy-polling worker sleeps only when its queue was quiet for
		// IdleWait: between trials, not within one.
		return fmt.Errorf("xdproxy's workers woke from poll() %d times in %d batches with busyPoll set", w.Wakeups, w.Batches)
	}
	return nil
}

// workerThreads returns the thread IDs of the workers on cpu, from the
// admin socket's /workers.
func (x *xdproxyProc) workerThreads(cpu int) ([]int, error) {
	b, err := x.get("/workers")
	if err != nil {
		return nil, err
	}
	var ws []struct {
		Interface string `json:"interface"`
		CPU       int    `json:"cpu"`
		TID       int    `json:"tid"`
	}
	if err := json.Unmarshal(b, &ws); err != nil {
		return nil, fmt.Errorf("xdproxy's /workers: %w", err)
	}
	var tids []int
	for _, w := range ws {
		if w.CPU == cpu && w.TID > 0 {
			tids = append(tids, w.TID)
		}
	}
	if len(tids) == 0 {
		return nil, fmt.Errorf("xdproxy's /workers lists no worker on CPU %d: %s", cpu, b)
	}
	return tids, nil
}
