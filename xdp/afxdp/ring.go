package afxdp

import (
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ring is one of the four single-producer single-consumer rings shared with
// the kernel. The producer and consumer indexes live in the shared mapping
// and are read and written with atomics: the kernel writes one of them from
// another CPU, and the atomic load (acquire) or store (release) is what
// orders it against the descriptor slots. Each side keeps cached copies so a
// batch costs one atomic load and one atomic store, not one per descriptor.
//
// The indexes run freely over uint32 and wrap; slot i lives at i&mask.
type ring[T uint64 | Desc] struct {
	producer *uint32
	consumer *uint32
	flags    *uint32
	slots    []T
	mask     uint32
	size     uint32

	// For a ring we produce into (fill, TX): cachedProd is our producer
	// index, published by submit; cachedCons is the last consumer index we
	// read plus size, so cachedCons-cachedProd is the free room.
	// For a ring we consume from (RX, completion): cachedCons is our
	// consumer index, published by release; cachedProd is the last
	// producer index we read.
	cachedProd uint32
	cachedCons uint32

	mapping []byte
}

// mapRing maps one ring of the socket fd at pgoff and points the ring at
// the producer, consumer, flags and slot array that off describes.
func mapRing[T uint64 | Desc](r *ring[T], fd int, pgoff int64, off unix.XDPRingOffset, size int, producerSide bool) error {
	var zero T
	length := int(off.Desc) + size*int(unsafe.Sizeof(zero))
	mem, err := unix.Mmap(fd, pgoff, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	base := unsafe.Pointer(&mem[0])
	r.mapping = mem
	r.producer = (*uint32)(unsafe.Add(base, off.Producer))
	r.consumer = (*uint32)(unsafe.Add(base, off.Consumer))
	r.flags = (*uint32)(unsafe.Add(base, off.Flags))
	r.slots = unsafe.Slice((*T)(unsafe.Add(base, off.Desc)), size)
	r.size = uint32(size)
	r.mask = uint32(size - 1)
	r.cachedProd = atomic.LoadUint32(r.producer)
	r.cachedCons = atomic.LoadUint32(r.consumer)
	if producerSide {
		r.cachedCons += r.size
	}
	return nil
}

func (r *ring[T]) unmap() error {
	if r.mapping == nil {
		return nil
	}
	err := unix.Munmap(r.mapping)
	*r = ring[T]{}
	return err
}

// free returns how many slots a producer may fill now, at most n. It reads
// the kernel's consumer index only when the cached room is too small.
func (r *ring[T]) free(n uint32) uint32 {
	room := r.cachedCons - r.cachedProd
	if room >= n {
		return n
	}
	r.cachedCons = atomic.LoadUint32(r.consumer) + r.size
	room = r.cachedCons - r.cachedProd
	if room > n {
		return n
	}
	return room
}

// submit publishes n slots written after cachedProd. The atomic store
// orders the slot writes before the new producer index.
func (r *ring[T]) submit(n uint32) {
	r.cachedProd += n
	atomic.StoreUint32(r.producer, r.cachedProd)
}

// pending reports how many submitted slots the kernel has not consumed yet.
func (r *ring[T]) pending() uint32 {
	return r.cachedProd - r.consumed()
}

// consumed reads the kernel's consumer index of a ring we produce into.
func (r *ring[T]) consumed() uint32 { return atomic.LoadUint32(r.consumer) }

// available returns how many slots a consumer may read now, at most n. It
// reads the kernel's producer index only when the cached entries run out.
func (r *ring[T]) available(n uint32) uint32 {
	entries := r.cachedProd - r.cachedCons
	if entries == 0 {
		r.cachedProd = atomic.LoadUint32(r.producer)
		entries = r.cachedProd - r.cachedCons
	}
	if entries > n {
		return n
	}
	return entries
}

// release hands n read slots back to the kernel. The atomic store orders
// the slot reads before the new consumer index.
func (r *ring[T]) release(n uint32) {
	r.cachedCons += n
	atomic.StoreUint32(r.consumer, r.cachedCons)
}

// needsWakeup reports the kernel's XDP_RING_NEED_WAKEUP flag.
func (r *ring[T]) needsWakeup() bool {
	return atomic.LoadUint32(r.flags)&unix.XDP_RING_NEED_WAKEUP != 0
}
