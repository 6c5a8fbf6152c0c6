package service

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The session-affinity table can live in a file, mapped shared, so that a
// restarted xdproxy sends a client to the backend it was using. The file
// is one 64-byte header followed by the slots exactly as they are in
// memory (the slots hold only atomic words, so the mapping needs no
// encoding and the garbage collector never looks into it):
//
//	magic   [8]byte  "XDPXAFF1"
//	version uint32   affinityFileVersion: the slot layout
//	slotLen uint32   64
//	slots   uint64   a power of two
//	...              zero to 64 bytes
//
// Expiry times are seconds of the caller's clock, which must be one that
// every generation of the process shares (CLOCK_MONOTONIC).

const (
	affinityMagic       = "XDPXAFF1"
	affinityFileVersion = 1
	affinityHeader      = 64
)

// AffinityRestore says what OpenAffinity found.
type AffinityRestore struct {
	// Adopted is true when the file's slots were taken over.
	Adopted bool
	// Reason says why they were not, when they were not.
	Reason string
}

// OpenAffinity is NewAffinity with the table in the file at path (see
// above). A file of another layout or size is replaced, and the table
// starts empty; AffinityRestore says which happened. Close the table to
// unmap it; the file stays for the next process.
func OpenAffinity(path string, capacity int) (*Affinity, AffinityRestore, error) {
	n := uint64(64)
	if capacity > 64 {
		n = uint64(1) << bits.Len64(uint64(capacity-1))
	}
	size := int64(affinityHeader) + int64(n)*int64(unsafe.Sizeof(affinitySlot{}))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, AffinityRestore{}, fmt.Errorf("affinity state: %w", err)
	}
	defer f.Close()
	var res AffinityRestore
	st, err := f.Stat()
	if err != nil {
		return nil, res, fmt.Errorf("affinity state: %w", err)
	}
	fresh := true
	switch {
	case st.Size() == 0:
		res.Reason = "no earlier state"
	case st.Size() != size:
		res.Reason = fmt.Sprintf("the file holds %d bytes, a table of %d slots takes %d", st.Size(), n, size)
	default:
		fresh = false
	}
	if fresh {
		if err := f.Truncate(0); err != nil {
			return nil, res, fmt.Errorf("affinity state: %w", err)
		}
		if err := f.Truncate(size); err != nil {
			return nil, res, fmt.Errorf("affinity state: %w", err)
		}
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, res, fmt.Errorf("affinity state: mmap: %w", err)
	}
	hdr := mem[:affinityHeader]
	if !fresh {
		if why := checkAffinityHeader(hdr, n); why != "" {
			res.Reason = why
			clear(mem)
			fresh = true
		}
	}
	if fresh {
		copy(hdr, affinityMagic)
		binary.LittleEndian.PutUint32(hdr[8:], affinityFileVersion)
		binary.LittleEndian.PutUint32(hdr[12:], uint32(unsafe.Sizeof(affinitySlot{})))
		binary.LittleEndian.PutUint64(hdr[16:], n)
	}
	a := &Affinity{
		slots: unsafe.Slice((*affinitySlot)(unsafe.Pointer(&mem[affinityHeader])), n),
		mask:  n - 1,
		mem:   mem,
	}
	if !fresh {
		res.Adopted = true
		// A slot a crashed writer held stays odd forever: clear it.
		for i := range a.slots {
			if s := &a.slots[i]; s.seq.Load()&1 != 0 {
				s.port.Store(0)
				s.seq.Add(1)
			}
		}
	}
	return a, res, nil
}

func checkAffinityHeader(hdr []byte, n uint64) string {
	switch {
	case string(hdr[:8]) != affinityMagic:
		return "not an affinity state file"
	case binary.LittleEndian.Uint32(hdr[8:]) != affinityFileVersion:
		return fmt.Sprintf("layout version %d, this build has %d", binary.LittleEndian.Uint32(hdr[8:]), affinityFileVersion)
	case binary.LittleEndian.Uint32(hdr[12:]) != uint32(unsafe.Sizeof(affinitySlot{})):
		return "another slot size"
	case binary.LittleEndian.Uint64(hdr[16:]) != n:
		return fmt.Sprintf("%d slots, this table has %d", binary.LittleEndian.Uint64(hdr[16:]), n)
	}
	return ""
}

// Close unmaps a table opened with OpenAffinity; other tables have nothing
// to release. The table must not be used afterwards.
func (a *Affinity) Close() error {
	if a.mem == nil {
		return nil
	}
	mem := a.mem
	a.mem, a.slots = nil, nil
	if err := unix.Munmap(mem); err != nil {
		return errors.Join(errors.New("affinity state: munmap"), err)
	}
	return nil
}
