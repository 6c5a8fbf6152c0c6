package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/internal/testbed"
)

// outsideClient is a second address of the client, outside the cluster
// CIDR the restart test configures (198.18.0.0/25), so its service flows
// are masqueraded while those of the client's first address are not.
var outsideClient = netip.MustParseAddr("198.18.0.200")

// TestHitlessRestartAndUpgrade proves that restarting xdproxy breaks no
// connection: 50 TCP connections through a cluster IP (25 only DNATed,
// from inside the cluster CIDR, and 25 masqueraded, from outside it), each
// streaming checked bytes both ways, and a UDP flow of 200 numbered
// datagrams per second all run through a kill -9 and a restart of the same
// build, then through a SIGTERM and the start of a different build, on the
// same state directory and pinned programs. Every TCP connection must
// survive and every byte come back intact on both sides; the test reports,
// per restart, the longest time without progress (TCP: the worst
// connection; UDP) and the datagrams lost.
func TestHitlessRestartAndUpgrade(t *testing.T) {
	upgrade, upgradeVersion := upgradeBinary(t)
	t.Logf("the upgrade starts %s, version %s", upgrade, upgradeVersion)
	tb := newTopology(t, testbed.Options{})
	echo := startEchoServers(t, tb)
	if out, err := tb.Exec(tb.ClientNS(), "ip", "addr", "add", outsideClient.String()+"/24", "dev", tb.Client().Iface); err != nil {
		t.Fatalf("second client address: %v %s", err, out)
	}
	// The state directory as a node has it: a tmpfs with huge pages.
	a := newAgent(t, tb, serviceFile(echoSvc, dnsSvc), agentOptions{clusterCIDR: "198.18.0.0/25", mountState: true})
	checkHugePages(t, a)

	const conns = 50
	var streams []*tcpStream
	t.Cleanup(func() {
		for _, s := range streams {
			s.c.Close()
		}
	})
	vip := fmt.Sprintf("%s:%d", echoSvc.clusterIP, echoSvc.port)
	for i := range conns {
		src := tb.Client().Addr
		if i%2 == 1 {
			src = outsideClient
		}
		c, err := dialFrom(tb, src, vip, 10*time.Second)
		if err != nil {
			t.Fatalf("connection %d from %v: %v\n%s", i, src, err, a.dump())
		}
		streams = append(streams, newTCPStream(c))
	}
	// Both kinds of translation, as the connection table has them.
	var flows []flowReply
	if err := a.query("conntrack", &flows); err != nil {
		t.Fatal(err)
	}
	dnatOnly, masqueraded := 0, 0
	for _, f := range flows {
		if !strings.Contains(f.Original, "->"+vip) {
			continue
		}
		_, osrc, _ := strings.Cut(f.Original, " ")
		osrc, _, _ = strings.Cut(osrc, "->")
		_, tsrc, _ := strings.Cut(f.Translated, " ")
		tsrc, _, _ = strings.Cut(tsrc, "->")
		switch {
		case osrc == tsrc && strings.HasPrefix(osrc, tb.Client().Addr.String()+":"):
			dnatOnly++
		case strings.HasPrefix(osrc, outsideClient.String()+":") && strings.HasPrefix(tsrc, tb.NodeLANSide().Addr.String()+":"):
			masqueraded++
		}
	}
	if dnatOnly != conns/2 || masqueraded != conns/2 {
		t.Fatalf("%d DNAT-only and %d masqueraded flows to %s, want %d of each: %v", dnatOnly, masqueraded, vip, conns/2, flows)
	}

	uc, err := tb.Dial(context.Background(), tb.ClientNS(), "udp", fmt.Sprintf("%s:%d", dnsSvc.clusterIP, dnsSvc.port))
	if err != nil {
		t.Fatal(err)
	}
	udp := newUDPStream(uc, 5*time.Millisecond, 200*300)
	t.Cleanup(func() { uc.Close() })

	stop := make(chan struct{})
	stopOnce := sync.OnceFunc(func() { close(stop) })
	t.Cleanup(stopOnce)
	for _, s := range streams {
		s.run(stop)
	}
	udp.run(stop)

	// Worst gap over the connections, and the median, for one period.
	tcpGaps := func(now time.Time) (worst, median time.Duration) {
		var gs []time.Duration
		for _, s := range streams {
			gs = append(gs, s.prog.take(now))
		}
		slices.Sort(gs)
		return gs[len(gs)-1], gs[len(gs)/2]
	}
	// checkBroken fails the test at once when a stream broke.
	checkBroken := func(when string) {
		t.Helper()
		for i, s := range streams {
			if err := s.failed(); err != nil {
				t.Fatalf("%s: connection %d (%v) broke: %v\n%s", when, i, s.c.LocalAddr(), err, a.dump())
			}
		}
	}
	// waitProgress waits until every stream and the UDP flow progressed
	// after t0.
	waitProgress := func(when string, t0 time.Time) {
		t.Helper()
		waiting := 0
		if !waitUntil(20*time.Millisecond, 30*time.Second, func() bool {
			checkBroken(when)
			waiting = 0
			for _, s := range streams {
				if !s.prog.since(t0) {
					waiting++
				}
			}
			return waiting == 0 && udp.prog.since(t0)
		}) {
			t.Fatalf("%s: %d connections (and UDP: %v) made no progress for 30s\n%s", when, waiting, !udp.prog.since(t0), a.dump())
		}
	}

	waitProgress("before any restart", time.Now())
	time.Sleep(2 * time.Second)
	worst, median := tcpGaps(time.Now())
	t.Logf("steady state: longest TCP gap %v (median connection %v), UDP %v",
		worst.Round(time.Millisecond), median.Round(time.Millisecond), udp.prog.take(time.Now()).Round(time.Millisecond))

	type result struct {
		name                string
		stopped, restart    time.Duration
		tcpWorst, tcpMedian time.Duration
		udpGap              time.Duration
		udpFrom, udpTo      int64
		restoredFlows       int
	}
	var results []result
	phases := []struct {
		name  string
		stop  func()
		start func()
	}{
		{"kill -9, same build", a.kill9, a.start},
		{"SIGTERM, other build", a.stop, func() { a.startBuild(upgrade) }},
	}
	for _, ph := range phases {
		t0 := time.Now()
		tcpGaps(t0)
		udp.prog.take(t0)
		from := udp.sent.Load()
		ph.stop()
		stopped := time.Since(t0)
		ph.start()
		restart := time.Since(t0)
		restored := checkAdopted(t, a)
		waitProgress("after "+ph.name, time.Now())
		time.Sleep(time.Second)
		now := time.Now()
		r := result{name: ph.name, stopped: stopped, restart: restart, udpGap: udp.prog.take(now), udpFrom: from, udpTo: udp.sent.Load(), restoredFlows: restored}
		r.tcpWorst, r.tcpMedian = tcpGaps(now)
		results = append(results, r)
		if restored < conns+1 {
			t.Errorf("%s: the new process restored %d flows, want at least the %d connections and the UDP flow\n%s", ph.name, restored, conns, a.log)
		}
	}
	var v string
	if err := a.query("version", &v); err != nil || v != upgradeVersion {
		t.Errorf("after the upgrade the agent says it is version %q (%v), want the other build's %q", v, err, upgradeVersion)
	}

	// More traffic on the new build, then every byte is checked.
	time.Sleep(time.Second)
	stopOnce()
	broken := 0
	var sent int64
	for i, s := range streams {
		if err := s.finish(30 * time.Second); err != nil {
			broken++
			t.Errorf("connection %d (%v) broke: %v", i, s.c.LocalAddr(), err)
		}
		sent += s.sent.Load()
	}
	udp.finish()
	for _, r := range results {
		lost := udp.lost(r.udpFrom, r.udpTo)
		t.Logf("%s: old process gone after %v, new one serving after %v, %d flows restored; longest TCP gap %v (median connection %v); UDP gap %v, %d of %d datagrams lost",
			r.name, r.stopped.Round(time.Millisecond), r.restart.Round(time.Millisecond), r.restoredFlows, r.tcpWorst.Round(time.Millisecond),
			r.tcpMedian.Round(time.Millisecond), r.udpGap.Round(time.Millisecond), lost, r.udpTo-r.udpFrom)
	}
	if broken > 0 {
		t.Fatalf("%d of %d connections broke\n%s", broken, conns, a.dump())
	}
	if m := echo.mismatches(); len(m) > 0 {
		t.Errorf("the servers received bytes out of pattern: %v", m)
	}
	if got := echo.verified.Load(); got != sent {
		t.Errorf("clients sent %d bytes, the servers checked %d", sent, got)
	}
	if n := echo.resets.Load(); n != 0 {
		t.Errorf("%d connections were reset at the servers", n)
	}
	t.Logf("%d connections, %d bytes each way, all checked", conns, sent)
	// The flow kept its backend: a restored flow is the same flow.
	udp.mu.Lock()
	backends, nBackends := fmt.Sprint(udp.backends), len(udp.backends)
	udp.mu.Unlock()
	if nBackends != 1 {
		t.Errorf("the UDP flow's replies came from %s: one flow, one backend", backends)
	}
	if n := udp.refused.Load(); n > 0 {
		t.Errorf("the UDP client got %d ICMP errors: the kernel answered in xdproxy's place", n)
	}
	if n := udp.bad.Load(); n > 0 {
		t.Errorf("%d UDP replies carried no datagram we sent", n)
	}
	total := udp.sent.Load()
	t.Logf("UDP: %d datagrams, %d lost in all, replies %s", total, udp.lost(0, total), backends)
}

// restoredRE finds the connection table's restore in the agent's log.
var restoredRE = regexp.MustCompile(`restored (\d+) flows`)

// checkAdopted checks, in the log of the process just started, that it
// adopted the pinned programs and restored the connection table, and
// returns how many flows it restored.
func checkAdopted(t *testing.T, a *daemon) int {
	t.Helper()
	log := a.log.String()
	if !strings.Contains(log, "adopted=true") {
		t.Errorf("the new process did not adopt the pinned programs:\n%s", log)
	}
	m := restoredRE.FindStringSubmatch(log)
	if m == nil {
		t.Errorf("the new process did not restore the connection table:\n%s", log)
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	checkHugePages(t, a)
	return n
}

// checkHugePages checks, in the log of the process just started, that its
// connection table's state file is on a tmpfs (the one mount-state-dir
// made) and on huge pages, where the kernel has them.
func checkHugePages(t *testing.T, a *daemon) {
	t.Helper()
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled"); err != nil || strings.Contains(string(b), "[deny]") {
		return // no huge pages for a tmpfs from this kernel
	}
	if log := a.log.String(); !strings.Contains(log, "hugePages=true") || strings.Contains(log, "state file is not on a tmpfs") {
		t.Errorf("the connection table's state file is not on a tmpfs with huge pages:\n%s", log)
	}
}

// startBuild is daemon.start with another xdproxy binary: it starts it in
// the node namespace on the same config and waits until it serves a
// published table.
func (a *daemon) startBuild(binary string) {
	a.t.Helper()
	a.log = &logBuffer{}
	a.cmd = exec.Command(binary, "run", "--config", a.config)
	a.cmd.Stdout, a.cmd.Stderr = a.log, a.log
	if err := testbed.StartIn(a.ns, a.cmd); err != nil {
		a.t.Fatal(err)
	}
	a.exited = make(chan struct{})
	go func(c *exec.Cmd, ch chan struct{}) { a.exitErr = c.Wait(); close(ch) }(a.cmd, a.exited)
	a.waitPublished(binary)
}

// upgradeBuild is the other build the upgrade starts: the binary
// XDPROXY_BIN names (make test points it at make build's bin/xdproxy), or
// else one built once per run of the test binary with its own version
// stamp. The package's TestMain is shared, so the build happens at the
// first test that asks. The built file is deleted at once and run through
// a descriptor this process keeps open (/proc/PID/fd/N), so nothing is
// left behind however the run ends.
var upgradeBuild struct {
	once    sync.Once
	path    string
	version string
	keep    *os.File
	err     error
}

func upgradeBinary(t *testing.T) (path, version string) {
	t.Helper()
	needRoot(t)
	upgradeBuild.once.Do(func() {
		if p := os.Getenv("XDPROXY_BIN"); p != "" {
			if !filepath.IsAbs(p) {
				p = filepath.Join(moduleRoot(), p)
			}
			upgradeBuild.path = p
		} else {
			upgradeBuild.path, upgradeBuild.err = buildUpgrade()
			if upgradeBuild.err != nil {
				return
			}
		}
		out, err := exec.Command(upgradeBuild.path, "version").CombinedOutput()
		if err != nil {
			upgradeBuild.err = fmt.Errorf("%s version: %v: %s", upgradeBuild.path, err, out)
			return
		}
		upgradeBuild.version = strings.TrimPrefix(strings.TrimSpace(string(out)), "xdproxy ")
	})
	if upgradeBuild.err != nil {
		t.Fatalf("the build to upgrade to: %v", upgradeBuild.err)
	}
	return upgradeBuild.path, upgradeBuild.version
}

// buildUpgrade builds ./cmd/xdproxy (the test runs in its directory) with
// the version "upgrade-test".
func buildUpgrade() (string, error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("building the upgrade: %w", err)
	}
	dir, err := os.MkdirTemp("", "xdproxy-upgrade-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "xdproxy")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goTool, "build", "-ldflags", "-X main.version=upgrade-test", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %v: %s", err, out)
	}
	f, err := os.Open(bin)
	if err != nil {
		return "", err
	}
	upgradeBuild.keep = f
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd()), nil
}

// moduleRoot is the directory of go.mod above the test's directory.
func moduleRoot() string {
	dir, _ := os.Getwd()
	for d := dir; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
	}
	return dir
}
