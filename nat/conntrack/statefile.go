package conntrack

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"
)

// State file format (doc.go, "State file"). The header takes the first page;
// the entries follow, page-aligned, exactly as the slab holds them.
const (
	stateMagic      = "XDPCTST\x00"
	stateVersion    = 1
	stateHeaderSize = 4096

	hdrMagic      = 0  // [8]byte
	hdrVersion    = 8  // u32
	hdrEntrySize  = 12 // u32
	hdrHeaderSize = 16 // u32
	hdrShards     = 20 // u32
	hdrCapacity   = 24 // u64
	hdrSeed       = 32 // u64
	hdrLayout     = 40 // u64: layoutHash
	hdrBootID     = 48 // [16]byte
	hdrCreated    = 64 // u64: Unix ns when the file was made, for people
	hdrChecksum   = 72 // u64: xxhash of bytes [0, 72)
	hdrLen        = 80
)

// layoutHash names everything the meaning of a state file's bytes depends
// on. Any change to the entry, the timer word, the key packing, the window
// word or the hash must change this description (or stateVersion), so that
// a new build refuses an old file rather than misreading it.
var layoutHash = func() uint64 {
	desc := "entry{seq,timer,meta,orig[5],reply[5],created,win[2]}=" + strconv.Itoa(int(unsafe.Sizeof(entry{}))) +
		" timer{state:4,status:3(seen,closer,assured),gen:16,deadline:41ms}" +
		" key{src:2,dst:2,sport<<48|dport<<32|proto<<8|1} hash=fmix64(nh32(key+splitmix64(seed))) tag>>33 shard>>26" +
		" win{end:32,maxwin:16,scale:4,seen:1,wsok:1,gen:10}" +
		" states=" + strconv.Itoa(int(NumStates)) +
		" shifts=" + strconv.Itoa(statusShift) + "," + strconv.Itoa(genShift) + "," + strconv.Itoa(deadlineShift) +
		"," + strconv.Itoa(tagShift) + "," + strconv.Itoa(shardShift) + "," + strconv.Itoa(winTagShift)
	return xxhash.Sum64String(desc)
}()

// ErrStateInUse is returned by New when another process holds the state
// file: two tables must never share one.
var ErrStateInUse = errors.New("conntrack: state file in use by another process")

// RestoreInfo says what New did with Config.StatePath.
type RestoreInfo struct {
	Path string
	// Restored is true when the table adopted the file's entries.
	Restored bool
	// Existed is true when there was a file; with Restored false it was
	// discarded, for Reason.
	Existed bool
	// Reason says why the file was not adopted: there was none, or it
	// was incompatible or corrupt. Empty when Restored.
	Reason  string
	Flows   int // live flows adopted
	Expired int // flows past their deadline, freed (OnRemove was called)
	Torn    int // entries a writer was filling when its process ended, freed
	Invalid int // entries that failed validation (bad key, shard, generation, duplicate), freed
	// HugePages is true when the file's mapping is on huge pages (see
	// MountStateDir); false on 4 KiB pages, which cost the per-packet
	// path TLB misses.
	HugePages bool
}

func (r RestoreInfo) String() string {
	if r.Path == "" {
		return "no state file"
	}
	if !r.Restored {
		return fmt.Sprintf("%s: started empty: %s", r.Path, r.Reason)
	}
	return fmt.Sprintf("%s: restored %d flows (freed %d expired, %d torn, %d invalid)", r.Path, r.Flows, r.Expired, r.Torn, r.Invalid)
}

// Restored says what New found in the state file. A table without one
// reports an empty RestoreInfo.
func (t *Table) Restored() RestoreInfo { return t.restored }

// stateFile is the open, locked and mapped state file.
type stateFile struct {
	f    *os.File
	data []byte
}

// RemoveState deletes a state file, for `xdproxy cleanup`. A missing file
// is not an error. A process that has the file mapped keeps its copy until
// it closes the table.
func RemoveState(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("conntrack: removing state file: %w", err)
	}
	return nil
}

// Close unmaps the state file and releases it for the next process; the
// file stays. Call it once the workers have stopped: the table must not be
// used afterwards. Without a state file Close does nothing.
func (t *Table) Close() error {
	sf := t.state
	if sf == nil {
		return nil
	}
	t.state = nil
	t.entries = nil
	err := unix.Munmap(sf.data)
	if cerr := sf.f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("conntrack: closing state file: %w", err)
	}
	return nil
}

// openState maps cfg.StatePath as the slab, adopting its entries when the
// file matches this table's layout and starting it afresh otherwise.
func (t *Table) openState(cfg Config) error {
	path := cfg.StatePath
	capacity := len(t.shards) * int(t.perShard)
	size := int64(stateHeaderSize) + int64(capacity)*entrySize
	info := RestoreInfo{Path: path}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("conntrack: state file directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("conntrack: opening state file: %w", err)
	}
	fail := func(err error) error {
		f.Close()
		return err
	}
	fd := int(f.Fd())
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fail(fmt.Errorf("%w: %s", ErrStateInUse, path))
		}
		return fail(fmt.Errorf("conntrack: locking state file: %w", err))
	}
	st, err := f.Stat()
	if err != nil {
		return fail(fmt.Errorf("conntrack: state file: %w", err))
	}
	boot := bootID()
	var hdr [hdrLen]byte
	if st.Size() == 0 {
		info.Reason = "no state file yet"
	} else {
		info.Existed = true
		if _, err := f.ReadAt(hdr[:], 0); err != nil {
			info.Reason = fmt.Sprintf("reading header: %v", err)
		} else {
			info.Reason = checkHeader(&hdr, st.Size(), size, len(t.shards), capacity, boot)
		}
	}
	fresh := info.Reason != ""
	if fresh {
		// Start from zeros: a free entry is all zeros.
		if err := f.Truncate(0); err != nil {
			return fail(fmt.Errorf("conntrack: clearing state file: %w", err))
		}
		if err := f.Truncate(size); err != nil {
			return fail(fmt.Errorf("conntrack: sizing state file: %w", err))
		}
	}
	// Reserve the blocks now: a tmpfs that fills up later would otherwise
	// kill the process with SIGBUS on its first write to a new page.
	if err := unix.Fallocate(fd, 0, 0, size); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return fail(fmt.Errorf("conntrack: reserving %d bytes for the state file: %w", size, err))
	}
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(fmt.Errorf("conntrack: mapping state file: %w", err))
	}
	prepareMapped(data)
	info.HugePages = mappedHuge(data)
	t.state = &stateFile{f: f, data: data}
	t.entries = unsafe.Slice((*entry)(unsafe.Pointer(&data[stateHeaderSize])), capacity)
	if fresh {
		t.setSeed(cfg.Seed)
		writeHeader(data[:hdrLen], len(t.shards), capacity, t.rawSeed, boot)
	} else {
		t.setSeed(binary.LittleEndian.Uint64(hdr[hdrSeed:]))
		clock := cfg.Clock
		if clock == nil {
			clock = MonotonicNow
		}
		info.Restored = true
		t.restore(msOf(clock()), &info)
	}
	t.restored = info
	return nil
}

// checkHeader returns why hdr does not describe a file this table can
// adopt, or "".
func checkHeader(hdr *[hdrLen]byte, fileSize, wantSize int64, shards, capacity int, boot [16]byte) string {
	le := binary.LittleEndian
	switch {
	case fileSize < stateHeaderSize:
		return fmt.Sprintf("file is %d bytes, shorter than its header (truncated)", fileSize)
	case string(hdr[hdrMagic:hdrMagic+8]) != stateMagic:
		return "not a conntrack state file (bad magic)"
	case le.Uint64(hdr[hdrChecksum:]) != xxhash.Sum64(hdr[:hdrChecksum]):
		return "header checksum mismatch (corrupt header)"
	case le.Uint32(hdr[hdrVersion:]) != stateVersion:
		return fmt.Sprintf("layout version %d, this build uses %d", le.Uint32(hdr[hdrVersion:]), stateVersion)
	case le.Uint32(hdr[hdrEntrySize:]) != entrySize || le.Uint32(hdr[hdrHeaderSize:]) != stateHeaderSize ||
		le.Uint64(hdr[hdrLayout:]) != layoutHash:
		return "entry layout differs from this build's"
	case le.Uint64(hdr[hdrCapacity:]) != uint64(capacity) || le.Uint32(hdr[hdrShards:]) != uint32(shards):
		return fmt.Sprintf("capacity %d in %d shards, this table has %d in %d",
			le.Uint64(hdr[hdrCapacity:]), le.Uint32(hdr[hdrShards:]), capacity, shards)
	case fileSize != wantSize:
		return fmt.Sprintf("file is %d bytes, want %d (truncated or extended)", fileSize, wantSize)
	case boot != [16]byte{} && [16]byte(hdr[hdrBootID:hdrBootID+16]) != boot:
		return "written before a reboot (boot id differs): its monotonic deadlines mean nothing now"
	}
	return ""
}

func writeHeader(hdr []byte, shards, capacity int, seed uint64, boot [16]byte) {
	le := binary.LittleEndian
	copy(hdr[hdrMagic:], stateMagic)
	le.PutUint32(hdr[hdrVersion:], stateVersion)
	le.PutUint32(hdr[hdrEntrySize:], entrySize)
	le.PutUint32(hdr[hdrHeaderSize:], stateHeaderSize)
	le.PutUint32(hdr[hdrShards:], uint32(shards))
	le.PutUint64(hdr[hdrCapacity:], uint64(capacity))
	le.PutUint64(hdr[hdrSeed:], seed)
	le.PutUint64(hdr[hdrLayout:], layoutHash)
	copy(hdr[hdrBootID:hdrBootID+16], boot[:])
	le.PutUint64(hdr[hdrCreated:], uint64(time.Now().UnixNano()))
	le.PutUint64(hdr[hdrChecksum:], xxhash.Sum64(hdr[:hdrChecksum]))
}

// bootID identifies this boot of the machine (zeros if unknown): after a
// reboot CLOCK_MONOTONIC starts again and old deadlines are meaningless.
func bootID() [16]byte {
	var id [16]byte
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return id
	}
	b = bytes.ReplaceAll(bytes.TrimSpace(b), []byte("-"), nil)
	if len(b) != 32 {
		return id
	}
	for i := range id {
		hi, lo := unhex(b[2*i]), unhex(b[2*i+1])
		if hi < 0 || lo < 0 {
			return [16]byte{}
		}
		id[i] = byte(hi<<4 | lo)
	}
	return id
}

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

// restore adopts the live entries of a mapped state file: it rebuilds the
// shard indexes, free lists and counts from the slab, and frees entries
// caught mid-write, expired, or invalid. No other goroutine has the table
// yet, so nothing here needs a lock; OnRemove is called for expired flows.
func (t *Table) restore(nowMs uint64, info *RestoreInfo) {
	for si := range t.shards {
		sh := &t.shards[si]
		// Entries are taken from the front of a shard's range, so the
		// ones after the last that was ever written were never used.
		used := sh.count
		for used > 0 && t.entries[sh.first+used-1].seq.Load() == 0 {
			used--
		}
		sh.unused = used
		sh.touched.Store(used)
		// Backwards, so that the free list hands out low entries first.
		for i := used; i > 0; i-- {
			idx := sh.first + i - 1
			var g gone
			if !t.restoreEntry(sh, idx, nowMs, info, &g) {
				t.entries[idx].timer.Store(timerFree)
				sh.freeLocked(t, idx)
			}
			t.notify(&g)
		}
	}
}

// restoreEntry adopts entry idx of shard sh if it holds a valid live flow.
// An expired flow is reported in *g.
func (t *Table) restoreEntry(sh *shard, idx uint32, nowMs uint64, info *RestoreInfo, g *gone) bool {
	e := &t.entries[idx]
	seq := e.seq.Load()
	tm := e.timer.Load()
	if seq&1 != 0 {
		// An insert was writing it. Make the sequence even again
		// (the next insert advances it as usual): the entry is free.
		e.seq.Store(seq + 1)
		info.Torn++
		return false
	}
	if tm == timerFree {
		return false
	}
	st := timerState(tm)
	gen := uint16(seq >> 1)
	if seq == 0 || st == StateFree || st >= NumStates || timerGen(tm) != gen {
		info.Invalid++
		return false
	}
	var ko, kr key
	loadKey(&e.orig, &ko)
	loadKey(&e.reply, &kr)
	ho, hr := hashKey(&ko, &t.seed), hashKey(&kr, &t.seed)
	sr := t.shardOf(hr)
	if !validKey(&ko) || !validKey(&kr) || ko == kr || t.shardOf(ho) != sh {
		info.Invalid++
		return false
	}
	if timerDeadline(tm) <= nowMs {
		info.Expired++
		g.orig, g.reply, g.ok = ko, kr, true
		return false
	}
	if _, dup := t.findLocked(sh.index.Load(), &ko, ho); dup {
		info.Invalid++
		return false
	}
	if _, dup := t.findLocked(sr.index.Load(), &kr, hr); dup {
		info.Invalid++
		return false
	}
	need := 1
	if sh == sr {
		need = 2
	}
	if !t.roomInIndex(sh, need) || !t.roomInIndex(sr, 1) {
		info.Invalid++
		return false
	}
	// A deadline further away than this table's timeout for the state
	// (shorter timeouts configured, or a clock that is not the one the
	// file was written with) is brought back to it.
	status := timerStatus(tm)
	a := assuredBit(status)
	if limit := nowMs + t.timeout[a][st]; timerDeadline(tm) > limit {
		e.timer.Store(packTimer(st, status, gen, limit))
	}
	// Windows: keep what the SYNs said (scale) and the largest windows,
	// but learn each side's sequence afresh from its next packet; while
	// the process was away the flow may have moved on.
	tag := winTag(gen)
	for d := range e.win {
		if w := e.win[d].Load(); sameTag(w, tag) {
			e.win[d].Store(w &^ (winSeen | winEndMask))
		} else {
			e.win[d].Store(tag)
		}
	}
	placeLocked(sh, ho, ho>>tagShift<<tagShift|uint64(idx+1))
	placeLocked(sr, hr, hr>>tagShift<<tagShift|slotDirReply|uint64(idx+1))
	sh.live.Add(1)
	sh.counts[a][st].Add(1)
	info.Flows++
	return true
}

// validKey checks the constant bits of a packed key (packKey).
func validKey(k *key) bool { return k[4]&0xffff00ff == 1 }
