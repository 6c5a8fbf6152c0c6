package pktgen

import "golang.org/x/sys/unix"

func yield() { _, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }
