package afxdp

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// setsockopt and getsockopt pass structs that x/sys/unix has no typed
// helper for.
func setsockopt(fd, opt int, val unsafe.Pointer, size uintptr) error {
	_, _, errno := unix.Syscall6(unix.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_XDP, uintptr(opt), uintptr(val), size, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

func getsockopt(fd, opt int, val unsafe.Pointer, size *uint32) error {
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_XDP, uintptr(opt), uintptr(val), uintptr(unsafe.Pointer(size)), 0)
	if errno != 0 {
		return errno
	}
	return nil
}
