package health

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"
)

// ServiceName names a Service.
type ServiceName struct{ Namespace, Name string }

func (n ServiceName) String() string { return n.Namespace + "/" + n.Name }

// Services runs the healthCheckNodePort servers: one per Service with
// externalTrafficPolicy Local, on every address it is given (or all), each
// answering with the Service's local endpoint count.
type Services struct {
	proxy  *Proxy
	addrs  []netip.Addr // empty: the unspecified address
	log    *slog.Logger
	listen func(network, addr string) (net.Listener, error)

	mu       sync.Mutex
	servers  map[ServiceName]*hcServer
	counts   map[ServiceName]int
	failures int
}

type hcServer struct {
	port    uint16
	servers []*http.Server
}

// NewServices returns the servers' owner; none runs until Sync. addrs are
// the node addresses to listen on (nodePortAddresses), empty for all.
func NewServices(proxy *Proxy, addrs []netip.Addr, log *slog.Logger) *Services {
	if log == nil {
		log = slog.Default()
	}
	return &Services{proxy: proxy, addrs: addrs, log: log, listen: net.Listen,
		servers: map[ServiceName]*hcServer{}, counts: map[ServiceName]int{}}
}

// Sync makes the servers match ports (Service -> healthCheckNodePort) and
// records each Service's local endpoints. A server whose port cannot be
// opened is logged and counted, and tried again at the next Sync.
func (s *Services) Sync(ports map[ServiceName]uint16, localEndpoints map[ServiceName]int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.counts = localEndpoints
	for name, srv := range s.servers {
		if p, ok := ports[name]; !ok || p != srv.port {
			srv.close()
			delete(s.servers, name)
			s.log.Info("health check node port closed", "service", name.String(), "port", srv.port)
		}
	}
	var errs []error
	for name, port := range ports {
		if s.servers[name] != nil {
			continue
		}
		srv, err := s.open(name, port)
		if err != nil {
			s.failures++
			errs = append(errs, err)
			s.log.Error("health check node port", "service", name.String(), "port", port, "err", err)
			continue
		}
		s.servers[name] = srv
		s.log.Info("health check node port open", "service", name.String(), "port", port)
	}
	return errors.Join(errs...)
}

// Failures counts servers that could not be opened.
func (s *Services) Failures() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failures
}

func (s *Services) open(name ServiceName, port uint16) (*hcServer, error) {
	addrs := s.addrs
	if len(addrs) == 0 {
		addrs = []netip.Addr{netip.IPv4Unspecified()}
	}
	h := &hcServer{port: port}
	for _, a := range addrs {
		ln, err := s.listen("tcp", netip.AddrPortFrom(a, port).String())
		if err != nil {
			h.close()
			return nil, fmt.Errorf("listening on %v port %d: %w", a, port, err)
		}
		srv := &http.Server{Handler: s.handler(name), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		h.servers = append(h.servers, srv)
	}
	return h, nil
}

func (h *hcServer) close() {
	for _, srv := range h.servers {
		_ = srv.Close()
	}
}

// Close stops every server.
func (s *Services) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, srv := range s.servers {
		srv.close()
		delete(s.servers, name)
	}
}

// serviceHealth is kube-proxy's answer body.
type serviceHealth struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

func (s *Services) handler(name ServiceName) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		s.mu.Lock()
		n := s.counts[name]
		s.mu.Unlock()
		var body serviceHealth
		body.Service.Namespace, body.Service.Name = name.Namespace, name.Name
		body.LocalEndpoints = n
		body.ServiceProxyHealthy = s.proxy.Health().Healthy
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(n))
		if n > 0 && body.ServiceProxyHealthy {
			w.WriteHeader(http.StatusOK)
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
}
