package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// adminServer answers `xdproxy admin` over a unix socket with JSON.
type adminServer struct {
	a   *agent
	srv *http.Server
	ln  net.Listener
}

func startAdmin(path string, ag *agent) (*adminServer, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	_ = os.Remove(path) // a socket left by a killed agent
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	_ = os.Chmod(path, 0o600)
	a := &adminServer{a: ag, ln: ln}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", a.stats)
	mux.HandleFunc("GET /workers", a.workers)
	mux.HandleFunc("GET /services", a.services)
	mux.HandleFunc("GET /conntrack", a.conntrack)
	mux.HandleFunc("GET /interfaces", a.interfaces)
	mux.HandleFunc("GET /health", a.health)
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, ag.version) })
	mux.HandleFunc("POST /channels", a.channels)
	// A testing aid: publishes made to fail (faultyPublisher).
	mux.HandleFunc("GET /debug/faults", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, ag.pub.faults.state()) })
	mux.HandleFunc("POST /debug/faults", a.armFaults)
	// Go's profiler, for `go tool pprof` and the benchmark, only on the
	// admin socket (root's).
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	a.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = a.srv.Serve(ln) }()
	return a, nil
}

func (a *adminServer) close() {
	_ = a.srv.Close()
	_ = os.Remove(a.ln.Addr().String())
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

type statsReply struct {
	Workers   dataplane.Snapshot `json:"workers"`
	XDP       any                `json:"xdp"`
	Conntrack conntrack.Stats    `json:"conntrack"`
	SYNGuard  bool               `json:"synGuard"`
	// LocalClients: the socket programs' counters, when they run.
	LocalClients *socklb.Counters `json:"localClients,omitempty"`
	Table        struct {
		Generation uint64 `json:"generation"`
		Version    string `json:"version"`
		Frontends  int    `json:"frontends"`
	} `json:"table"`
}

func (a *adminServer) stats(w http.ResponseWriter, _ *http.Request) {
	var r statsReply
	for _, wk := range a.a.engine.Workers() {
		r.Workers.Add(wk.Counters.Snapshot())
	}
	if c, err := a.a.engine.XDPCounters(); err == nil {
		r.XDP = c
	}
	r.Conntrack = a.a.engine.Conntrack().Stats()
	r.SYNGuard = a.a.engine.SYNGuardOn()
	if c, ok, _ := a.a.engine.LocalClientCounters(); ok {
		r.LocalClients = &c
	}
	t := a.a.engine.Services().Load()
	r.Table.Generation, r.Table.Version, r.Table.Frontends = t.Generation(), t.Version(), t.Frontends()
	writeJSON(w, r)
}

type workerReply struct {
	Interface string             `json:"interface"`
	Queue     int                `json:"queue"`
	CPU       int                `json:"cpu"`
	TID       int                `json:"tid"`
	Counters  dataplane.Snapshot `json:"counters"`
}

func (a *adminServer) workers(w http.ResponseWriter, _ *http.Request) {
	var out []workerReply
	for _, wk := range a.a.engine.Workers() {
		out = append(out, workerReply{Interface: wk.Port().Name, Queue: wk.Port().Queue, CPU: wk.CPU(), TID: wk.TID(), Counters: wk.Counters.Snapshot()})
	}
	writeJSON(w, out)
}

type serviceReply struct {
	Name      string   `json:"name"`
	Proto     string   `json:"proto"`
	Frontends []string `json:"frontends,omitempty"`
	Backends  []string `json:"backends"`
}

func (a *adminServer) services(w http.ResponseWriter, _ *http.Request) {
	t := a.a.engine.Services().Load()
	type nameProto struct{ name, proto string }
	var out []serviceReply
	// Frontends find their port's reply through this index: a scan of
	// every reply per frontend took minutes at 100,000 services.
	index := make(map[nameProto][]int, len(t.Ports()))
	for _, p := range t.Ports() {
		r := serviceReply{Name: p.Name.String(), Proto: p.Proto.String(), Backends: []string{}}
		for fam := range p.Cluster {
			for _, b := range p.Cluster[fam].Backends {
				r.Backends = append(r.Backends, fmt.Sprintf("%v:%d", b.Addr, b.Port))
			}
		}
		k := nameProto{r.Name, r.Proto}
		index[k] = append(index[k], len(out))
		out = append(out, r)
	}
	for _, k := range t.FrontendKeys() {
		if fe := t.Lookup(k.Proto, k.Addr, k.Port); fe != nil {
			for _, i := range index[nameProto{fe.Port.Name.String(), k.Proto.String()}] {
				out[i].Frontends = append(out[i].Frontends, fmt.Sprintf("%s %v:%d", fe.Kind, k.Addr, k.Port))
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	writeJSON(w, out)
}

type flowReply struct {
	Original   string `json:"original"`
	Translated string `json:"translated"`
	State      string `json:"state"`
}

func (a *adminServer) conntrack(w http.ResponseWriter, _ *http.Request) {
	out := []flowReply{}
	now := dataplane.MonotonicNow()
	for f := range a.a.engine.Conntrack().All(now) {
		out = append(out, flowReply{Original: f.Orig.String(), Translated: f.Translated.String(), State: f.State.String()})
		if len(out) >= 10000 {
			break
		}
	}
	writeJSON(w, out)
}

func (a *adminServer) interfaces(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, a.a.engine.Interfaces())
}

type healthReply struct {
	Healthz health.Status `json:"healthz"`
	Livez   health.Status `json:"livez"`
}

func (a *adminServer) health(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, healthReply{Healthz: a.a.proxy.Healthz(), Livez: a.a.proxy.Livez()})
}

// channels sets the number of queues of a served interface:
// POST /channels?interface=eth0&queues=2. Linux refuses ethtool -L while
// AF_XDP sockets hold the queues that would go; this lets go of them
// first.
func (a *adminServer) channels(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("interface")
	n, err := strconv.Atoi(r.URL.Query().Get("queues"))
	if err != nil || name == "" {
		http.Error(w, "want ?interface=NAME&queues=N", http.StatusBadRequest)
		return
	}
	if err := a.a.engine.SetChannels(name, n); err != nil {
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	writeJSON(w, a.a.engine.Interfaces())
}

// armFaults makes the next N publishes of a service table fail with
// ErrInjected: POST /debug/faults?publish=N (0 disarms). The source sees a
// failed publish and retries it, as it would if the dataplane could not be
// programmed. It answers with what is left, as GET /debug/faults does.
func (a *adminServer) armFaults(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(r.URL.Query().Get("publish"))
	if err != nil || n < 0 {
		http.Error(w, "want ?publish=N, N >= 0: the number of publishes to fail", http.StatusBadRequest)
		return
	}
	st := a.a.pub.faults.arm(n)
	if n > 0 {
		a.a.log.Warn("fault injection: the next publishes will fail", "publishes", n)
	} else {
		a.a.log.Info("fault injection disarmed")
	}
	writeJSON(w, st)
}

// AdminRequest sends one request to the admin socket of a running agent
// and returns the body; a status other than 200 is an error carrying the
// body.
func AdminRequest(socket, method, path string) ([]byte, error) {
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}
	req, err := http.NewRequest(method, "http://xdproxy"+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("is xdproxy running? %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return b, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(b)))
	}
	return b, nil
}
