package socklb

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Backend is where a frontend's connections go: a pod's (or a node's)
// address and the service's target port.
type Backend struct {
	Addr packet.Addr
	Port uint16
}

func (b Backend) String() string { return netip.AddrPortFrom(b.Addr.Netip(), b.Port).String() }

// Frontend is one address, port and protocol of a service that local
// clients connect to: a cluster IP, an external or load-balancer IP, or a
// NodePort on a node address or 127.0.0.1.
type Frontend struct {
	Addr  packet.Addr
	Port  uint16
	Proto packet.Proto // TCP or UDP

	// ServiceID keys session affinity: frontends of one service port
	// (its cluster IP, its NodePorts...) share it, so a client keeps its
	// backend whichever of them it uses. It must stay the same across
	// SetFrontends calls, and be nonzero with AffinityTimeout.
	ServiceID uint64
	// Backends, all of the frontend's address family, each at most once.
	// Order does not matter: every connect picks one uniformly at random.
	Backends []Backend
	// AffinityTimeout > 0 is ClientIP session affinity: the connects of
	// one client network namespace to the service within the timeout
	// (counted from its last connect) reach the same backend while that
	// backend stays in Backends. Rounded up to whole seconds.
	AffinityTimeout time.Duration
	// Reject says what a connect or send does when Backends is empty:
	// with Reject it fails with ECONNREFUSED (kube-proxy's reject),
	// without it with EPERM (kube-proxy would have dropped the packet;
	// the hook cannot make the client time out). Ignored with backends.
	Reject bool
}

func (f Frontend) String() string {
	return fmt.Sprintf("%v %v", f.Proto, Backend{f.Addr, f.Port})
}

// ErrTableFull is returned, wrapped with the table's name and sizes, when
// SetFrontends needs more entries than Options allowed.
var ErrTableFull = errors.New("socklb: table full")

// Frontend flags; the values of enum frontend_flag in bpf/socklb.c.
const (
	flagReject   = 1
	flagNodeOnly = 2
)

// table is what SetFrontends needs of a map; *ebpf.Map is one, tests give
// fakes and faulty ones.
type table interface {
	Put(key, value any) error
	Delete(key any) error
}

// tables are the kernel side of SetFrontends.
type tables struct {
	frontends, backends, members table
	// grace returns once no program can still be running with what it
	// read from the tables before the call.
	grace func() error
}

// backendSet is an immutable list of backends in the tables: entries
// (id, i) of backends and (id, endpoint) of members. Frontends with the
// same backends share one.
type backendSet struct {
	id       uint32
	backends []bpfEndpoint // sorted
	content  string        // the bytes of backends: the dedupe key
	refs     int           // frontend entries that point at it
}

// state mirrors what the tables hold, so that SetFrontends writes only
// differences. It is updated after every successful write, so it stays
// exact when a call fails halfway.
type state struct {
	frontends map[bpfFrontendKey]bpfFrontend
	sets      map[uint32]*backendSet
	byContent map[string]*backendSet
	entries   int // backends (and members) entries of all sets
	nextSet   uint32
	// orphans are entries no set accounts for (a write that failed
	// halfway, or found on adoption): deleted by the next sync.
	orphanBackends []bpfBackendKey
	orphanMembers  []bpfMemberKey
}

func newState() *state {
	return &state{
		frontends: map[bpfFrontendKey]bpfFrontend{},
		sets:      map[uint32]*backendSet{},
		byContent: map[string]*backendSet{},
		nextSet:   1,
	}
}

// want is a frontend as the tables will hold it.
type want struct {
	entry    bpfFrontend // Set filled in once the set exists
	backends []bpfEndpoint
	content  string
}

// compile checks fes and converts them to table entries.
func compile(fes []Frontend, maxBackends int) (map[bpfFrontendKey]*want, error) {
	out := make(map[bpfFrontendKey]*want, len(fes))
	for _, f := range fes {
		if f.Addr.IsZero() || f.Port == 0 {
			return nil, fmt.Errorf("socklb: frontend %v: address and port are required", f)
		}
		if f.Proto != packet.ProtoTCP && f.Proto != packet.ProtoUDP {
			return nil, fmt.Errorf("socklb: frontend %v: only TCP and UDP are translated", f)
		}
		key := bpfFrontendKey{Addr: f.Addr, Port: networkOrder16(f.Port), Proto: uint8(f.Proto)}
		if _, dup := out[key]; dup {
			return nil, fmt.Errorf("socklb: frontend %v given twice", f)
		}
		if f.AffinityTimeout < 0 {
			return nil, fmt.Errorf("socklb: frontend %v: negative affinity timeout", f)
		}
		secs := (f.AffinityTimeout + time.Second - 1) / time.Second
		if secs > math.MaxUint32 {
			return nil, fmt.Errorf("socklb: frontend %v: affinity timeout %v too long", f, f.AffinityTimeout)
		}
		if secs > 0 && f.ServiceID == 0 {
			return nil, fmt.Errorf("socklb: frontend %v: affinity needs a ServiceID", f)
		}
		if len(f.Backends) > maxBackends {
			return nil, fmt.Errorf("%w: frontend %v has %d backends, MaxBackends is %d", ErrTableFull, f, len(f.Backends), maxBackends)
		}
		w := &want{entry: bpfFrontend{
			ServiceId: f.ServiceID,
			Count:     uint32(len(f.Backends)),
			AffinityS: uint32(secs),
		}}
		if f.Reject {
			w.entry.Flags |= flagReject
		}
		if f.Addr.Netip().IsLoopback() {
			w.entry.Flags |= flagNodeOnly
		}
		for _, b := range f.Backends {
			if b.Addr.IsZero() || b.Port == 0 {
				return nil, fmt.Errorf("socklb: frontend %v: backend %v: address and port are required", f, b)
			}
			if b.Addr.Is4() != f.Addr.Is4() {
				return nil, fmt.Errorf("socklb: frontend %v: backend %v is of the other address family", f, b)
			}
			w.backends = append(w.backends, bpfEndpoint{Addr: b.Addr, Port: networkOrder16(b.Port)})
		}
		slices.SortFunc(w.backends, compareEndpoints)
		for i := 1; i < len(w.backends); i++ {
			if w.backends[i] == w.backends[i-1] {
				return nil, fmt.Errorf("socklb: frontend %v: backend %v given twice", f, endpointString(w.backends[i]))
			}
		}
		w.content = setContent(w.backends)
		out[key] = w
	}
	return out, nil
}

func compareEndpoints(a, b bpfEndpoint) int {
	if c := bytes.Compare(a.Addr[:], b.Addr[:]); c != 0 {
		return c
	}
	return int(hostOrder16(a.Port)) - int(hostOrder16(b.Port))
}

func setContent(eps []bpfEndpoint) string {
	b := make([]byte, 0, len(eps)*18)
	for _, e := range eps {
		b = append(b, e.Addr[:]...)
		b = binary.BigEndian.AppendUint16(b, hostOrder16(e.Port))
	}
	return string(b)
}

func endpointString(e bpfEndpoint) string {
	return Backend{Addr: e.Addr, Port: hostOrder16(e.Port)}.String()
}

// SetFrontends makes the tables hold exactly fes, writing only what
// changed, in an order that never shows a program a half-written service:
//
//  1. the backends and members of every backend set that is new (a
//     frontend's backends changed, or it is new);
//  2. the frontend entries that are new or changed, each in one update
//     that swaps in its set and count together;
//  3. the deletion of stale frontends;
//  4. once no program can still be reading them (an RCU grace period),
//     the deletion of the sets no frontend points at any more.
//
// So a connect that starts after SetFrontends returned never reaches a
// backend that fes does not list. Only when the frontends table cannot
// hold the old and new entries together are stale frontends deleted
// first. An error names the table; the tables then hold a mix of old and
// new frontends, each of them whole, and the next call repairs them.
// Calls are serialised.
func (lb *LB) SetFrontends(fes []Frontend) error {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	if lb.state == nil {
		return errors.New("socklb: LB is closed")
	}
	return lb.state.sync(lb.t, fes, lb.opts)
}

func (s *state) sync(t tables, fes []Frontend, opts Options) error {
	wants, err := compile(fes, opts.MaxBackends)
	if err != nil {
		return err
	}
	// 1. New backend sets.
	for _, w := range wants {
		if w.entry.Count == 0 {
			continue
		}
		set := s.byContent[w.content]
		if set == nil {
			if set, err = s.writeSet(t, w.backends, w.content, opts.MaxBackends); err != nil {
				return errors.Join(err, s.collect(t))
			}
		}
		w.entry.Set = set.id
	}
	// 2. New and changed frontends, 3. stale ones; stale ones first
	// only if both do not fit.
	union := len(s.frontends)
	for k := range wants {
		if _, ok := s.frontends[k]; !ok {
			union++
		}
	}
	if union > opts.MaxFrontends {
		if len(wants) > opts.MaxFrontends {
			err := fmt.Errorf("%w: frontends: %d wanted, MaxFrontends is %d", ErrTableFull, len(wants), opts.MaxFrontends)
			return errors.Join(err, s.collect(t))
		}
		if err := s.deleteStale(t, wants); err != nil {
			return errors.Join(err, s.collect(t))
		}
	}
	errWrite := s.writeFrontends(t, wants, opts.MaxFrontends)
	errStale := s.deleteStale(t, wants)
	// 4. Sets nothing points at, after a grace period.
	return errors.Join(errWrite, errStale, s.collect(t))
}

// writeSet writes a new backend set. On error it deletes what it wrote.
func (s *state) writeSet(t tables, eps []bpfEndpoint, content string, limit int) (*backendSet, error) {
	used := s.entries + max(len(s.orphanBackends), len(s.orphanMembers))
	if used+len(eps) > limit {
		return nil, fmt.Errorf("%w: backends: %d entries in use (old and new sets), %d more needed, MaxBackends is %d",
			ErrTableFull, used, len(eps), limit)
	}
	set := &backendSet{id: s.newSetID(), backends: eps, content: content}
	var err error
	var wroteB, wroteM int
	for i, e := range eps {
		if err = t.backends.Put(bpfBackendKey{Set: set.id, Index: uint32(i)}, e); err != nil {
			err = tableError("backends", err, limit)
			break
		}
		wroteB++
	}
	if err == nil {
		for i, e := range eps {
			if err = t.members.Put(bpfMemberKey{Set: set.id, Ep: e}, uint32(i)); err != nil {
				err = tableError("members", err, limit)
				break
			}
			wroteM++
		}
	}
	if err != nil {
		// Nothing points at the set yet: no grace period needed.
		for i := range wroteB {
			k := bpfBackendKey{Set: set.id, Index: uint32(i)}
			if t.backends.Delete(k) != nil {
				s.orphanBackends = append(s.orphanBackends, k)
			}
		}
		for i := range wroteM {
			k := bpfMemberKey{Set: set.id, Ep: eps[i]}
			if t.members.Delete(k) != nil {
				s.orphanMembers = append(s.orphanMembers, k)
			}
		}
		return nil, err
	}
	s.sets[set.id] = set
	s.byContent[content] = set
	s.entries += len(eps)
	return set, nil
}

// newSetID returns an id that no set and no orphan entry in the tables
// has; 0 means "no set".
func (s *state) newSetID() uint32 {
	for {
		id := s.nextSet
		s.nextSet++
		if s.nextSet == 0 {
			s.nextSet = 1
		}
		if _, used := s.sets[id]; !used && id != 0 && !s.orphaned(id) {
			return id
		}
	}
}

// orphaned reports whether an orphan entry has set id. Orphans are rare:
// a scan is fine.
func (s *state) orphaned(id uint32) bool {
	for _, k := range s.orphanBackends {
		if k.Set == id {
			return true
		}
	}
	for _, k := range s.orphanMembers {
		if k.Set == id {
			return true
		}
	}
	return false
}

func (s *state) writeFrontends(t tables, wants map[bpfFrontendKey]*want, limit int) error {
	for k, w := range wants {
		old, had := s.frontends[k]
		if had && old == w.entry {
			continue
		}
		if err := t.frontends.Put(k, w.entry); err != nil {
			return fmt.Errorf("frontend %v: %w", keyString(k), tableError("frontends", err, limit))
		}
		if had {
			s.unref(old)
		}
		s.ref(w.entry)
		s.frontends[k] = w.entry
	}
	return nil
}

func (s *state) deleteStale(t tables, wants map[bpfFrontendKey]*want) error {
	var errs []error
	for k, old := range s.frontends {
		if _, keep := wants[k]; keep {
			continue
		}
		if err := t.frontends.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("socklb: deleting frontend %v: %w", keyString(k), err))
			continue
		}
		s.unref(old)
		delete(s.frontends, k)
	}
	return errors.Join(errs...)
}

func (s *state) ref(e bpfFrontend) {
	if e.Count > 0 {
		s.sets[e.Set].refs++
	}
}

func (s *state) unref(e bpfFrontend) {
	if e.Count > 0 {
		s.sets[e.Set].refs--
	}
}

// collect deletes the sets no frontend points at and the orphans, after
// a grace period: a program that read a frontend entry before it was
// replaced may still be reading its old set until then.
func (s *state) collect(t tables) error {
	var dead []*backendSet
	for _, set := range s.sets {
		if set.refs == 0 {
			dead = append(dead, set)
		}
	}
	if len(dead) == 0 && len(s.orphanBackends) == 0 && len(s.orphanMembers) == 0 {
		return nil
	}
	if err := t.grace(); err != nil {
		return err
	}
	var errs []error
	for _, set := range dead {
		for i, e := range set.backends {
			if err := t.backends.Delete(bpfBackendKey{Set: set.id, Index: uint32(i)}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, fmt.Errorf("socklb: deleting backend of set %d: %w", set.id, err))
				s.orphanBackends = append(s.orphanBackends, bpfBackendKey{Set: set.id, Index: uint32(i)})
			}
			if err := t.members.Delete(bpfMemberKey{Set: set.id, Ep: e}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, fmt.Errorf("socklb: deleting member of set %d: %w", set.id, err))
				s.orphanMembers = append(s.orphanMembers, bpfMemberKey{Set: set.id, Ep: e})
			}
		}
		delete(s.sets, set.id)
		if s.byContent[set.content] == set {
			delete(s.byContent, set.content)
		}
		s.entries -= len(set.backends)
	}
	// Orphans failed before (or came with adopted tables): retry them.
	ob, om := s.orphanBackends, s.orphanMembers
	s.orphanBackends, s.orphanMembers = nil, nil
	for _, k := range ob {
		if err := t.backends.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			s.orphanBackends = append(s.orphanBackends, k)
			errs = append(errs, fmt.Errorf("socklb: deleting backend of set %d: %w", k.Set, err))
		}
	}
	for _, k := range om {
		if err := t.members.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			s.orphanMembers = append(s.orphanMembers, k)
			errs = append(errs, fmt.Errorf("socklb: deleting member of set %d: %w", k.Set, err))
		}
	}
	return errors.Join(errs...)
}

// tableError names the table in a write error, and reports a full hash
// table (E2BIG) as ErrTableFull.
func tableError(name string, err error, limit int) error {
	if errors.Is(err, unix.E2BIG) {
		return fmt.Errorf("%w: %s (limit %d): %v", ErrTableFull, name, limit, err)
	}
	return fmt.Errorf("socklb: writing %s: %w", name, err)
}

func keyString(k bpfFrontendKey) string {
	return fmt.Sprintf("%v %v", packet.Proto(k.Proto), endpointString(bpfEndpoint{Addr: k.Addr, Port: k.Port}))
}

// networkOrder16 returns the uint16 whose in-memory bytes are v in big
// endian, which is how the programs see ports.
func networkOrder16(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// hostOrder16 undoes networkOrder16.
func hostOrder16(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}
