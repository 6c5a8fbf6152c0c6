package agent

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestAdminServices: GET /services lists every service port once, with
// the frontends that lead to it and only those, and its backends.
func TestAdminServices(t *testing.T) {
	a, _ := fakeAgent(t)
	if err := a.pub.publish(lbModel(freePort(t), 2, "one", "two", "three")); err != nil {
		t.Fatal(err)
	}
	replies := adminServices(t, a)
	if len(replies) != 4 {
		t.Fatalf("%d services, want 4: %+v", len(replies), replies)
	}
	byName := map[string]serviceReply{}
	for _, r := range replies {
		byName[r.Name] = r
	}
	lb := byName["default/lb:p"]
	for _, want := range []string{"198.19.0.40:80", "198.19.1.40:80"} {
		if !slices.ContainsFunc(lb.Frontends, func(f string) bool { return strings.HasSuffix(f, " "+want) }) {
			t.Errorf("lb's frontends %q lack %s", lb.Frontends, want)
		}
	}
	if len(lb.Backends) != 2 {
		t.Errorf("lb's backends %q, want its 2 endpoints", lb.Backends)
	}
	for i, name := range []string{"one", "two", "three"} {
		r, ok := byName["default/"+name]
		want := fmt.Sprintf("ClusterIP 198.19.0.%d:80", 50+i)
		if !ok || !slices.Equal(r.Frontends, []string{want}) || !slices.Equal(r.Backends, []string{"198.18.1.11:8080"}) {
			t.Errorf("%s: %+v (found %v), want frontends [%s] and backends [198.18.1.11:8080]", name, r, ok, want)
		}
	}
}

// BenchmarkAdminServices: the /services reply at 10,000 services, which
// is linear in the services (it used to scan every reply per frontend).
func BenchmarkAdminServices(b *testing.B) {
	a, _ := fakeAgent(b)
	m := lbModel(0, 1)
	for i := range 10000 {
		m.Ports = append(m.Ports, m.Ports[0])
		p := &m.Ports[len(m.Ports)-1]
		p.Name.Name, p.Name.Port, p.NodePort, p.HealthCheckNodePort, p.ExternalPolicyLocal = fmt.Sprint("s", i), "", 0, 0, false
		p.LoadBalancerIPs = nil
		p.ClusterIPs = []packet.Addr{packet.MustParseAddr(fmt.Sprintf("198.20.%d.%d", i/250, i%250+1))}
	}
	if err := a.pub.publish(m); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if n := len(adminServices(b, a)); n != len(m.Ports) {
			b.Fatalf("%d services, want %d", n, len(m.Ports))
		}
	}
}

// adminServices asks a's admin socket for GET /services.
func adminServices(t testing.TB, a *agent) []serviceReply {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	admin, err := startAdmin(sock, a)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.close()
	b, err := AdminRequest(sock, "GET", "/services")
	if err != nil {
		t.Fatal(err)
	}
	var out []serviceReply
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}
