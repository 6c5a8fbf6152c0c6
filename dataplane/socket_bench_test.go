package dataplane

import (
	"time"

	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// benchSocket is a Socket for benchmarks of the whole worker loop: rings
// and UMEM allocated once, nothing allocated, locked or copied per frame
// except what the kernel itself would copy. The benchmark plays the kernel:
// feed takes frames from the fill ring, writes packets into them and puts
// them on the RX ring; Transmit "sends" at once (the frames go straight to
// the completion ring). The fake in kernel_fake_test.go is for behaviour
// tests; it allocates and locks per frame.
type benchSocket struct {
	frameSize uint64
	umem      []byte

	free  []uint64 // stack; free[:nfree] are owned by nobody
	nfree int

	fill benchRing[uint64]
	rx   benchRing[afxdp.Desc]
	comp benchRing[uint64]

	sent uint64 // frames transmitted
}

// benchRing is a single-threaded ring of power-of-two size.
type benchRing[T any] struct {
	slots      []T
	mask       uint32
	prod, cons uint32
}

func newBenchRing[T any](n int) benchRing[T] {
	return benchRing[T]{slots: make([]T, n), mask: uint32(n - 1)}
}

func (r *benchRing[T]) len() int  { return int(r.prod - r.cons) }
func (r *benchRing[T]) room() int { return len(r.slots) - r.len() }
func (r *benchRing[T]) push(v T)  { r.slots[r.prod&r.mask] = v; r.prod++ }
func (r *benchRing[T]) pop() T    { v := r.slots[r.cons&r.mask]; r.cons++; return v }

// newBenchSocket has the shape of afxdp.DefaultConfig: 4096 frames of 2048
// bytes, 2048-slot rings.
func newBenchSocket() *benchSocket {
	const frames, frameSize, ring = 4096, 2048, 2048
	s := &benchSocket{
		frameSize: frameSize,
		umem:      make([]byte, frames*frameSize),
		free:      make([]uint64, frames),
		nfree:     frames,
		fill:      newBenchRing[uint64](ring),
		rx:        newBenchRing[afxdp.Desc](ring),
		comp:      newBenchRing[uint64](ring),
	}
	for i := range s.free {
		s.free[i] = uint64(i) * frameSize
	}
	return s
}

// feed receives n frames, as the kernel would: write(i, buf) writes the
// i-th frame into buf (a UMEM frame of full capacity) and returns its
// length. It returns how many it fed (fewer when the fill ring runs dry).
func (s *benchSocket) feed(n int, write func(i int, buf []byte) int) int {
	n = min(n, s.fill.len(), s.rx.room())
	for i := 0; i < n; i++ {
		addr := s.fill.pop()
		buf := s.umem[addr : addr+s.frameSize]
		l := write(i, buf)
		s.rx.push(afxdp.Desc{Addr: addr, Len: uint32(l)})
	}
	return n
}

func (s *benchSocket) Receive(descs []afxdp.Desc) int {
	n := min(len(descs), s.rx.len())
	for i := 0; i < n; i++ {
		descs[i] = s.rx.pop()
	}
	return n
}

func (s *benchSocket) Frame(d afxdp.Desc) []byte {
	end := d.Addr&^(s.frameSize-1) + s.frameSize
	return s.umem[d.Addr : d.Addr+uint64(d.Len) : end]
}

func (s *benchSocket) Transmit(descs []afxdp.Desc) int {
	n := min(len(descs), s.comp.room())
	for _, d := range descs[:n] {
		s.comp.push(d.Addr)
	}
	s.sent += uint64(n)
	return n
}

func (s *benchSocket) Complete() int {
	n := s.comp.len()
	for range n {
		s.push(s.comp.pop())
	}
	return n
}

func (s *benchSocket) Refill() int {
	n := min(s.nfree, s.fill.room())
	for range n {
		s.nfree--
		s.fill.push(s.free[s.nfree])
	}
	return n
}

func (s *benchSocket) Alloc() (afxdp.Desc, bool) {
	if s.nfree == 0 {
		return afxdp.Desc{}, false
	}
	s.nfree--
	return afxdp.Desc{Addr: s.free[s.nfree]}, true
}

func (s *benchSocket) Release(d afxdp.Desc) { s.push(d.Addr) }

func (s *benchSocket) push(addr uint64) {
	if s.nfree == len(s.free) {
		panic("bench socket: frame released twice")
	}
	s.free[s.nfree] = addr &^ (s.frameSize - 1)
	s.nfree++
}

func (s *benchSocket) Drive() bool { return s.rx.len() > 0 }

func (s *benchSocket) Wait(time.Duration) (bool, error) { return s.rx.len() > 0, nil }
func (s *benchSocket) Stats() (afxdp.Stats, error)      { return afxdp.Stats{}, nil }
func (s *benchSocket) FD() int                          { return -1 }
func (s *benchSocket) Close() error                     { return nil }
