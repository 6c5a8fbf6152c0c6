package dataplane

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// The fake kernel keeps everything in memory: links the test changes at
// will, sockets whose rings are slices, XDP tables that are sets. Its
// faults (fakeFaults) make chosen operations fail, so that the engine's
// and the workers' failure paths run in ordinary unprivileged tests.

// fakeFaults are the failures a fake kernel injects. Counters count down:
// n > 0 makes the next n calls fail.
type fakeFaults struct {
	mu          sync.Mutex
	setTables   int // SetTables fails
	attach      int // Attach fails
	openSocket  int // OpenSocket fails
	flowRoom    int // the flow table holds at most this many (0: no limit)
	txRingSlots int // a socket's TX ring holds this many (0: 64)
}

func (f *fakeFaults) take(n *int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if *n > 0 {
		*n--
		return true
	}
	return false
}

// fakeSocket is an AF_XDP socket whose rings are slices. The test plays
// the kernel: Inject puts a received frame on the RX ring (taking a frame
// the socket gave to the fill ring), Sent returns what was transmitted.
type fakeSocket struct {
	mu        sync.Mutex
	fd        int
	ifindex   int
	queue     int
	frameSize int
	umem      []byte
	free      []uint64
	fill      []uint64
	rx        []afxdp.Desc
	txRing    []afxdp.Desc // transmitted, not yet completed
	txSlots   int
	sent      [][]byte // copies of every transmitted frame
	closed    bool
	// hold makes Receive find nothing, so that a test can put several
	// frames on the RX ring for one batch.
	hold bool
	// wake tells a Wait that frames may have come.
	wake chan struct{}
}

// notify wakes a Wait.
func (s *fakeSocket) notify() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// setHold holds or releases received frames.
func (s *fakeSocket) setHold(h bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hold = h
	s.notify()
}

const fakeFrames = 256

func newFakeSocket(fd, ifindex, queue, frameSize, txSlots int) *fakeSocket {
	s := &fakeSocket{fd: fd, ifindex: ifindex, queue: queue, frameSize: frameSize,
		umem: make([]byte, fakeFrames*frameSize), txSlots: txSlots, wake: make(chan struct{}, 1)}
	for i := range fakeFrames {
		s.free = append(s.free, uint64(i*frameSize))
	}
	return s
}

// Inject delivers frame as if the NIC received it; false when the fill
// ring is empty (the kernel would drop it).
func (s *fakeSocket) Inject(frame []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.fill) == 0 || s.closed {
		return false
	}
	addr := s.fill[0]
	s.fill = s.fill[1:]
	copy(s.umem[addr:addr+uint64(s.frameSize)], frame)
	s.rx = append(s.rx, afxdp.Desc{Addr: addr, Len: uint32(len(frame))})
	s.notify()
	return true
}

// Sent returns and forgets the frames transmitted so far.
func (s *fakeSocket) Sent() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.sent
	s.sent = nil
	return out
}

// Held is how many frames are neither free, on the fill ring, nor in
// flight: frames a worker holds (and would leak if it forgot them).
func (s *fakeSocket) Held() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fakeFrames - len(s.free) - len(s.fill) - len(s.rx) - len(s.txRing)
}

func (s *fakeSocket) Receive(descs []afxdp.Desc) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hold {
		return 0
	}
	n := copy(descs, s.rx)
	s.rx = s.rx[n:]
	return n
}

func (s *fakeSocket) Frame(d afxdp.Desc) []byte {
	base := d.Addr - d.Addr%uint64(s.frameSize)
	return s.umem[d.Addr : d.Addr+uint64(d.Len) : base+uint64(s.frameSize)]
}

func (s *fakeSocket) Transmit(descs []afxdp.Desc) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(len(descs), s.txSlots-len(s.txRing))
	for _, d := range descs[:n] {
		s.txRing = append(s.txRing, d)
		s.sent = append(s.sent, slices.Clone(s.Frame(d)))
	}
	return n
}

func (s *fakeSocket) Complete() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.txRing)
	for _, d := range s.txRing {
		s.free = append(s.free, d.Addr-d.Addr%uint64(s.frameSize))
	}
	s.txRing = s.txRing[:0]
	return n
}

// fakeFillSlots is the fill ring's size: half the frames, as in the real
// sockets' defaults, so the other half stays free for transmitting.
const fakeFillSlots = fakeFrames / 2

func (s *fakeSocket) Refill() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(len(s.free), fakeFillSlots-len(s.fill))
	s.fill = append(s.fill, s.free[len(s.free)-n:]...)
	s.free = s.free[:len(s.free)-n]
	return n
}

func (s *fakeSocket) Alloc() (afxdp.Desc, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.free) == 0 {
		return afxdp.Desc{}, false
	}
	a := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	return afxdp.Desc{Addr: a}, true
}

func (s *fakeSocket) Release(d afxdp.Desc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := d.Addr - d.Addr%uint64(s.frameSize)
	if slices.Contains(s.free, a) {
		panic(fmt.Sprintf("fake socket: frame %d released twice", a))
	}
	s.free = append(s.free, a)
}

func (s *fakeSocket) Drive() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.rx) > 0 && !s.hold
}

// Wait blocks, like poll(), until frames come or timeout passes; it wakes
// only when Inject or setHold says so.
func (s *fakeSocket) Wait(timeout time.Duration) (bool, error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		if s.Drive() {
			return true, nil
		}
		select {
		case <-s.wake:
		case <-timer.C:
			return s.Drive(), nil
		}
	}
}

func (s *fakeSocket) Stats() (afxdp.Stats, error) { return afxdp.Stats{}, nil }
func (s *fakeSocket) FD() int                     { return s.fd }

func (s *fakeSocket) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return nil
}

type fakeAttachment struct {
	k       *fakeKernel
	ifindex int
	closed  bool
}

func (a *fakeAttachment) RegisterSocket(queue, fd int) error {
	a.k.mu.Lock()
	defer a.k.mu.Unlock()
	a.k.registered[[2]int{a.ifindex, queue}] = fd
	return nil
}

func (a *fakeAttachment) UnregisterSocket(queue int) error {
	a.k.mu.Lock()
	defer a.k.mu.Unlock()
	delete(a.k.registered, [2]int{a.ifindex, queue})
	return nil
}

func (a *fakeAttachment) Mode() xdp.Mode { return xdp.Native }
func (a *fakeAttachment) Adopted() bool  { return false }
func (a *fakeAttachment) Detach() error  { return a.Close() }

func (a *fakeAttachment) Close() error {
	a.k.mu.Lock()
	defer a.k.mu.Unlock()
	a.closed = true
	delete(a.k.attached, a.ifindex)
	return nil
}

// fakeTables are the XDP tables as sets.
type fakeTables struct {
	k         *fakeKernel
	mu        sync.Mutex
	frontends []xdp.Key
	vips      []packet.Addr
	flows     map[xdp.FlowKey]bool
	sets      int
	counters  xdp.Counters // what Counters reports; tests set it
	synGuard  xdp.SYNGuard // the last SetSYNGuard
	// beforeDelete and afterDelete, when set, run at the start and at
	// the end of DeleteFlows, outside mu: a test's way to act between a
	// caller's decision to delete and the delete, and to know it is done.
	beforeDelete, afterDelete func(keys []xdp.FlowKey)
}

func (t *fakeTables) SetTables(frontends []xdp.Key, vips []packet.Addr) error {
	if t.k.faults.take(&t.k.faults.setTables) {
		return errors.New("fake: SetTables refused")
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.frontends, t.vips = slices.Clone(frontends), slices.Clone(vips)
	t.sets++
	return nil
}

func (t *fakeTables) NewFlowWriter(n int) FlowWriter { return &fakeFlowWriter{t: t, max: n} }

func (t *fakeTables) DeleteFlows(keys []xdp.FlowKey) error {
	t.mu.Lock()
	before, after := t.beforeDelete, t.afterDelete
	t.mu.Unlock()
	if before != nil {
		before(keys)
	}
	t.mu.Lock()
	for _, k := range keys {
		delete(t.flows, k)
	}
	t.mu.Unlock()
	if after != nil {
		after(keys)
	}
	return nil
}

func (t *fakeTables) ForEachFlow(fn func(xdp.FlowKey) bool) error {
	t.mu.Lock()
	keys := make([]xdp.FlowKey, 0, len(t.flows))
	for k := range t.flows {
		keys = append(keys, k)
	}
	t.mu.Unlock()
	for _, k := range keys {
		if !fn(k) {
			break
		}
	}
	return nil
}

func (t *fakeTables) Counters() (xdp.Counters, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.counters, nil
}

func (t *fakeTables) SetSYNGuard(g xdp.SYNGuard) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.synGuard = g
	return nil
}

func (t *fakeTables) hasFlow(k xdp.FlowKey) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.flows[k]
}

type fakeFlowWriter struct {
	t   *fakeTables
	max int
	buf []xdp.FlowKey
}

func (w *fakeFlowWriter) Add(k xdp.FlowKey) bool {
	if len(w.buf) == w.max {
		return false
	}
	w.buf = append(w.buf, k)
	return true
}

func (w *fakeFlowWriter) Flush() (int, error) {
	w.t.mu.Lock()
	defer w.t.mu.Unlock()
	defer func() { w.buf = w.buf[:0] }()
	room := w.t.k.faults.flowRoom
	for i, k := range w.buf {
		if room > 0 && len(w.t.flows) >= room && !w.t.flows[k] {
			return i, errors.New("fake: flow table full")
		}
		w.t.flows[k] = true
	}
	return len(w.buf), nil
}

// fakeResolver routes by exact destination; anything else has no route.
// A destination marked unresolved has a route but no neighbour yet.
type fakeResolver struct {
	mu         sync.Mutex
	hops       map[packet.Addr]NextHop
	unresolved map[packet.Addr]bool
	gen        atomic.Uint64
}

func (r *fakeResolver) Generation() uint64 { return r.gen.Load() }

func (r *fakeResolver) Resolve(dst packet.Addr) (NextHop, packet.Reason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.unresolved[dst] {
		h := r.hops[dst]
		return NextHop{Ifindex: h.Ifindex, Src: h.Src}, packet.DropNeighbor
	}
	if h, ok := r.hops[dst]; ok {
		return h, packet.OK
	}
	return NextHop{}, packet.DropNoRoute
}

// setUnresolved marks dst as having no neighbour entry.
func (r *fakeResolver) setUnresolved(dst packet.Addr) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.unresolved == nil {
		r.unresolved = map[packet.Addr]bool{}
	}
	r.unresolved[dst] = true
	r.gen.Add(1)
}

func (r *fakeResolver) set(dst packet.Addr, h NextHop) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hops[dst] = h
	r.gen.Add(1)
}

// fakeKernel is a Kernel in memory.
type fakeKernel struct {
	mu         sync.Mutex
	links      map[string]Link
	nextIndex  int
	attached   map[int]*fakeAttachment
	registered map[[2]int]int // (ifindex, queue) -> fd
	sockets    map[[2]int]*fakeSocket
	nextFD     int
	watchers   []func()
	tables     *fakeTables
	resolver   *fakeResolver
	faults     fakeFaults
	closed     bool
	ephemeral  conntrack.PortRange
	// egressRedirect is where the egress programs send caught replies.
	egressRedirect int
	local          *fakeLocalClients // nil: no local clients
	reserved       []conntrack.PortRange
}

func newFakeKernel() *fakeKernel {
	k := &fakeKernel{links: map[string]Link{}, nextIndex: 1, attached: map[int]*fakeAttachment{},
		registered: map[[2]int]int{}, sockets: map[[2]int]*fakeSocket{}, nextFD: 100,
		resolver:  &fakeResolver{hops: map[packet.Addr]NextHop{}},
		ephemeral: conntrack.PortRange{First: 32768, Last: 60999}}
	k.tables = &fakeTables{k: k, flows: map[xdp.FlowKey]bool{}}
	return k
}

// addLink creates an interface and returns it.
func (k *fakeKernel) addLink(name string, queues int, addrs ...string) Link {
	k.mu.Lock()
	l := Link{Name: name, Index: k.nextIndex, Queues: queues,
		MAC: net.HardwareAddr{2, 0, 0, 0, 0, byte(k.nextIndex)}}
	k.nextIndex++
	for _, a := range addrs {
		l.Addrs = append(l.Addrs, packet.MustParseAddr(a))
	}
	k.links[name] = l
	k.mu.Unlock()
	k.notify()
	return l
}

// setMTU changes an interface's MTU.
func (k *fakeKernel) setMTU(name string, mtu int) {
	k.mu.Lock()
	l := k.links[name]
	l.MTU = mtu
	k.links[name] = l
	k.mu.Unlock()
	k.notify()
}

func (k *fakeKernel) deleteLink(name string) {
	k.mu.Lock()
	l := k.links[name]
	delete(k.links, name)
	delete(k.attached, l.Index)
	for key, s := range k.sockets {
		if key[0] == l.Index {
			delete(k.sockets, key)
			delete(k.registered, key)
			s.Close()
		}
	}
	k.mu.Unlock()
	k.notify()
}

// setQueues changes the channel count behind the engine's back, as
// ethtool -L does; like the kernel it refuses to remove a queue that has
// a socket.
func (k *fakeKernel) setQueues(name string, n int) error {
	k.mu.Lock()
	l, ok := k.links[name]
	if !ok {
		k.mu.Unlock()
		return ErrNoLink
	}
	for key, s := range k.sockets {
		if key[0] == l.Index && key[1] >= n && !s.closed {
			k.mu.Unlock()
			return fmt.Errorf("fake: queue %d has an AF_XDP socket", key[1])
		}
	}
	l.Queues = n
	k.links[name] = l
	k.mu.Unlock()
	k.notify()
	return nil
}

func (k *fakeKernel) notify() {
	k.mu.Lock()
	ws := slices.Clone(k.watchers)
	k.mu.Unlock()
	for _, w := range ws {
		w()
	}
}

func (k *fakeKernel) socket(ifindex, queue int) *fakeSocket {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.sockets[[2]int{ifindex, queue}]
}

func (k *fakeKernel) Link(name string) (Link, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	l, ok := k.links[name]
	if !ok {
		return Link{}, fmt.Errorf("%w: %s", ErrNoLink, name)
	}
	l.Addrs = slices.Clone(l.Addrs)
	return l, nil
}

func (k *fakeKernel) WatchLinks(changed func()) (func(), error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.watchers = append(k.watchers, changed)
	return func() {}, nil
}

func (k *fakeKernel) SetChannels(name string, queues int) error { return k.setQueues(name, queues) }

func (k *fakeKernel) Attach(ifindex int, mode xdp.Mode) (Attachment, error) {
	if k.faults.take(&k.faults.attach) {
		return nil, errors.New("fake: attach refused")
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.attached[ifindex]; ok {
		return nil, xdp.ErrBusy
	}
	a := &fakeAttachment{k: k, ifindex: ifindex}
	k.attached[ifindex] = a
	return a, nil
}

func (k *fakeKernel) AttachEgress(ifindex int) (Attachment, error) {
	return &fakeAttachment{k: k, ifindex: -ifindex}, nil
}

func (k *fakeKernel) SetEgressRedirect(ifindex int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.egressRedirect = ifindex
	return nil
}

func (k *fakeKernel) OpenSocket(ifindex, queue int, cfg afxdp.Config) (Socket, error) {
	if k.faults.take(&k.faults.openSocket) {
		return nil, errors.New("fake: socket refused")
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	var l Link
	for _, c := range k.links {
		if c.Index == ifindex {
			l = c
		}
	}
	if l.Index == 0 || queue >= l.Queues {
		return nil, fmt.Errorf("fake: no queue %d on ifindex %d", queue, ifindex)
	}
	key := [2]int{ifindex, queue}
	if s, ok := k.sockets[key]; ok && !s.closed {
		return nil, fmt.Errorf("fake: queue %d of ifindex %d busy", queue, ifindex)
	}
	slots := k.faults.txRingSlots
	if slots == 0 {
		slots = 64
	}
	s := newFakeSocket(k.nextFD, ifindex, queue, cfg.FrameSize, slots)
	k.nextFD++
	k.sockets[key] = s
	return s, nil
}

func (k *fakeKernel) ExceptionLink(name string) (Link, Link, error) {
	ke, err := k.Link(name)
	if err != nil {
		ke = k.addLink(name, 1)
	}
	xe, err := k.Link(xdproxyEndName(name))
	if err != nil {
		xe = k.addLink(xdproxyEndName(name), 1)
	}
	return ke, xe, nil
}

func (k *fakeKernel) LocalPortRange() (conntrack.PortRange, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.ephemeral, nil
}

func (k *fakeKernel) ReservePorts(r conntrack.PortRange) (bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reserved = append(k.reserved, r)
	return true, nil
}

func (k *fakeKernel) ReservedPorts() ([]conntrack.PortRange, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.reserved), nil
}

func (k *fakeKernel) Tables() Tables { return k.tables }

func (k *fakeKernel) LocalClients() LocalClients {
	if k.local == nil {
		return nil
	}
	return k.local
}

// fakeLocalClients records what the engine gives the socket programs.
type fakeLocalClients struct {
	mu        sync.Mutex
	cgroup    string
	frontends []socklb.Frontend
	sets      int
}

func (l *fakeLocalClients) Attach(cgroup string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cgroup = cgroup
	return nil
}

func (l *fakeLocalClients) SetFrontends(fes []socklb.Frontend) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.frontends = slices.Clone(fes)
	l.sets++
	return nil
}

// Counters counts every SetFrontends as a translation: enough to see the
// engine read them.
func (l *fakeLocalClients) Counters() (socklb.Counters, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return socklb.Counters{Translated: uint64(l.sets)}, nil
}

func (l *fakeLocalClients) Close() error  { return nil }
func (l *fakeLocalClients) Detach() error { return nil }
func (k *fakeKernel) Resolver() Resolver  { return k.resolver }

func (k *fakeKernel) Close() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.closed = true
	return nil
}
