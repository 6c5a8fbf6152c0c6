package conntrack

import (
	"errors"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// hugePage is the size of a transparent huge page on amd64 and arm64 (4K
// base pages).
const hugePage = 2 << 20

// prepareMemory readies the slab or an index array s for the per-packet
// path before any packet needs it. It asks for transparent huge pages
// (MADV_HUGEPAGE; the default policy of most distributions, "madvise",
// gives them only to memory that asks): lookups touch the slab and the
// index at random, and with 4 KiB pages nearly every one of them also
// misses the TLB once a table outgrows a few megabytes. And it faults every
// page in now, so that the first flows to reach each page do not pay for
// the page fault, tens of thousands of them for a million-flow table.
// Both are hints: a kernel that has no huge pages to give still works.
func prepareMemory[T any](s []T) {
	if len(s) == 0 {
		return
	}
	p := unsafe.Pointer(&s[0])
	size := uintptr(len(s)) * unsafe.Sizeof(s[0])
	base := uintptr(p)
	start := (base + hugePage - 1) &^ (hugePage - 1)
	end := (base + size) &^ (hugePage - 1)
	if end > start {
		_ = unix.Madvise(unsafe.Slice((*byte)(unsafe.Add(p, start-base)), end-start), unix.MADV_HUGEPAGE)
	}
	b := unsafe.Slice((*byte)(p), size)
	for i := 0; i < len(b); i += 4096 {
		b[i] = 0 // fresh memory is zero: this only maps the page
	}
}

// prepareMapped readies the mapping of the state file (statefile.go) as
// prepareMemory does the heap: huge pages where the file system gives them
// (a tmpfs mounted with huge=advise, within_size or always), and every page
// mapped now. Without this the slab's pages were mapped one by one as
// inserts first reached them: on the new-flow benchmark, a few thousand
// page faults a second under traffic, and 40% of xdproxy's profile on the
// first load of a new flow's entry, in a VM whose host backed each page only
// then. The contents are kept: a restored table's entries are live.
func prepareMapped(data []byte) {
	if len(data) == 0 {
		return
	}
	_ = unix.Madvise(data, unix.MADV_HUGEPAGE)
	err := unix.Madvise(data, unix.MADV_POPULATE_WRITE)
	if err == nil {
		return
	}
	if !errors.Is(err, unix.EINVAL) {
		return // ENOMEM or a signal: the pages fault in as before
	}
	// Before Linux 5.14: a read maps each page too, writable in a
	// shared mapping of a tmpfs file. An atomic load is never elided.
	for i := 0; i < len(data); i += 4096 {
		atomic.LoadUint32((*uint32)(unsafe.Pointer(&data[i])))
	}
}
