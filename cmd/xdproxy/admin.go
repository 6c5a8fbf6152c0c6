package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/xdproxy/xdproxy/control/config"
	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/nat/conntrack"
)

// adminServer answers `xdproxy admin` over a unix socket with JSON.
type adminServer struct {
	engine *dataplane.Engine
	srv    *http.Server
	ln     net.Listener
}

func startAdmin(path string, e *dataplane.Engine) (*adminServer, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	_ = os.Remove(path) // a socket left by a killed agent
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	_ = os.Chmod(path, 0o600)
	a := &adminServer{engine: e, ln: ln}
	mux := http.NewServeMux()
	mux.HandleFunc("/stats", a.stats)
	mux.HandleFunc("/workers", a.workers)
	mux.HandleFunc("/services", a.services)
	mux.HandleFunc("/conntrack", a.conntrack)
	a.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = a.srv.Serve(ln) }()
	return a, nil
}

func (a *adminServer) close() { _ = a.srv.Close() }

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
	Table     struct {
		Generation uint64 `json:"generation"`
		Version    string `json:"version"`
		Frontends  int    `json:"frontends"`
	} `json:"table"`
}

func (a *adminServer) stats(w http.ResponseWriter, _ *http.Request) {
	var r statsReply
	for _, wk := range a.engine.Workers() {
		r.Workers.Add(wk.Counters.Snapshot())
	}
	if c, err := a.engine.XDPCounters(); err == nil {
		r.XDP = c
	}
	r.Conntrack = a.engine.Conntrack().Stats()
	t := a.engine.Services().Load()
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
	for _, wk := range a.engine.Workers() {
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
	t := a.engine.Services().Load()
	var out []serviceReply
	for _, p := range t.Ports() {
		r := serviceReply{Name: p.Name.String(), Proto: p.Proto.String(), Backends: []string{}}
		for fam := range p.Cluster {
			for _, b := range p.Cluster[fam].Backends {
				r.Backends = append(r.Backends, fmt.Sprintf("%v:%d", b.Addr, b.Port))
			}
		}
		out = append(out, r)
	}
	for _, k := range t.FrontendKeys() {
		if fe := t.Lookup(k.Proto, k.Addr, k.Port); fe != nil {
			for i := range out {
				if out[i].Name == fe.Port.Name.String() && out[i].Proto == k.Proto.String() {
					out[i].Frontends = append(out[i].Frontends, fmt.Sprintf("%s %v:%d", fe.Kind, k.Addr, k.Port))
				}
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
	for f := range a.engine.Conntrack().All(now) {
		out = append(out, flowReply{Original: f.Orig.String(), Translated: f.Translated.String(), State: f.State.String()})
		if len(out) >= 10000 {
			break
		}
	}
	writeJSON(w, out)
}

func adminCmd(args []string) error {
	fs := flag.NewFlagSet("admin", flag.ExitOnError)
	sock := fs.String("socket", config.DefaultAdminSocket, "admin socket of the running agent")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		return errors.New("admin: name one of stats, services, conntrack, workers")
	}
	what := fs.Arg(0)
	switch what {
	case "stats", "services", "conntrack", "workers":
	default:
		return fmt.Errorf("admin: unknown command %q", what)
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", *sock)
		}}}
	resp, err := client.Get("http://xdproxy/" + what)
	if err != nil {
		return fmt.Errorf("admin: is xdproxy running? %w", err)
	}
	defer resp.Body.Close()
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}
