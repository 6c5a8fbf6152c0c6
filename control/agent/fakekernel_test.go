package agent

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/xdproxy/xdproxy/dataplane"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// A kernel just big enough for dataplane.Start without privileges: one
// interface whose queues receive nothing, sockets that can be made to
// hang, and tables that take whatever they are given. The engine's own
// tests have a fuller one (dataplane/kernel_fake_test.go), which a test
// package outside dataplane cannot import.

// fakeIface is the fake kernel's only interface.
const fakeIface = "fake0"

type fakeKernel struct {
	queues int
	tables *fakeTables

	mu    sync.Mutex
	socks map[int]*fakeSocket // by queue
}

func newFakeKernel(queues int) *fakeKernel {
	return &fakeKernel{queues: queues, tables: &fakeTables{}, socks: map[int]*fakeSocket{}}
}

// socket is the socket of queue, once the engine opened it.
func (k *fakeKernel) socket(queue int) *fakeSocket {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.socks[queue]
}

func (k *fakeKernel) Link(name string) (dataplane.Link, error) {
	if name != fakeIface {
		return dataplane.Link{}, errors.New("no such interface")
	}
	return dataplane.Link{Name: fakeIface, Index: 7, MAC: net.HardwareAddr{2, 0, 0, 0, 0, 7}, Queues: k.queues,
		Addrs: []packet.Addr{packet.MustParseAddr("192.0.2.1")}}, nil
}

func (k *fakeKernel) WatchLinks(func()) (func(), error) { return func() {}, nil }
func (k *fakeKernel) SetChannels(string, int) error     { return errors.New("fake kernel: no ethtool") }
func (k *fakeKernel) Attach(int, xdp.Mode) (dataplane.Attachment, error) {
	return fakeAttachment{}, nil
}
func (k *fakeKernel) AttachEgress(int) (dataplane.Attachment, error) { return fakeAttachment{}, nil }
func (k *fakeKernel) SetEgressRedirect(int) error                    { return nil }

func (k *fakeKernel) OpenSocket(_, queue int, _ afxdp.Config) (dataplane.Socket, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	s := &fakeSocket{}
	k.socks[queue] = s
	return s, nil
}

func (k *fakeKernel) ExceptionLink(string) (dataplane.Link, dataplane.Link, error) {
	return dataplane.Link{}, dataplane.Link{}, errors.New("fake kernel: no exception link")
}
func (k *fakeKernel) LocalPortRange() (conntrack.PortRange, error) {
	return conntrack.PortRange{First: 32768, Last: 60999}, nil
}
func (k *fakeKernel) ReservePorts(conntrack.PortRange) (bool, error) { return false, nil }
func (k *fakeKernel) ReservedPorts() ([]conntrack.PortRange, error)  { return nil, nil }
func (k *fakeKernel) Tables() dataplane.Tables                       { return k.tables }
func (k *fakeKernel) LocalClients() dataplane.LocalClients           { return nil }
func (k *fakeKernel) Resolver() dataplane.Resolver                   { return fakeResolver{} }
func (k *fakeKernel) Close() error                                   { return nil }
func (fakeResolver) Generation() uint64                              { return 0 }

func (fakeResolver) Resolve(packet.Addr) (dataplane.NextHop, packet.Reason) {
	return dataplane.NextHop{}, packet.OK
}

type fakeResolver struct{}

type fakeAttachment struct{}

func (fakeAttachment) RegisterSocket(int, int) error { return nil }
func (fakeAttachment) UnregisterSocket(int) error    { return nil }
func (fakeAttachment) Mode() xdp.Mode                { return xdp.Native }
func (fakeAttachment) Adopted() bool                 { return false }
func (fakeAttachment) Close() error                  { return nil }
func (fakeAttachment) Detach() error                 { return nil }

// fakeTables counts the times the XDP tables were programmed.
type fakeTables struct {
	mu   sync.Mutex
	sets int
}

func (t *fakeTables) SetTables([]xdp.Key, []packet.Addr) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.sets++
	return nil
}

func (t *fakeTables) programmed() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.sets
}

func (t *fakeTables) NewFlowWriter(int) dataplane.FlowWriter   { return fakeFlowWriter{} }
func (t *fakeTables) DeleteFlows([]xdp.FlowKey) error          { return nil }
func (t *fakeTables) ForEachFlow(func(xdp.FlowKey) bool) error { return nil }
func (t *fakeTables) Counters() (xdp.Counters, error)          { return xdp.Counters{}, nil }
func (t *fakeTables) SetSYNGuard(xdp.SYNGuard) error           { return nil }

type fakeFlowWriter struct{}

func (fakeFlowWriter) Add(xdp.FlowKey) bool { return true }
func (fakeFlowWriter) Flush() (int, error)  { return 0, nil }

// fakeSocket never receives a frame. hang makes its next Receive block,
// as a worker stuck in the kernel or in a loop would be, until released.
type fakeSocket struct {
	mu      sync.Mutex
	hung    chan struct{} // closed to release; nil: not hung
	entered chan struct{} // closed once Receive blocks
}

// hang makes the next Receive block; it returns a channel closed once the
// worker is stuck in it, and the release.
func (s *fakeSocket) hang() (stuck <-chan struct{}, release func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hung, s.entered = make(chan struct{}), make(chan struct{})
	hung := s.hung
	var once sync.Once
	return s.entered, func() {
		once.Do(func() {
			s.mu.Lock()
			s.hung = nil
			s.mu.Unlock()
			close(hung)
		})
	}
}

func (s *fakeSocket) Receive([]afxdp.Desc) int {
	s.mu.Lock()
	hung, entered := s.hung, s.entered
	s.mu.Unlock()
	if hung != nil {
		select {
		case <-entered:
		default:
			close(entered)
		}
		<-hung
	}
	return 0
}

func (s *fakeSocket) Frame(afxdp.Desc) []byte     { return nil }
func (s *fakeSocket) Transmit(d []afxdp.Desc) int { return len(d) }
func (s *fakeSocket) Complete() int               { return 0 }
func (s *fakeSocket) Refill() int                 { return 0 }
func (s *fakeSocket) Alloc() (afxdp.Desc, bool)   { return afxdp.Desc{}, false }
func (s *fakeSocket) Release(afxdp.Desc)          {}
func (s *fakeSocket) Drive() bool                 { return false }
func (s *fakeSocket) Stats() (afxdp.Stats, error) { return afxdp.Stats{}, nil }
func (s *fakeSocket) FD() int                     { return -1 }
func (s *fakeSocket) Close() error                { return nil }
func (s *fakeSocket) Wait(d time.Duration) (bool, error) {
	time.Sleep(d) // poll() on a queue where nothing arrives
	return false, nil
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// startFakeEngine runs the real engine on a fake kernel with queues
// queues on one interface, its workers unpinned.
func startFakeEngine(t testing.TB, queues int) (*dataplane.Engine, *fakeKernel) {
	t.Helper()
	k := newFakeKernel(queues)
	e, err := dataplane.Start(dataplane.EngineConfig{
		Kernel:            k,
		Interfaces:        []dataplane.InterfaceConfig{{Name: fakeIface, Mode: xdp.Native, Socket: afxdp.DefaultConfig()}},
		Conntrack:         conntrack.Config{Capacity: 1024},
		LinkCheckInterval: time.Hour,
		Log:               quietLog(),
	})
	if err != nil {
		t.Fatalf("starting the engine on a fake kernel: %v", err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e, k
}
