package socklb

import (
	"fmt"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

const (
	vip4 = "198.19.0.10"
	vip6 = "fd00:5e::10"
)

// TestClientsSeeTheVIP: a client in the cgroup reaches a backend through
// a frontend over TCP, connected UDP and unconnected UDP, on IPv4, IPv6
// and from a dual-stack socket to an IPv4-mapped address, and everything
// it is told about its peer (getpeername, recvfrom) is the frontend. A
// client outside the cgroup is not translated: with no route to the
// service address its connect fails at once. (The first IPv6 connect
// over a fresh veth takes a SYN retransmit, a second, here; a direct
// connect without any program does the same.)
func TestClientsSeeTheVIP(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	lb := w.loadAttach(t, Options{},
		frontend(vip4, 80, packet.ProtoTCP, backend4[0]),
		frontend(vip4, 53, packet.ProtoUDP, backend4[0]),
		frontend(vip6, 80, packet.ProtoTCP, backend6[0]),
		frontend(vip6, 53, packet.ProtoUDP, backend6[0]),
	)
	cases := []struct {
		family, vip, backend, shownAs string
	}{
		{"4", vip4, backend4[0], vip4},
		{"6", vip6, backend6[0], vip6},
		{"mapped", vip4, backend4[0], "::ffff:" + vip4},
	}
	for _, c := range cases {
		t.Run("family"+c.family, func(t *testing.T) {
			wantBackend := addrPort(c.backend, backendPort)
			vipTCP, vipUDP := addrPort(c.shownAs, 80), addrPort(c.shownAs, 53)

			r := w.one(t, w.pod, true, clientSpec{Mode: "tcp", Family: c.family, Addr: c.vip, Port: 80})
			if r.Err != "" || r.Backend != wantBackend || r.Peer != vipTCP {
				t.Errorf("TCP: %+v, want backend %s and getpeername %s", r, wantBackend, vipTCP)
			}
			r = w.one(t, w.pod, true, clientSpec{Mode: "udpconn", Family: c.family, Addr: c.vip, Port: 53})
			if r.Err != "" || r.Backend != wantBackend || r.Peer != vipUDP || r.From != vipUDP {
				t.Errorf("connected UDP: %+v, want backend %s, getpeername and recvfrom %s", r, wantBackend, vipUDP)
			}
			r = w.one(t, w.pod, true, clientSpec{Mode: "udp", Family: c.family, Addr: c.vip, Port: 53})
			if r.Err != "" || r.Backend != wantBackend || r.From != vipUDP {
				t.Errorf("unconnected UDP: %+v, want backend %s and recvfrom %s", r, wantBackend, vipUDP)
			}
			// Not in the cgroup: untouched.
			start := time.Now()
			r = w.one(t, w.pod, false, clientSpec{Mode: "tcp", Family: c.family, Addr: c.vip, Port: 80})
			if r.Err != "ENETUNREACH" {
				t.Errorf("TCP from outside the cgroup: %+v, want ENETUNREACH (not translated)", r)
			}
			r = w.one(t, w.pod, false, clientSpec{Mode: "udp", Family: c.family, Addr: c.vip, Port: 53})
			if r.Err != "ENETUNREACH" {
				t.Errorf("UDP from outside the cgroup: %+v, want ENETUNREACH (not translated)", r)
			}
			if d := time.Since(start); d > 2*time.Second && !raceEnabled {
				t.Errorf("untranslated clients took %v to fail", d)
			}
		})
	}
	c := counters(t, lb)
	if c.Translated != 9 || c.Reversed < 9 || c.NoBackend != 0 || c.ReverseFailed != 0 {
		t.Errorf("counters %+v, want 9 translated, at least 9 reversed, no failures", c)
	}
	// Without PinDir, Close detaches.
	lb.Close()
	if r := w.one(t, w.pod, true, clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 80}); r.Err != "ENETUNREACH" {
		t.Errorf("after Close: %+v, want ENETUNREACH (not translated)", r)
	}
}

// TestSpread: connects are spread over every backend at random; an
// unconnected UDP socket keeps the backend it got while it stays in the
// set, and moves when it leaves.
func TestSpread(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	tcp := frontend(vip4, 80, packet.ProtoTCP, backend4[:3]...)
	udp := frontend(vip4, 53, packet.ProtoUDP, backend4[:3]...)
	lb := w.loadAttach(t, Options{}, tcp, udp)

	const n = 300
	rs := w.runClient(t, w.pod, true, clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 80, Count: n})
	hits := map[string]int{}
	for _, r := range rs {
		if r.Err != "" {
			t.Fatalf("connect failed: %+v", r)
		}
		hits[r.Backend]++
	}
	t.Logf("%d connects: %v", n, hits)
	for _, b := range backend4[:3] {
		// Expected 100 each, standard deviation about 8.
		if h := hits[addrPort(b, backendPort)]; h < 50 {
			t.Errorf("backend %s got %d of %d connects", b, h, n)
		}
	}

	// One unconnected socket: one backend. Many sockets: all three.
	rs = w.runClient(t, w.pod, true, clientSpec{Mode: "udp", Family: "4", Addr: vip4, Port: 53, Count: 30, Reuse: true})
	first := rs[0].Backend
	for _, r := range rs {
		if r.Err != "" || r.Backend != first || r.From != addrPort(vip4, 53) {
			t.Fatalf("unconnected UDP socket: %+v, want every reply from %s shown as the VIP", r, first)
		}
	}
	rs = w.runClient(t, w.pod, true, clientSpec{Mode: "udp", Family: "4", Addr: vip4, Port: 53, Count: 60})
	udpHits := map[string]int{}
	for _, r := range rs {
		udpHits[r.Backend]++
	}
	if len(udpHits) != 3 {
		t.Errorf("60 UDP sockets reached %v, want all three backends", udpHits)
	}
	if c := counters(t, lb); c.PinHits < 29 {
		t.Errorf("pin hits %d, want at least 29 (%+v)", c.PinHits, c)
	}
}

// TestAffinity: with ClientIP affinity, the connects of one client
// netns land on one backend; each use refreshes the timeout; after the
// timeout the choice is new; a backend that leaves the set is replaced.
func TestAffinity(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	fe := frontend(vip4, 80, packet.ProtoTCP, backend4[:3]...)
	fe.ServiceID = 42
	fe.AffinityTimeout = time.Second
	lb := w.loadAttach(t, Options{}, fe)
	spec := clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 80}

	all := spec
	all.Count = 50
	rs := w.runClient(t, w.pod, true, all)
	chosen := rs[0].Backend
	for _, r := range rs {
		if r.Err != "" || r.Backend != chosen {
			t.Fatalf("connect with affinity: %+v, want %s like the first", r, chosen)
		}
	}
	if c := counters(t, lb); c.AffinityHits != 49 {
		t.Errorf("affinity hits %d, want 49", c.AffinityHits)
	}

	if raceEnabled {
		return // the timing below does not hold with racing clients
	}
	// Connects 0.6 s apart: each one refreshes the 1 s timeout, so the
	// last still finds the first's backend 2.4 s later.
	for range 4 {
		time.Sleep(600 * time.Millisecond)
		if r := w.one(t, w.pod, true, spec); r.Backend != chosen {
			t.Fatalf("connect within the refreshed timeout: %+v, want %s", r, chosen)
		}
	}
	// Past the timeout: a new choice (which may be the same backend).
	before := counters(t, lb).AffinityHits
	time.Sleep(1500 * time.Millisecond)
	chosen = w.one(t, w.pod, true, spec).Backend
	if c := counters(t, lb); c.AffinityHits != before {
		t.Errorf("a connect after the timeout used the old affinity (%d hits, had %d)", c.AffinityHits, before)
	}

	// The chosen backend leaves: the next connects agree on another.
	var rest []string
	for _, b := range backend4[:3] {
		if addrPort(b, backendPort) != chosen {
			rest = append(rest, b)
		}
	}
	fe.Backends = frontend(vip4, 80, packet.ProtoTCP, rest...).Backends
	if err := lb.SetFrontends([]Frontend{fe}); err != nil {
		t.Fatal(err)
	}
	all.Count = 20
	rs = w.runClient(t, w.pod, true, all)
	next := rs[0].Backend
	for _, r := range rs {
		if r.Err != "" || r.Backend != next || r.Backend == chosen {
			t.Fatalf("after %s left: %+v, want every connect on one of %v", chosen, r, rest)
		}
	}
}

// TestNoEndpoints: a frontend without backends fails the connect or send
// with ECONNREFUSED when it rejects, EPERM otherwise.
func TestNoEndpoints(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	reject := frontend(vip4, 80, packet.ProtoTCP)
	reject.Reject = true
	drop := frontend(vip4, 81, packet.ProtoTCP)
	rejectUDP := frontend(vip4, 53, packet.ProtoUDP)
	rejectUDP.Reject = true
	reject6 := frontend(vip6, 80, packet.ProtoTCP)
	reject6.Reject = true
	lb := w.loadAttach(t, Options{}, reject, drop, rejectUDP, reject6)

	for _, c := range []struct {
		spec clientSpec
		want string
	}{
		{clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 80}, "ECONNREFUSED"},
		{clientSpec{Mode: "tcp", Family: "6", Addr: vip6, Port: 80}, "ECONNREFUSED"},
		{clientSpec{Mode: "tcp", Family: "mapped", Addr: vip4, Port: 80}, "ECONNREFUSED"},
		{clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 81}, "EPERM"},
		{clientSpec{Mode: "udp", Family: "4", Addr: vip4, Port: 53}, "ECONNREFUSED"},
		{clientSpec{Mode: "udpconn", Family: "4", Addr: vip4, Port: 53}, "ECONNREFUSED"},
	} {
		if r := w.one(t, w.pod, true, c.spec); r.Err != c.want {
			t.Errorf("%s %s %s:%d: %+v, want %s", c.spec.Mode, c.spec.Family, c.spec.Addr, c.spec.Port, r, c.want)
		}
	}
	if c := counters(t, lb); c.Rejected != 5 || c.Dropped != 1 || c.Translated != 0 {
		t.Errorf("counters %+v, want 5 rejected, 1 dropped", c)
	}
}

// TestLocalhostNodePort: a NodePort on 127.0.0.1 is translated in the
// node's network namespace (here the pod netns plays the node), and only
// there: in another netns, 127.0.0.1 is that netns' own.
func TestLocalhostNodePort(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	other := newNetns(t)
	serve(t, other, []string{"127.0.0.1"}, 30080)
	lb := w.loadAttach(t, Options{NodeNetnsCookie: netnsCookieOf(t, w.pod)},
		frontend("127.0.0.1", 30080, packet.ProtoTCP, backend4[0]),
		frontend("10.201.0.1", 30080, packet.ProtoTCP, backend4[0]), // a node address
	)
	want := addrPort(backend4[0], backendPort)
	for _, addr := range []string{"127.0.0.1", "10.201.0.1"} {
		r := w.one(t, w.pod, true, clientSpec{Mode: "tcp", Family: "4", Addr: addr, Port: 30080})
		if r.Err != "" || r.Backend != want || r.Peer != addrPort(addr, 30080) {
			t.Errorf("node to %s:30080: %+v, want backend %s shown as %s:30080", addr, r, want, addr)
		}
	}
	r := w.one(t, other, true, clientSpec{Mode: "tcp", Family: "4", Addr: "127.0.0.1", Port: 30080})
	if r.Backend != "127.0.0.1:30080" {
		t.Errorf("another netns to its own 127.0.0.1:30080: %+v, want its own server", r)
	}
	if c := counters(t, lb); c.NotNode != 1 || c.Translated != 2 {
		t.Errorf("counters %+v, want 2 translated and 1 left alone outside the node", c)
	}
}

// TestUpdatesWhileConnecting: clients connect without pause while
// SetFrontends swaps the backends around. Every connect succeeds (no
// half-written set: a missing backend would leave the connect
// untranslated, and it would fail) and reaches a backend of a set that
// was current at some point during the connect: set k may be seen from
// the moment SetFrontends(k) is called until SetFrontends(k+1) returns.
func TestUpdatesWhileConnecting(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	sets := [][]string{
		{backend4[0]},
		{backend4[1], backend4[2]},
		{backend4[3], backend4[0], backend4[1]},
		{backend4[2]},
		{backend4[0], backend4[1], backend4[2], backend4[3]},
		{backend4[3]},
	}
	fes := func(k int) []Frontend {
		f := frontend(vip4, 80, packet.ProtoTCP, sets[k%len(sets)]...)
		// A second frontend with the same backends shares the set.
		g := frontend(vip4, 8080, packet.ProtoTCP, sets[k%len(sets)]...)
		return []Frontend{f, g}
	}
	type update struct {
		called, returned int64
		set              int
	}
	lb := w.loadAttach(t, Options{}, fes(0)...)
	updates := []update{{0, mono(), 0}}

	done := make(chan []result)
	go func() {
		// runClient's t.Fatal ends only this goroutine: close done then
		// too, or the updates below never stop.
		defer close(done)
		done <- w.runClient(t, w.pod, true, clientSpec{Mode: "loop", Family: "4", Addr: vip4, Port: 80,
			Duration: 1500 * time.Millisecond, Workers: 2})
	}()
	var rs []result
	for k := 1; ; k++ {
		select {
		case rs = <-done:
		default:
			u := update{called: mono(), set: k % len(sets)}
			if err := lb.SetFrontends(fes(k)); err != nil {
				t.Fatal(err)
			}
			u.returned = mono()
			updates = append(updates, u)
			time.Sleep(time.Millisecond)
			continue
		}
		break
	}
	visible := func(i int) (from, until int64) {
		from, until = updates[i].called, int64(1<<62)
		if i+1 < len(updates) {
			until = updates[i+1].returned
		}
		return
	}
	var bad int
	for _, r := range rs {
		if r.Err != "" {
			bad++
			if bad < 5 {
				t.Errorf("connect failed: %+v", r)
			}
			continue
		}
		ok := false
		for i := range updates {
			from, until := visible(i)
			if from > r.End || until < r.Start {
				continue
			}
			for _, b := range sets[updates[i].set] {
				ok = ok || r.Backend == addrPort(b, backendPort)
			}
		}
		if !ok {
			bad++
			if bad < 5 {
				t.Errorf("connect [%d, %d] reached %s, in no set current then", r.Start, r.End, r.Backend)
			}
		}
	}
	c := counters(t, lb)
	t.Logf("%d connects during %d updates, %d bad; counters %+v", len(rs), len(updates), bad, c)
	if len(rs) < 100 || len(updates) < 50 {
		t.Errorf("only %d connects and %d updates: the test proves little", len(rs), len(updates))
	}
	if c.NoBackend != 0 {
		t.Errorf("%d connects found a set with a backend missing", c.NoBackend)
	}
	// Every set but the current one is gone from the tables.
	n := 0
	var k bpfBackendKey
	var v bpfEndpoint
	for it := lb.backends.Iterate(); it.Next(&k, &v); {
		n++
	}
	if want := len(sets[updates[len(updates)-1].set]); n != want {
		t.Errorf("backends table holds %d entries, want %d", n, want)
	}
}

// TestPinnedLinksSurviveRestart plays two generations of xdproxy: the
// first pins its tables and links and exits without detaching; sockets
// are still balanced; the second adopts the tables with their contents
// and the links, and its programs take over.
func TestPinnedLinksSurviveRestart(t *testing.T) {
	requireRoot(t)
	w := newWorld(t)
	pins := privateBPFFS(t)
	opts := Options{MaxFrontends: 16, MaxBackends: 64, MaxAffinity: 64, MaxReverse: 256, PinDir: pins}
	spec := clientSpec{Mode: "tcp", Family: "4", Addr: vip4, Port: 80}
	a, b := addrPort(backend4[0], backendPort), addrPort(backend4[1], backendPort)

	lb1, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	if lb1.Adopted() != 0 {
		t.Errorf("first Load adopted %d tables from an empty directory", lb1.Adopted())
	}
	fes := []Frontend{frontend(vip4, 80, packet.ProtoTCP, backend4[0])}
	if err := lb1.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if err := lb1.Attach(w.cg.path); err != nil {
		t.Fatal(err)
	}
	var ids []uint32
	for _, at := range lb1.links {
		info, err := at.link.Info()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, uint32(info.ID))
	}
	if r := w.one(t, w.pod, true, spec); r.Backend != a {
		t.Fatalf("first generation: %+v, want %s", r, a)
	}
	lb1.Close()
	if r := w.one(t, w.pod, true, spec); r.Backend != a || r.Peer != addrPort(vip4, 80) {
		t.Fatalf("between generations: %+v, want %s shown as the VIP", r, a)
	}

	lb2, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer lb2.Close()
	if lb2.Adopted() != 6 {
		t.Errorf("second Load adopted %d tables, want all 6", lb2.Adopted())
	}
	// The state was read back: the same frontends need no writes, so
	// no set is created (set ids would advance).
	if err := lb2.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if len(lb2.state.sets) != 1 || lb2.state.nextSet != 2 {
		t.Errorf("adopted state: %d sets, next id %d; want the one set of the first generation", len(lb2.state.sets), lb2.state.nextSet)
	}
	fes[0].Backends = []Backend{{packet.MustParseAddr(backend4[1]), backendPort}}
	if err := lb2.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if err := lb2.Attach(w.cg.path); err != nil {
		t.Fatal(err)
	}
	if lb2.AdoptedLinks() != len(hooks) {
		t.Errorf("second Attach adopted %d links, want %d", lb2.AdoptedLinks(), len(hooks))
	}
	for i, at := range lb2.links {
		info, err := at.link.Info()
		if err != nil {
			t.Fatal(err)
		}
		if uint32(info.ID) != ids[i] {
			t.Errorf("%s: link %d, want the pinned link %d", at.hook.name, info.ID, ids[i])
		}
		if p := uint32(info.Program); p != lb2.progID(t, at.hook.prog) {
			t.Errorf("%s: link runs program %d, want the second generation's", at.hook.name, p)
		}
	}
	if r := w.one(t, w.pod, true, spec); r.Backend != b || r.Peer != addrPort(vip4, 80) {
		t.Fatalf("second generation: %+v, want %s shown as the VIP", r, b)
	}

	// Tables of another size are not adopted; the group goes together.
	other := opts
	other.MaxBackends = 32
	lb3, err := Load(other)
	if err != nil {
		t.Fatal(err)
	}
	if lb3.Adopted() != 3 {
		t.Errorf("Load with another backends size adopted %d tables, want 3 (affinity, reverse, counters)", lb3.Adopted())
	}
	lb3.Close()

	if err := lb2.Detach(); err != nil {
		t.Fatal(err)
	}
	if r := w.one(t, w.pod, true, spec); r.Err != "ENETUNREACH" {
		t.Errorf("after Detach: %+v, want ENETUNREACH (not translated)", r)
	}
	if err := RemovePins(pins); err != nil {
		t.Fatal(err)
	}
}

// TestConnectOverhead measures connect(2) through a frontend against
// connect(2) straight to the same backend, from the same client in the
// cgroup (whose direct connects run the hook too, and miss), and straight
// to it from outside the cgroup (no hook). It reports, it does not
// assert. go test -run ConnectOverhead -v ./xdp/socklb
func TestConnectOverhead(t *testing.T) {
	requireRoot(t)
	if testing.Short() {
		t.Skip("a measurement")
	}
	w := newWorld(t)
	lb := w.loadAttach(t, Options{}, frontend(vip4, 80, packet.ProtoTCP, backend4[0]))
	direct := addrPort(backend4[0], backendPort)
	spec := clientSpec{Mode: "bench", Family: "4", Addr: vip4, Port: 80, Count: 10000, Direct: direct}
	// Run-time statistics of BPF programs, only while this is open.
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatal(err)
	}
	in := w.one(t, w.pod, true, spec).Bench
	ps, err := lb.progs[bpfProgSocklbConn4].Stats()
	stats.Close()
	if err != nil {
		t.Fatal(err)
	}
	spec.Addr, spec.Port = backend4[0], backendPort // outside: "VIP" is the backend too
	out := w.one(t, w.pod, false, spec).Bench
	us := func(ns float64) string { return fmt.Sprintf("%.1fµs", ns/1e3) }
	t.Logf("connect(2), %d each, median / mean / p90:", in.N)
	t.Logf("  in cgroup, via VIP %s:80:  %s / %s / %s", vip4, us(in.VIP.Median), us(in.VIP.Mean), us(in.VIP.P90))
	t.Logf("  in cgroup, direct %s: %s / %s / %s", direct, us(in.Direct.Median), us(in.Direct.Mean), us(in.Direct.P90))
	t.Logf("  no hooks, direct:               %s / %s / %s", us(out.Direct.Median), us(out.Direct.Mean), us(out.Direct.P90))
	t.Logf("  VIP - direct (median): %s", us(in.VIP.Median-in.Direct.Median))
	if ps.RunCount > 0 {
		t.Logf("  connect4 program: %d runs (VIP and direct), %.0fns each on average", ps.RunCount,
			float64(ps.Runtime.Nanoseconds())/float64(ps.RunCount))
	}
	if in.Failed+in.Wrong+out.Failed+out.Wrong > 0 {
		t.Errorf("failed or misdirected connects: %+v %+v", in, out)
	}
	if c := counters(t, lb); c.Translated < uint64(in.N) {
		t.Errorf("translated %d, want %d", c.Translated, in.N)
	}
}

// progID returns the kernel id of program name.
func (lb *LB) progID(t *testing.T, name string) uint32 {
	t.Helper()
	info, err := lb.progs[name].Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return uint32(id)
}
