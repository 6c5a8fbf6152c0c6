package runner

import (
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/report"
	"github.com/xdproxy/xdproxy/control/config"
)

// TestBinaryConfigParses: the configs the benchmark writes for the xdproxy
// binary (poll mode, busy poll, the I/O floor) are ones that binary
// accepts, with the settings each mode asks for.
func TestBinaryConfigParses(t *testing.T) {
	floorPeer := netip.MustParseAddr("198.18.1.2")
	for _, c := range []struct {
		name string
		o    binaryOptions
		want config.Benchmark
		busy bool
	}{
		{name: "poll", o: binaryOptions{}},
		{name: "busy poll", o: binaryOptions{BusyPoll: true}, busy: true},
		{name: "I/O floor", o: binaryOptions{IOFloorPeer: floorPeer}, want: config.Benchmark{IOFloor: true, IOFloorPeer: floorPeer}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.o.Dir, c.o.ServicesFile, c.o.CPU = "/dev/shm/xdproxy-bench-x", "/dev/shm/xdproxy-bench-x/services.yaml", 1
			in := binaryConfig(c.o)
			got, err := config.ParseWith([]byte(in), config.Options{Host: &config.Host{CPUs: []int{0, 1}}})
			if err != nil {
				t.Fatalf("%v\n%s", err, in)
			}
			if !got.Masquerade.ReservePorts || got.Conntrack.MaxEntries != 1048576 || got.BusyPoll != c.busy || got.Benchmark != c.want {
				t.Errorf("parsed %+v", got)
			}
			// Nothing of the run outside its directory: no pins in
			// the machine's bpffs, no programs on its cgroups.
			for _, p := range []string{got.AdminSocket, got.StateDir, got.BPFFSDir} {
				if !strings.HasPrefix(p, c.o.Dir+"/") {
					t.Errorf("%s is outside %s", p, c.o.Dir)
				}
			}
			if got.LocalClients.Enabled {
				t.Error("localClients enabled: the benchmark would attach programs to the machine's root cgroup")
			}
			for i, in := range got.Interfaces {
				if len(in.CPUs) != 1 || in.CPUs[0] != 1 {
					t.Errorf("interfaces[%d] on CPUs %v, want [1]", i, in.CPUs)
				}
			}
		})
	}
}

// TestIOFloorPeer: the I/O floor forwards towards the sink, so that its
// frames arrive where the sink counts them.
func TestIOFloorPeer(t *testing.T) {
	s := Services(1, kernelrules.UDP)
	var isEndpoint bool
	for _, ep := range s.Endpoints {
		isEndpoint = isEndpoint || ep.Addr() == IOFloorPeer
	}
	if !isEndpoint {
		t.Errorf("I/O floor peer %v is not one of the sink's addresses %v", IOFloorPeer, s.Endpoints)
	}
}

func TestMissingFrontends(t *testing.T) {
	set := Services(3, kernelrules.UDP)
	reply := `[{"name":"bench/svc-0:p","proto":"UDP","frontends":["ClusterIP 198.19.0.1:80"],"backends":[]},
		{"name":"bench/svc-2:p","proto":"UDP","frontends":["ClusterIP 198.19.0.3:80"],"backends":[]}]`
	if got := missingFrontends([]byte(reply), set); len(got) != 1 || got[0] != "198.19.0.2:80" {
		t.Errorf("missing %v, want [198.19.0.2:80]", got)
	}
	if got := missingFrontends([]byte("oops"), set); len(got) != 1 || !strings.Contains(got[0], "not JSON") {
		t.Errorf("missing %v for a reply that is not JSON", got)
	}
}

func TestStatsSummary(t *testing.T) {
	b := []byte(`{"workers":{"RxFrames":10,"TxFrames":9,"Forwarded":10,"NewFlows":0,"ByReason":{"drop_tx_full":1}},
		"xdp":{"Redirected":10,"Passed":0},"conntrack":{"Live":3,"Inserts":3},"table":{"frontends":1}}`)
	want := "xdproxy counters: workers: RxFrames 10, TxFrames 9, Forwarded 10, ByReason {drop_tx_full 1}; xdp: Redirected 10; conntrack: Live 3, Inserts 3."
	if got := statsSummary(b); got != want {
		t.Errorf("summary\n %s\nwant\n %s", got, want)
	}
}

func TestTailBuffer(t *testing.T) {
	b := &tailBuffer{max: 8}
	b.Write([]byte("0123456"))
	b.Write([]byte("789ab"))
	if got := b.String(); got != "456789ab" {
		t.Errorf("tail %q", got)
	}
}

// TestBenchLinksNoEngine: the benchmark drives the xdproxy binary only; it
// links none of the packages that make up the engine or the agent.
func TestBenchLinksNoEngine(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/xdproxy/xdproxy/bench/cmd/xdproxy-bench").CombinedOutput()
	if err != nil {
		t.Skipf("go list: %v: %s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, engine := range []string{"/dataplane", "/control/", "/nat/conntrack", "/xdp/socklb"} {
			if strings.Contains(pkg, "github.com/xdproxy/xdproxy"+engine) {
				t.Errorf("xdproxy-bench links %s", pkg)
			}
		}
	}
}

// TestCheckMode: a binary that ignores the mode its config asks for is
// caught from its counters, served here by a fake admin socket.
func TestCheckMode(t *testing.T) {
	stats := ""
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/stats" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, stats)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	x := &xdproxyProc{admin: sock}
	translating := `{"workers":{"Forwarded":100,"NewFlows":10,"Wakeups":5},"conntrack":{"Inserts":10}}`
	floor := `{"workers":{"Forwarded":100,"NewFlows":0,"Wakeups":5},"conntrack":{"Inserts":0}}`
	spinning := `{"workers":{"Forwarded":100,"NewFlows":10,"Wakeups":0},"conntrack":{"Inserts":10}}`
	for _, c := range []struct {
		stats, path, err string
	}{
		{translating, report.PathXDProxy, ""},
		{spinning, report.PathBusyPoll, ""},
		{floor, report.PathIOFloor, ""},
		{translating, report.PathIOFloor, "does not run the I/O floor"},
		{floor, report.PathXDProxy, "runs the I/O floor without being asked"},
		{translating, report.PathBusyPoll, "woke from poll() 5 times"},
		{`{"workers":{}}`, report.PathXDProxy, "forwarded nothing"},
	} {
		stats = c.stats
		err := x.checkMode(c.path)
		if (c.err == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s with %s: %v, want %q", c.path, c.stats, err, c.err)
		}
	}
}

// TestRemoveDirs: a signal handler removes this process's directories, a
// new run those of processes that are gone, and nothing else.
func TestRemoveDirs(t *testing.T) {
	root := t.TempDir()
	mine := dirPrefix + strconv.Itoa(os.Getpid()) + "-1"
	gone := dirPrefix + "4194303-2" // above pid_max: no such process
	other := "xdproxy-state"
	for _, d := range []string{mine, gone, other} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	left := func() []string {
		var out []string
		es, _ := os.ReadDir(root)
		for _, e := range es {
			out = append(out, e.Name())
		}
		return out
	}
	removeDirs(root, true)
	if got := left(); !slices.Equal(got, []string{mine, other}) {
		t.Errorf("stale: left %v", got)
	}
	removeDirs(root, false)
	if got := left(); !slices.Equal(got, []string{other}) {
		t.Errorf("this process's: left %v", got)
	}
}
