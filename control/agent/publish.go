package agent

import (
	"bytes"
	"encoding/gob"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/xdp"
)

// lastModelFile, in the state directory, holds the last model published,
// so that the next process serves it while its source syncs.
const lastModelFile = "model.gob"

// tablePublisher takes the compiled tables: the engine, through faults.
type tablePublisher interface {
	Publish(*service.Table) error
}

// publisher turns the source's models into tables for the engine.
type publisher struct {
	a    *agent
	opts service.CompileOptions
	node service.Node
	// to is where tables go: faults, in front of the engine.
	to     tablePublisher
	faults *faultyPublisher

	mu       sync.Mutex // serialises publish
	problems map[string]bool
	rejected map[service.PortName]string // why a port is left out; logged once

	rejectedTotal prometheus.Counter
	saveCh        chan *service.Model
	saveDone      chan struct{}
}

func newPublisher(a *agent, reg prometheus.Registerer) (*publisher, error) {
	p := &publisher{
		a:        a,
		opts:     service.CompileOptions{ClusterCIDRs: a.cfg.ClusterCIDRs, MasqueradeAll: a.cfg.Masquerade.All},
		node:     nodeInfo(a),
		problems: map[string]bool{}, rejected: map[service.PortName]string{},
		rejectedTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "xdproxy_service_ports_rejected_total",
			Help: "Service ports left out of a published table because the XDP tables could not hold them.",
		}),
		saveCh: make(chan *service.Model, 1), saveDone: make(chan struct{}),
		faults: &faultyPublisher{next: a.engine},
	}
	p.to = p.faults
	if err := reg.Register(p.rejectedTotal); err != nil {
		return nil, err
	}
	go p.saver()
	return p, nil
}

// nodeInfo is the node as the service table sees it: NodePorts listen on
// the served interfaces' addresses inside nodePortAddresses.
func nodeInfo(a *agent) service.Node {
	n := service.Node{Name: a.cfg.NodeName, Zone: a.cfg.NodeZone}
	for _, ad := range a.engine.NodeAddresses() {
		ok := len(a.cfg.NodePortAddresses) == 0
		for _, p := range a.cfg.NodePortAddresses {
			ok = ok || p.Contains(ad.Netip())
		}
		if ok {
			n.Addresses = append(n.Addresses, ad)
		}
	}
	return n
}

// publish compiles m and hands the table to the engine. A port the XDP
// tables cannot hold is left out (logged once, counted) and the rest is
// published; an error means nothing was, and the source retries.
func (p *publisher) publish(m *service.Model) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	start := time.Now()
	if m.Node.Name == "" {
		m.Node = p.node
	}
	e := p.a.engine
	t := service.CompileFrom(e.Services().Load(), m, p.opts)
	t = p.fit(m, t)
	p.logProblems(t)
	if err := p.to.Publish(t); err != nil {
		return fmt.Errorf("programming the dataplane: %w", err)
	}
	p.syncHealthChecks(t)
	if p.a.cfg.StateDir != "" {
		select {
		case p.saveCh <- m:
		default: // the saver is busy; it takes the next one
		}
	}
	p.a.log.Info("published service table", "generation", t.Generation(), "servicePorts", len(m.Ports),
		"frontends", t.Frontends(), "took", time.Since(start).Round(time.Microsecond))
	return nil
}

// fit leaves out the ports whose frontends the XDP frontend table cannot
// hold, largest first, so that one oversized Service does not keep every
// other from being published.
func (p *publisher) fit(m *service.Model, t *service.Table) *service.Table {
	limit := p.a.cfg.XDPTables.MaxFrontends
	if limit <= 0 {
		limit = xdp.DefaultMaxFrontends
	}
	if len(t.FrontendKeys()) <= limit {
		return t
	}
	count := map[service.PortName]int{}
	for _, k := range t.FrontendKeys() {
		if fe := t.Lookup(k.Proto, k.Addr, k.Port); fe != nil {
			count[fe.Port.Name]++
		}
	}
	names := make([]service.PortName, 0, len(count))
	for n := range count {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b service.PortName) int { return count[b] - count[a] })
	total := len(t.FrontendKeys())
	drop := map[service.PortName]bool{}
	for _, n := range names {
		if total <= limit {
			break
		}
		drop[n] = true
		total -= count[n]
		why := fmt.Sprintf("%d frontends, and the XDP frontend table (xdpTables.maxFrontends) holds %d in all", count[n], limit)
		if p.rejected[n] != why {
			p.rejected[n] = why
			p.rejectedTotal.Inc()
			p.a.log.Error("service port left out", "port", n.String(), "why", why)
		}
	}
	kept := &service.Model{Node: m.Node}
	for _, sp := range m.Ports {
		if !drop[sp.Name] {
			kept.Ports = append(kept.Ports, sp)
		}
	}
	return service.Compile(kept, p.opts)
}

// logProblems logs each problem of the table once, not at every publish.
func (p *publisher) logProblems(t *service.Table) {
	now := map[string]bool{}
	for _, pr := range t.Problems() {
		now[pr] = true
		if !p.problems[pr] {
			p.a.log.Warn("service table", "problem", pr)
		}
	}
	p.problems = now
}

// syncHealthChecks opens the healthCheckNodePort of every LoadBalancer
// Service with externalTrafficPolicy Local (the only ones that have one)
// and reports its local endpoints.
func (p *publisher) syncHealthChecks(t *service.Table) {
	ports := map[health.ServiceName]uint16{}
	local := map[health.ServiceName]int{}
	for _, sp := range t.Ports() {
		if sp.HealthCheckNodePort == 0 {
			continue
		}
		n := health.ServiceName{Namespace: sp.Name.Namespace, Name: sp.Name.Name}
		ports[n] = sp.HealthCheckNodePort
		local[n] = max(local[n], sp.LocalReady)
	}
	_ = p.a.services.Sync(ports, local) // logged and counted there; retried next publish
}

// saver writes published models to the state directory, off the publish
// path, the latest one when several come quickly.
func (p *publisher) saver() {
	defer close(p.saveDone)
	for m := range p.saveCh {
		if err := saveModel(filepath.Join(p.a.cfg.StateDir, lastModelFile), m); err != nil {
			p.a.log.Warn("saving the published model", "err", err)
		}
	}
}

func saveModel(path string, m *service.Model) error {
	var b bytes.Buffer
	if err := gob.NewEncoder(&b).Encode(m); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b.Bytes(), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// restore publishes the model the last process saved, if any: until the
// source has synced, new connections are served as they were before the
// restart rather than handed to the kernel.
func (p *publisher) restore() {
	if p.a.cfg.StateDir == "" {
		return
	}
	b, err := os.ReadFile(filepath.Join(p.a.cfg.StateDir, lastModelFile))
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	var m service.Model
	if err == nil {
		err = gob.NewDecoder(bytes.NewReader(b)).Decode(&m)
	}
	if err != nil {
		p.a.log.Warn("the last published model is unreadable; starting without it", "err", err)
		return
	}
	m.Node = p.node
	if err := p.publish(&m); err != nil {
		p.a.log.Warn("publishing the last model", "err", err)
		return
	}
	p.a.log.Info("serving the last published model until the source syncs", "servicePorts", len(m.Ports))
}

func (p *publisher) close() {
	close(p.saveCh)
	<-p.saveDone
}

// ErrInjected is the error of a publish made to fail through the admin
// socket (POST /debug/faults).
var ErrInjected = errors.New("injected fault (admin socket, POST /debug/faults)")

// faultyPublisher fails the next publishes it is armed for with
// ErrInjected, before the engine sees them, as a dataplane that cannot be
// programmed would; then it hands every table to next again. It is a
// testing aid: the real binary's retries, publish metrics and /healthz
// can be watched failing and recovering.
type faultyPublisher struct {
	next tablePublisher

	mu       sync.Mutex
	left     int // publishes still to fail
	injected int // publishes failed so far
}

// Publish fails while armed, else publishes through next.
func (f *faultyPublisher) Publish(t *service.Table) error {
	f.mu.Lock()
	if f.left > 0 {
		f.left--
		f.injected++
		f.mu.Unlock()
		return ErrInjected
	}
	f.mu.Unlock()
	return f.next.Publish(t)
}

// faultState is what the admin socket says of the faults.
type faultState struct {
	// Publish is how many publishes are still to fail.
	Publish int `json:"publish"`
	// Injected counts the publishes failed so far.
	Injected int `json:"injected"`
}

// arm makes the next n publishes fail, replacing what was left; 0
// disarms.
func (f *faultyPublisher) arm(n int) faultState {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.left = n
	return faultState{Publish: f.left, Injected: f.injected}
}

func (f *faultyPublisher) state() faultState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return faultState{Publish: f.left, Injected: f.injected}
}
