package xdp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/cpu"
)

// replySlots is the Go side of the program's reply_slots table (see
// bpf/xdp.c): reply tuples that workers write straight into the map's
// memory, mapped into the process, with atomic stores and no system call.
// A hash map update costs a system call per batch and, on this project's
// machines, about 600 ns of kernel time per entry (BenchmarkFlush); a way
// of a set costs a few stores. The table is set-associative, replyWays
// tuples per set, the states and tags of a set's ways in its first cache
// line; a tuple whose set is full goes to the flows hash map as before, so
// nothing is refused that the hash map would take.
//
// Element 0 is the header: magic, the seed of the set hash, the set mask.
// The seed is random per table, so that nobody who does not know it can
// aim tuples at one set (they would only push later tuples into the hash
// map). A pinned table keeps its header, so the next process finds every
// tuple where the program looks for it.
//
// Way states: empty, busy (a writer claimed it and is writing the key),
// live (with the tuple's tag). Writers claim an empty way with a
// compare-and-swap, so several workers and the janitor may write at once.
// A reader in the program that meets a way while its key is rewritten may
// match a torn key; the frame then reaches a worker, which finds no flow
// for it and hands it to the kernel, as it does every frame that turns out
// not to be ours.
type replySlots struct {
	// closed is set before the memory is unmapped: a FlowWriter or a
	// deletion that comes after Close fails instead of faulting.
	closed atomic.Bool
	mem    []byte
	sets   []bpfReplySet // over mem; sets[0] is the header
	seed   uint32
	mask   uint32 // len(sets) - 2
}

const (
	replyWays  = 4
	replyEmpty = 0
	replyBusy  = 1
	replyLive  = 2
	replyMagic = 0x32594c5052445858 // "XXDRPLY2" little-endian
	replySalt  = 0x9e3779b9
)

// replySets is the number of sets of a table beside a flows map of
// maxFlows entries: a power of two, with room for at least maxFlows
// tuples (192 bytes a set, 48 a tuple). xdproxy sizes maxFlows at twice
// its connection table, so with the connection table full (as a flood
// keeps it) a set holds two tuples on average and about 4% of the tuples
// find their set full (a Poisson draw); with it half full, under 0.5%.
func replySets(maxFlows int) int {
	sets := 1
	for sets*replyWays < maxFlows {
		sets <<= 1
	}
	return sets
}

// replySlotCount is the map's max_entries for sets sets: the header and
// the sets.
func replySlotCount(sets int) int { return 1 + sets }

// openReplySlots maps m, a reply_slots table of sets sets. A table an
// earlier process pinned (adopted) keeps its header and its tuples, unless
// the header does not describe this layout; ways a writer that died left
// busy are emptied.
func openReplySlots(m *ebpf.Map, sets int, adopted bool) (*replySlots, error) {
	n := replySlotCount(sets)
	size := n * int(unsafe.Sizeof(bpfReplySet{}))
	page := os.Getpagesize()
	mem, err := unix.Mmap(m.FD(), 0, (size+page-1)/page*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", bpfMapReplySlots, err)
	}
	r := &replySlots{mem: mem, sets: unsafe.Slice((*bpfReplySet)(unsafe.Pointer(&mem[0])), n), mask: uint32(sets - 1)}
	hdr := &r.sets[0].Tag
	if adopted && atomic.LoadUint64(&hdr[0]) == replyMagic && atomic.LoadUint64(&hdr[2]) == uint64(r.mask) {
		r.seed = uint32(atomic.LoadUint64(&hdr[1]))
		for i := 1; i < n; i++ {
			for w := range replyWays {
				if atomic.LoadUint64(&r.sets[i].Tag[w]) == replyBusy {
					atomic.StoreUint64(&r.sets[i].Tag[w], replyEmpty)
				}
			}
		}
		return r, nil
	}
	// New, or of another layout: start empty. The program ignores the
	// table while the magic is missing.
	atomic.StoreUint64(&hdr[0], 0)
	for i := 1; i < n; i++ {
		for w := range replyWays {
			atomic.StoreUint64(&r.sets[i].Tag[w], replyEmpty)
		}
	}
	var seed [4]byte
	if _, err := rand.Read(seed[:]); err != nil {
		r.close()
		return nil, err
	}
	r.seed = binary.LittleEndian.Uint32(seed[:])
	atomic.StoreUint64(&hdr[1], uint64(r.seed))
	atomic.StoreUint64(&hdr[2], uint64(r.mask))
	atomic.StoreUint64(&hdr[0], replyMagic)
	return r, nil
}

// close unmaps the table. Nothing may use it at the same time or after:
// Objects.Close is for when the workers, the janitor and the reconciler
// have stopped (Engine.Close waits for them); closed only turns a later
// use into an error.
func (r *replySlots) close() error {
	if r == nil || r.mem == nil {
		return nil
	}
	r.closed.Store(true)
	err := unix.Munmap(r.mem)
	r.mem, r.sets = nil, nil
	return err
}

// errClosed is what a use of the tables after Objects.Close returns.
var errClosed = errors.New("xdp: the tables are closed")

// usable reports whether r is there and open.
func (r *replySlots) usable() bool { return r != nil && !r.closed.Load() }

// slotKey is a flow key as the words a way stores.
type slotKey [5]uint64

func slotKeyOf(k *bpfFlowKey) slotKey {
	var q slotKey
	*(*bpfFlowKey)(unsafe.Pointer(&q)) = *k
	return q
}

func (q *slotKey) flowKey() bpfFlowKey { return *(*bpfFlowKey)(unsafe.Pointer(q)) }

// locate returns q's set and the word its live ways hold: its tag with
// state live.
func (r *replySlots) locate(q *slotKey) (*bpfReplySet, uint64) {
	words := (*[10]uint32)(unsafe.Pointer(q))
	h := r.seed
	for _, w := range words {
		h = mix32(h, w)
	}
	return &r.sets[1+fmix32(h)&r.mask], uint64(fmix32(h+replySalt))<<2 | replyLive
}

// mix32 and fmix32 are murmur3's, as in the program.
func mix32(h, w uint32) uint32 {
	h ^= w * 0xcc9e2d51
	return bits.RotateLeft32(h, 13)*5 + 0xe6546b64
}

func fmix32(h uint32) uint32 {
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	return h ^ h>>16
}

func holds(set *bpfReplySet, way int, q *slotKey) bool {
	for i := range q {
		if atomic.LoadUint64(&set.Key[way][i]) != q[i] {
			return false
		}
	}
	return true
}

// What add did with a tuple.
type addResult uint8

const (
	slotWritten addResult = iota // into a way of its own
	slotPresent                  // it was there already
	slotSetFull                  // nowhere: its set is full
)

// add writes q into its set, or finds it there.
func (r *replySlots) add(q *slotKey) addResult {
	set, live := r.locate(q)
	for w := range replyWays {
		// The tag again after the key: a way emptied and taken by
		// another tuple meanwhile is not q, whatever its words said.
		if atomic.LoadUint64(&set.Tag[w]) == live && holds(set, w, q) && atomic.LoadUint64(&set.Tag[w]) == live {
			return slotPresent
		}
	}
	for w := range replyWays {
		if atomic.LoadUint64(&set.Tag[w]) != replyEmpty || !atomic.CompareAndSwapUint64(&set.Tag[w], replyEmpty, replyBusy) {
			continue
		}
		for i := range q {
			atomic.StoreUint64(&set.Key[w][i], q[i])
		}
		atomic.StoreUint64(&set.Tag[w], live)
		return slotWritten
	}
	return slotSetFull
}

// remove takes q out of its set, from every way that holds it (two
// writers adding it at once may both have taken one). It reports false
// when q was not there.
func (r *replySlots) remove(q *slotKey) bool {
	set, live := r.locate(q)
	removed := false
	for w := range replyWays {
		if atomic.LoadUint64(&set.Tag[w]) == live && holds(set, w, q) &&
			atomic.CompareAndSwapUint64(&set.Tag[w], live, replyEmpty) {
			removed = true
		}
	}
	return removed
}

// prefetch asks for the first line of q's set, which add and remove read
// first, so that a batch's misses overlap.
func (r *replySlots) prefetch(q *slotKey) {
	set, _ := r.locate(q)
	cpu.Prefetch(uintptr(unsafe.Pointer(&set.Tag[0])))
}

// each calls fn with every live tuple until fn returns false.
func (r *replySlots) each(fn func(*slotKey) bool) bool {
	var q slotKey
	for i := 1; i < len(r.sets); i++ {
		set := &r.sets[i]
		for w := range replyWays {
			tag := atomic.LoadUint64(&set.Tag[w])
			if tag&3 != replyLive {
				continue
			}
			for j := range q {
				q[j] = atomic.LoadUint64(&set.Key[w][j])
			}
			if atomic.LoadUint64(&set.Tag[w]) != tag {
				continue // emptied or taken again while read
			}
			if !fn(&q) {
				return false
			}
		}
	}
	return true
}
