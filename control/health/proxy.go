package health

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// Check is a named condition; nil means it holds.
type Check struct {
	Name string
	Err  func() error
}

// NodeState is what node eligibility looks at: the Node this proxy runs
// on, as the API server has it.
type NodeState struct {
	// Known is false until the Node has been seen.
	Known bool
	// Deleting is true when the Node has a deletion timestamp or the
	// cluster autoscaler's ToBeDeletedByClusterAutoscaler taint.
	Deleting bool
}

// ProxyOptions configure a Proxy.
type ProxyOptions struct {
	// Timeout is how long a queued update may wait before the proxy is
	// unhealthy (kube-proxy: twice the sync period).
	Timeout time.Duration
	// Node returns the node's state; nil means always eligible (a static
	// service file has no Node).
	Node func() NodeState
	// Ready are conditions /healthz also requires; Live those /livez
	// requires.
	Ready, Live []Check
	Clock       clock.Clock
}

// Proxy is the proxy's own health.
type Proxy struct {
	opts ProxyOptions

	mu           sync.RWMutex
	lastUpdated  time.Time
	oldestQueued time.Time // zero: nothing queued
}

// NewProxy returns a Proxy.
func NewProxy(opts ProxyOptions) *Proxy {
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 2 * time.Minute
	}
	return &Proxy{opts: opts}
}

// QueuedUpdate records that a change arrived that the dataplane does not
// have yet. Only the oldest one counts.
func (p *Proxy) QueuedUpdate() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.oldestQueued.IsZero() {
		p.oldestQueued = p.opts.Clock.Now()
	}
}

// Updated records that the dataplane took everything queued so far.
func (p *Proxy) Updated() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.oldestQueued = time.Time{}
	p.lastUpdated = p.opts.Clock.Now()
}

// Status is the body of /healthz and /livez: kube-proxy's fields, and the
// problems that make it unhealthy.
type Status struct {
	LastUpdated  time.Time `json:"lastUpdated"`
	CurrentTime  time.Time `json:"currentTime"`
	NodeEligible *bool     `json:"nodeEligible,omitempty"`
	Healthy      bool      `json:"healthy"`
	// Problems name what is wrong, one line each; empty when healthy.
	Problems []string `json:"problems,omitempty"`
}

// Health is the proxy's state without node eligibility or checks: whether
// no update has waited too long. Services report it as
// serviceProxyHealthy, as kube-proxy does.
func (p *Proxy) Health() Status {
	p.mu.RLock()
	defer p.mu.RUnlock()
	now := p.opts.Clock.Now()
	s := Status{LastUpdated: p.lastUpdated, CurrentTime: now, Healthy: true}
	if !p.oldestQueued.IsZero() && now.Sub(p.oldestQueued) >= p.opts.Timeout {
		s.Healthy = false
		s.Problems = append(s.Problems, "an update queued at "+p.oldestQueued.UTC().Format(time.RFC3339)+
			" is not applied after "+p.opts.Timeout.String())
	}
	return s
}

// NodeEligible reports whether load balancers should send traffic to this
// node at all.
func (p *Proxy) NodeEligible() bool {
	if p.opts.Node == nil {
		return true
	}
	n := p.opts.Node()
	return n.Known && !n.Deleting
}

func (p *Proxy) check(s *Status, checks []Check) {
	for _, c := range checks {
		if err := c.Err(); err != nil {
			s.Healthy = false
			s.Problems = append(s.Problems, c.Name+": "+err.Error())
		}
	}
}

// Healthz is /healthz: Health, node eligibility and the Ready checks.
func (p *Proxy) Healthz() Status {
	s := p.Health()
	eligible := p.NodeEligible()
	s.NodeEligible = &eligible
	if !eligible {
		s.Healthy = false
		s.Problems = append(s.Problems, "the node is being deleted, or not known yet")
	}
	p.check(&s, p.opts.Ready)
	return s
}

// Livez is /livez: Health and the Live checks.
func (p *Proxy) Livez() Status {
	s := p.Health()
	p.check(&s, p.opts.Live)
	return s
}

// Handler serves /healthz and /livez.
func (p *Proxy) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { p.write(w, p.Healthz()) })
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { p.write(w, p.Livez()) })
	return mux
}

func (p *Proxy) write(w http.ResponseWriter, s Status) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if s.Healthy {
		// kube-proxy reports the time of the answer when healthy.
		s.LastUpdated = s.CurrentTime
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(s)
}
