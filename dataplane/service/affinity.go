package service

import (
	"encoding/binary"
	"math/bits"
	"sync/atomic"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Affinity is the ClientIP session-affinity memory: for each (service
// port, client address) the backend that client's last new flow went to
// and when that memory expires. kube-proxy keys affinity the same way: per
// ServicePort, whichever of the service's addresses the client used.
//
// It lives outside the Table, keyed by Port.ID and addresses rather than
// by positions in a snapshot, so it survives table swaps. A remembered
// backend that the current table no longer lists as usable is ignored and
// replaced (see Frontend.SelectWithAffinity).
//
// Concurrency: any number of goroutines may call Lookup and Remember at
// once. There are no locks: every slot has a sequence counter (a seqlock);
// a writer claims a slot by making the counter odd with a compare-and-swap
// and gives up instead of waiting if another writer holds it, and a reader
// retries a few times when it sees a write in progress, then reports a
// miss. All fields are atomics, so readers never see torn entries.
//
// Capacity is fixed at NewAffinity. A key lives in one of eight
// consecutive slots after its hash. Remember reuses the key's own slot,
// else an empty or expired one, else evicts the slot that expires soonest;
// so when the table is too small clients lose their affinity early (a new
// flow may then go to another backend), but a lookup never returns another
// client's backend. Two workers remembering the same new client at the
// same instant may store two entries; lookups then use the first one in
// probe order until the other expires. Affinity is best effort in exactly
// these ways, never unbounded in memory.
type Affinity struct {
	slots []affinitySlot
	mask  uint64
	mem   []byte // the file mapping of OpenAffinity, nil otherwise
}

// One slot is one cache line, so writers to different slots do not share
// lines.
type affinitySlot struct {
	seq     atomic.Uint64    // odd while a writer owns the slot
	port    atomic.Uint64    // Port.ID; 0 marks a slot never used
	client  [2]atomic.Uint64 // client address, big-endian halves
	backend [2]atomic.Uint64 // backend address
	portExp atomic.Uint64    // backend port << 32 | expiry second
	_       [8]byte
}

type affinityEntry struct {
	port            uint64
	client, backend [2]uint64
	portExp         uint64
}

const (
	affinityWindow = 8
	affinityTries  = 4
)

// NewAffinity returns a table of at least capacity entries (rounded up to
// a power of two, at least 64). Each entry takes 64 bytes: one million
// entries take 64 MiB.
func NewAffinity(capacity int) *Affinity {
	n := uint64(64)
	if capacity > 64 {
		n = uint64(1) << bits.Len64(uint64(capacity-1))
	}
	return &Affinity{slots: make([]affinitySlot, n), mask: n - 1}
}

// Capacity returns the number of slots.
func (a *Affinity) Capacity() int { return len(a.slots) }

func addrWords(x *packet.Addr) [2]uint64 {
	return [2]uint64{binary.BigEndian.Uint64(x[:8]), binary.BigEndian.Uint64(x[8:])}
}

func wordsAddr(w [2]uint64) packet.Addr {
	var x packet.Addr
	binary.BigEndian.PutUint64(x[:8], w[0])
	binary.BigEndian.PutUint64(x[8:], w[1])
	return x
}

// affinityHash is xxhash64 of the port ID and the two address words as
// 24 little-endian bytes (see hashParts for why it is written out).
func affinityHash(port uint64, client *[2]uint64) uint64 {
	h := uint64(xxPrime5 + 24)
	h = xxWord(h, port)
	h = xxWord(h, client[0])
	h = xxWord(h, client[1])
	return xxAvalanche(h)
}

// alive reports whether an entry expiring at exp is still valid at now;
// the subtraction keeps working when the seconds counter wraps.
func alive(exp, now uint32) bool { return int32(exp-now) > 0 }

func (s *affinitySlot) load() (e affinityEntry, ok bool) {
	for range affinityTries {
		seq := s.seq.Load()
		if seq&1 != 0 {
			continue
		}
		e.port = s.port.Load()
		e.client[0], e.client[1] = s.client[0].Load(), s.client[1].Load()
		e.backend[0], e.backend[1] = s.backend[0].Load(), s.backend[1].Load()
		e.portExp = s.portExp.Load()
		if s.seq.Load() == seq {
			return e, true
		}
	}
	return e, false
}

// Lookup returns the backend remembered for client of the service port
// portID, if it has not expired at now. now is in seconds on a clock
// shared by all callers (for example seconds since the process started).
// It does not allocate.
func (a *Affinity) Lookup(portID uint64, client packet.Addr, now uint32) (addr packet.Addr, port uint16, ok bool) {
	e, ok := a.find(portID, client, now)
	if !ok {
		return addr, 0, false
	}
	return wordsAddr(e.backend), uint16(e.portExp >> 32), true
}

func (a *Affinity) find(portID uint64, client packet.Addr, now uint32) (affinityEntry, bool) {
	cw := addrWords(&client)
	h := affinityHash(portID, &cw)
	for k := uint64(0); k < affinityWindow; k++ {
		e, ok := a.slots[(h+k)&a.mask].load()
		if ok && e.port == portID && e.client == cw && alive(uint32(e.portExp), now) {
			return e, true
		}
	}
	return affinityEntry{}, false
}

// Remember records that client's flows to portID go to addr:port until
// timeout seconds after now. It reports false when it gave up because
// another writer held the slot. It does not allocate.
func (a *Affinity) Remember(portID uint64, client packet.Addr, addr packet.Addr, port uint16, now, timeout uint32) bool {
	cw := addrWords(&client)
	h := affinityHash(portID, &cw)
	// Take the key's own slot, else the first free one (never used or
	// expired), else the live one that expires soonest.
	victim, victimExp, victimFree := -1, uint32(0), false
	for k := uint64(0); k < affinityWindow; k++ {
		i := int((h + k) & a.mask)
		e, ok := a.slots[i].load()
		if !ok {
			continue // being written; not a good victim
		}
		exp := uint32(e.portExp)
		if e.port == portID && e.client == cw {
			victim = i
			break
		}
		free := e.port == 0 || !alive(exp, now)
		switch {
		case victimFree:
		case free:
			victim, victimFree = i, true
		case victim < 0 || int32(exp-victimExp) < 0:
			victim, victimExp = i, exp
		}
	}
	if victim < 0 {
		return false
	}
	s := &a.slots[victim]
	seq := s.seq.Load()
	if seq&1 != 0 || !s.seq.CompareAndSwap(seq, seq+1) {
		return false
	}
	bw := addrWords(&addr)
	s.port.Store(portID)
	s.client[0].Store(cw[0])
	s.client[1].Store(cw[1])
	s.backend[0].Store(bw[0])
	s.backend[1].Store(bw[1])
	s.portExp.Store(uint64(port)<<32 | uint64(now+timeout))
	s.seq.Store(seq + 2)
	return true
}

// SelectWithAffinity is Select for ports with ClientIP affinity: it reuses
// the backend remembered for client if that backend is still in the list
// the flow would choose from, else selects afresh and remembers the
// choice. Each use extends the memory to the port's timeout from now, as
// kube-proxy does per new connection (at most one write per client per
// second). Without affinity on the port, or with a nil a, it is Select.
// It does not allocate.
func (f *Frontend) SelectWithAffinity(a *Affinity, client packet.Addr, flowHash, rnd uint64, localOrigin bool, now uint32) *Backend {
	p := f.Port
	if a == nil || p.affinitySec == 0 {
		return f.Select(flowHash, rnd, localOrigin)
	}
	s := f.set(localOrigin)
	if s.Len() == 0 {
		return nil
	}
	if addr, port, ok := a.lookupExp(p.ID, client, now, p.affinitySec); ok {
		if b := s.find(addr, port); b != nil {
			return b
		}
	}
	b := f.Select(flowHash, rnd, localOrigin)
	a.Remember(p.ID, client, b.Addr, b.Port, now, p.affinitySec)
	return b
}

// lookupExp is Lookup that also extends a hit's expiry to timeout from
// now, unless that was already done within this second.
func (a *Affinity) lookupExp(portID uint64, client packet.Addr, now, timeout uint32) (packet.Addr, uint16, bool) {
	e, ok := a.find(portID, client, now)
	if !ok {
		return packet.Addr{}, 0, false
	}
	addr, port := wordsAddr(e.backend), uint16(e.portExp>>32)
	if uint32(e.portExp) != now+timeout {
		a.Remember(portID, client, addr, port, now, timeout)
	}
	return addr, port, true
}
