package socklb

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// fakeKernel stands in for the three tables SetFrontends writes, and
// after every single write checks what a program reading them at that
// moment could see:
//   - every frontend entry points at a whole set: all its backends and
//     members are there;
//   - a set's entries are deleted only when no frontend points at it,
//     and only after a grace period that followed the last time one did
//     (a program that read the old entry may still be using the set
//     until then).
//
// With failEvery n, every nth write fails (a faulty kernel); with caps,
// a full table fails a new key with E2BIG as the kernel does.
type fakeKernel struct {
	t         *testing.T
	fe        map[bpfFrontendKey]bpfFrontend
	be        map[bpfBackendKey]bpfEndpoint
	mem       map[bpfMemberKey]uint32
	caps      [3]int // frontends, backends, members; 0: unlimited
	inFlight  map[uint32]bool
	writes    int
	graces    int
	failEvery int
	failGrace bool
}

func newFakeKernel(t *testing.T) *fakeKernel {
	return &fakeKernel{t: t, fe: map[bpfFrontendKey]bpfFrontend{}, be: map[bpfBackendKey]bpfEndpoint{},
		mem: map[bpfMemberKey]uint32{}, inFlight: map[uint32]bool{}}
}

var errInjected = errors.New("injected fault")

func (k *fakeKernel) tables() tables {
	return tables{
		frontends: fakeTable{k, 0}, backends: fakeTable{k, 1}, members: fakeTable{k, 2},
		grace: func() error {
			if k.failGrace {
				return errInjected
			}
			k.graces++
			clear(k.inFlight)
			return nil
		},
	}
}

type fakeTable struct {
	k     *fakeKernel
	which int
}

func (f fakeTable) fail() bool {
	f.k.writes++
	return f.k.failEvery > 0 && f.k.writes%f.k.failEvery == 0
}

func putCapped[K comparable, V any](m map[K]V, key K, v V, limit int) error {
	if _, ok := m[key]; !ok && limit > 0 && len(m) >= limit {
		return unix.E2BIG
	}
	m[key] = v
	return nil
}

func (f fakeTable) Put(key, value any) error {
	k := f.k
	if f.fail() {
		return errInjected
	}
	var err error
	switch f.which {
	case 0:
		key := key.(bpfFrontendKey)
		old, had := k.fe[key]
		err = putCapped(k.fe, key, value.(bpfFrontend), k.caps[0])
		if err == nil && had && old.Count > 0 {
			k.inFlight[old.Set] = true
		}
	case 1:
		err = putCapped(k.be, key.(bpfBackendKey), value.(bpfEndpoint), k.caps[1])
	case 2:
		err = putCapped(k.mem, key.(bpfMemberKey), value.(uint32), k.caps[2])
	}
	k.check()
	return err
}

func (f fakeTable) Delete(key any) error {
	k := f.k
	if f.fail() {
		return errInjected
	}
	var set uint32
	var found bool
	switch f.which {
	case 0:
		key := key.(bpfFrontendKey)
		old, ok := k.fe[key]
		if ok && old.Count > 0 {
			k.inFlight[old.Set] = true
		}
		delete(k.fe, key)
		found = ok
	case 1:
		key := key.(bpfBackendKey)
		_, found = k.be[key]
		set = key.Set
		delete(k.be, key)
	case 2:
		key := key.(bpfMemberKey)
		_, found = k.mem[key]
		set = key.Set
		delete(k.mem, key)
	}
	if f.which != 0 {
		for fk, e := range k.fe {
			if e.Count > 0 && e.Set == set {
				k.t.Errorf("deleted an entry of set %d, which frontend %v points at", set, keyString(fk))
			}
		}
		if k.inFlight[set] {
			k.t.Errorf("deleted an entry of set %d before a grace period since a frontend last pointed at it", set)
		}
	}
	k.check()
	if !found {
		return fmt.Errorf("delete: %w", ebpf.ErrKeyNotExist)
	}
	return nil
}

// check fails the test if a frontend points at a set that is not whole.
func (k *fakeKernel) check() {
	k.t.Helper()
	for fk, e := range k.fe {
		for i := range e.Count {
			ep, ok := k.be[bpfBackendKey{Set: e.Set, Index: i}]
			if !ok {
				k.t.Fatalf("frontend %v points at set %d, whose backend %d is missing", keyString(fk), e.Set, i)
			}
			if _, ok := k.mem[bpfMemberKey{Set: e.Set, Ep: ep}]; !ok {
				k.t.Fatalf("frontend %v points at set %d, whose member %s is missing", keyString(fk), e.Set, endpointString(ep))
			}
		}
	}
}

// view is what the fake tables say about each frontend: its backends
// (sorted) and its fields.
func (k *fakeKernel) view() map[string]string {
	out := map[string]string{}
	for fk, e := range k.fe {
		var bs []string
		for i := range e.Count {
			bs = append(bs, endpointString(k.be[bpfBackendKey{Set: e.Set, Index: i}]))
		}
		slices.Sort(bs)
		out[keyString(fk)] = fmt.Sprintf("id=%d aff=%d flags=%d %v", e.ServiceId, e.AffinityS, e.Flags, bs)
	}
	return out
}

// viewOf is view for what fes asks for.
func viewOf(fes []Frontend) map[string]string {
	out := map[string]string{}
	for _, f := range fes {
		var bs []string
		for _, b := range f.Backends {
			bs = append(bs, b.String())
		}
		slices.Sort(bs)
		flags := 0
		if f.Reject {
			flags |= flagReject
		}
		if f.Addr.Netip().IsLoopback() {
			flags |= flagNodeOnly
		}
		aff := (f.AffinityTimeout + time.Second - 1) / time.Second
		out[f.String()] = fmt.Sprintf("id=%d aff=%d flags=%d %v", f.ServiceID, aff, flags, bs)
	}
	return out
}

func equalViews(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// fakeLB is an LB on a fake kernel.
func fakeLB(t *testing.T, opts Options) (*LB, *fakeKernel) {
	k := newFakeKernel(t)
	if opts.MaxFrontends == 0 {
		opts.MaxFrontends = 1024
	}
	if opts.MaxBackends == 0 {
		opts.MaxBackends = 1024
	}
	return &LB{opts: opts, t: k.tables(), state: newState()}, k
}

func be(s string, port uint16) Backend { return Backend{Addr: packet.MustParseAddr(s), Port: port} }

func fe(vip string, port uint16, proto packet.Proto, bs ...Backend) Frontend {
	return Frontend{Addr: packet.MustParseAddr(vip), Port: port, Proto: proto, ServiceID: uint64(port), Backends: bs}
}

func TestSyncWritesOnlyDifferences(t *testing.T) {
	lb, k := fakeLB(t, Options{})
	a, b, c := be("10.0.0.1", 80), be("10.0.0.2", 80), be("10.0.0.3", 80)
	fes := []Frontend{
		fe("198.19.0.1", 80, packet.ProtoTCP, a, b),
		fe("198.19.0.2", 53, packet.ProtoUDP, c),
		fe("198.19.0.3", 80, packet.ProtoTCP), // no endpoints
	}
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if !equalViews(k.view(), viewOf(fes)) {
		t.Fatalf("tables %v\nwant %v", k.view(), viewOf(fes))
	}
	// 3 backends and 3 members, 3 frontends.
	if k.writes != 9 || k.graces != 0 {
		t.Errorf("%d writes and %d grace periods, want 9 and 0", k.writes, k.graces)
	}
	k.writes = 0
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if k.writes != 0 {
		t.Errorf("the same frontends again: %d writes", k.writes)
	}
	// One backend more for the first: a new set of 3 (3+3 writes), one
	// frontend update, then the old set of 2 goes (2+2 deletes) after a
	// grace period.
	fes[0].Backends = append(fes[0].Backends, c)
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if k.writes != 11 || k.graces != 1 {
		t.Errorf("%d writes and %d grace periods, want 11 and 1", k.writes, k.graces)
	}
	if !equalViews(k.view(), viewOf(fes)) {
		t.Fatalf("tables %v\nwant %v", k.view(), viewOf(fes))
	}
	// Only a flag changes: one frontend write, no set.
	k.writes = 0
	fes[2].Reject = true
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if k.writes != 1 {
		t.Errorf("a changed flag took %d writes, want 1", k.writes)
	}
	// Everything goes.
	if err := lb.SetFrontends(nil); err != nil {
		t.Fatal(err)
	}
	if len(k.fe)+len(k.be)+len(k.mem) != 0 || len(lb.state.sets) != 0 || lb.state.entries != 0 {
		t.Errorf("left behind: %d frontends, %d backends, %d members, %d sets in state",
			len(k.fe), len(k.be), len(k.mem), len(lb.state.sets))
	}
}

// Frontends with the same backends, in any order, share one set.
func TestSyncSharesSets(t *testing.T) {
	lb, k := fakeLB(t, Options{MaxBackends: 3})
	a, b, c := be("10.0.0.1", 8080), be("10.0.0.2", 8080), be("10.0.0.3", 8080)
	fes := []Frontend{
		fe("198.19.0.1", 80, packet.ProtoTCP, a, b, c),
		fe("192.168.1.1", 30080, packet.ProtoTCP, c, b, a),
		fe("127.0.0.1", 30080, packet.ProtoTCP, b, a, c),
	}
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	if len(k.be) != 3 || len(lb.state.sets) != 1 {
		t.Errorf("%d backends entries in %d sets, want 3 in 1", len(k.be), len(lb.state.sets))
	}
	if !equalViews(k.view(), viewOf(fes)) {
		t.Fatalf("tables %v\nwant %v", k.view(), viewOf(fes))
	}
	if e := k.fe[bpfFrontendKey{Addr: packet.MustParseAddr("127.0.0.1"), Port: networkOrder16(30080), Proto: 6}]; e.Flags != flagNodeOnly {
		t.Errorf("loopback frontend flags %d, want node-only", e.Flags)
	}
}

func TestSyncTableFull(t *testing.T) {
	a, b, c, d := be("10.0.0.1", 80), be("10.0.0.2", 80), be("10.0.0.3", 80), be("10.0.0.4", 80)

	lb, _ := fakeLB(t, Options{MaxFrontends: 2})
	err := lb.SetFrontends([]Frontend{fe("198.19.0.1", 1, packet.ProtoTCP), fe("198.19.0.1", 2, packet.ProtoTCP), fe("198.19.0.1", 3, packet.ProtoTCP)})
	if !errors.Is(err, ErrTableFull) || !strings.Contains(err.Error(), "frontends") {
		t.Errorf("3 frontends in a table of 2: %v", err)
	}
	// Old and new do not fit together: stale ones go first.
	if err := lb.SetFrontends([]Frontend{fe("198.19.0.1", 1, packet.ProtoTCP), fe("198.19.0.1", 2, packet.ProtoTCP)}); err != nil {
		t.Fatal(err)
	}
	if err := lb.SetFrontends([]Frontend{fe("198.19.0.1", 3, packet.ProtoTCP), fe("198.19.0.1", 4, packet.ProtoTCP)}); err != nil {
		t.Errorf("replacing 2 frontends in a table of 2: %v", err)
	}

	// Room for 3 backends: a set of 2 cannot be replaced by another 2,
	// since the old set stays until the new one is in place.
	lb, k := fakeLB(t, Options{MaxBackends: 3})
	fes := []Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, a, b)}
	if err := lb.SetFrontends(fes); err != nil {
		t.Fatal(err)
	}
	fes[0].Backends = []Backend{c, d}
	err = lb.SetFrontends(fes)
	if !errors.Is(err, ErrTableFull) || !strings.Contains(err.Error(), "backends") {
		t.Errorf("old and new sets beyond MaxBackends: %v", err)
	}
	if !equalViews(k.view(), viewOf([]Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, a, b)})) {
		t.Errorf("after a failed update the tables hold %v, want the old set", k.view())
	}

	// The kernel's table is smaller than Options say: E2BIG.
	lb, k = fakeLB(t, Options{})
	k.caps = [3]int{0, 2, 0}
	err = lb.SetFrontends([]Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, a, b, c)})
	if !errors.Is(err, ErrTableFull) || !strings.Contains(err.Error(), "backends") {
		t.Errorf("kernel table full: %v", err)
	}
	if len(k.be)+len(k.mem) != 0 || len(k.fe) != 0 {
		t.Errorf("a set that could not be written left %d backends, %d members, %d frontends", len(k.be), len(k.mem), len(k.fe))
	}
}

// TestSyncFaults runs random updates against a kernel whose writes fail
// now and then: every write keeps what programs see whole (the fake
// checks), the state mirrors the tables after every call, and a call
// without faults brings the tables to exactly what it asks for.
func TestSyncFaults(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var pool []Backend
	for i := range 12 {
		pool = append(pool, be(fmt.Sprintf("10.0.%d.%d", i/4, i%4+1), 8080))
	}
	random := func() []Frontend {
		var fes []Frontend
		for i := range rng.IntN(8) {
			f := fe(fmt.Sprintf("198.19.0.%d", i+1), 80, packet.ProtoTCP)
			for _, b := range pool {
				if rng.IntN(3) == 0 {
					f.Backends = append(f.Backends, b)
				}
			}
			f.Reject = rng.IntN(2) == 0
			if rng.IntN(3) == 0 {
				f.AffinityTimeout = time.Duration(rng.IntN(100)) * time.Second
			}
			fes = append(fes, f)
		}
		return fes
	}
	lb, k := fakeLB(t, Options{MaxFrontends: 8, MaxBackends: 200})
	failed := 0
	for round := range 300 {
		k.failEvery = 4 + round%13
		k.failGrace = round%17 == 0
		if err := lb.SetFrontends(random()); err != nil {
			failed++
		}
		for key, e := range lb.state.frontends {
			if k.fe[key] != e {
				t.Fatalf("round %d: state says %v is %+v, the table %+v", round, keyString(key), e, k.fe[key])
			}
		}
		if len(lb.state.frontends) != len(k.fe) {
			t.Fatalf("round %d: state has %d frontends, the table %d", round, len(lb.state.frontends), len(k.fe))
		}
	}
	if failed == 0 {
		t.Fatal("no call failed: the faults were not exercised")
	}
	k.failEvery, k.failGrace = 0, false
	final := random()
	if err := lb.SetFrontends(final); err != nil {
		t.Fatal(err)
	}
	if !equalViews(k.view(), viewOf(final)) {
		t.Fatalf("after the faults, tables %v\nwant %v", k.view(), viewOf(final))
	}
	// Nothing but the live sets is left.
	live := map[uint32]bool{}
	for _, e := range k.fe {
		live[e.Set] = e.Count > 0
	}
	for key := range k.be {
		if !live[key.Set] {
			t.Errorf("backend %+v of a dead set left behind", key)
		}
	}
	for key := range k.mem {
		if !live[key.Set] {
			t.Errorf("member %+v of a dead set left behind", key)
		}
	}
	t.Logf("%d of 300 calls failed; %d grace periods", failed, k.graces)
}

func TestCompileRejects(t *testing.T) {
	a := be("10.0.0.1", 80)
	six := be("fd00::1", 80)
	ok := fe("198.19.0.1", 80, packet.ProtoTCP, a)
	for _, c := range []struct {
		name string
		fes  []Frontend
		want string
	}{
		{"duplicate frontend", []Frontend{ok, ok}, "given twice"},
		{"SCTP", []Frontend{fe("198.19.0.1", 80, packet.ProtoSCTP, a)}, "only TCP and UDP"},
		{"no port", []Frontend{fe("198.19.0.1", 0, packet.ProtoTCP, a)}, "required"},
		{"backend of the other family", []Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, six)}, "other address family"},
		{"duplicate backend", []Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, a, a)}, "given twice"},
		{"backend without port", []Frontend{fe("198.19.0.1", 80, packet.ProtoTCP, be("10.0.0.2", 0))}, "required"},
		{"affinity without service id", []Frontend{{Addr: ok.Addr, Port: 80, Proto: packet.ProtoTCP, AffinityTimeout: time.Second}}, "ServiceID"},
		{"negative affinity", []Frontend{{Addr: ok.Addr, Port: 80, Proto: packet.ProtoTCP, ServiceID: 1, AffinityTimeout: -1}}, "negative"},
	} {
		lb, k := fakeLB(t, Options{})
		err := lb.SetFrontends(c.fes)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error about %q", c.name, err, c.want)
		}
		if k.writes != 0 {
			t.Errorf("%s: %d writes before the error", c.name, k.writes)
		}
	}
}

// A set id is not reused while orphan entries (deletes that failed) still
// carry it: their later deletion would take the new set's entries.
func TestSetIDsSkipOrphans(t *testing.T) {
	s := newState()
	s.nextSet = math.MaxUint32
	s.orphanMembers = []bpfMemberKey{{Set: math.MaxUint32}}
	s.sets[1] = &backendSet{id: 1}
	if id := s.newSetID(); id != 2 {
		t.Errorf("new set id %d, want 2 (MaxUint32 is an orphan's, 0 is none, 1 is taken)", id)
	}
}
