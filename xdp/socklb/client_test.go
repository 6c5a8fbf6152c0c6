package socklb

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// clientMain is the client process (see runClient): it runs spec and
// prints one JSON result per line.
func clientMain(specJSON string) int {
	var spec clientSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if spec.Count == 0 {
		spec.Count = 1
	}
	dom, sa := sockaddr(spec.Family, spec.Addr, spec.Port)
	var out []result
	switch spec.Mode {
	case "tcp":
		for range spec.Count {
			out = append(out, tcpOnce(dom, sa, false))
		}
	case "udpconn":
		for range spec.Count {
			out = append(out, udpConnected(dom, sa))
		}
	case "udp":
		fd := -1
		for range spec.Count {
			if fd < 0 || !spec.Reuse {
				if fd >= 0 {
					unix.Close(fd)
				}
				var err error
				if fd, err = udpSocket(dom); err != nil {
					out = append(out, result{Err: errName(err)})
					continue
				}
			}
			out = append(out, udpUnconnected(fd, sa))
		}
	case "loop":
		var mu sync.Mutex
		var wg sync.WaitGroup
		deadline := time.Now().Add(spec.Duration)
		for range max(spec.Workers, 1) {
			wg.Go(func() {
				// A Sockaddr of its own: Connect writes into it.
				_, sa := sockaddr(spec.Family, spec.Addr, spec.Port)
				var mine []result
				for time.Now().Before(deadline) {
					mine = append(mine, tcpOnce(dom, sa, true))
				}
				mu.Lock()
				out = append(out, mine...)
				mu.Unlock()
			})
		}
		wg.Wait()
	case "bench":
		out = append(out, bench(dom, sa, spec))
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", spec.Mode)
		return 2
	}
	enc := json.NewEncoder(os.Stdout)
	for _, r := range out {
		enc.Encode(r)
	}
	return 0
}

func sockaddr(family, addr string, port int) (int, unix.Sockaddr) {
	a := netip.MustParseAddr(addr)
	switch family {
	case "4":
		return unix.AF_INET, &unix.SockaddrInet4{Port: port, Addr: a.As4()}
	case "mapped":
		return unix.AF_INET6, &unix.SockaddrInet6{Port: port, Addr: netip.AddrFrom4(a.As4()).As16()}
	default:
		return unix.AF_INET6, &unix.SockaddrInet6{Port: port, Addr: a.As16()}
	}
}

func saString(sa unix.Sockaddr) string {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)).String()
	}
	return fmt.Sprint(sa)
}

func errName(err error) string {
	var errno unix.Errno
	if errors.As(err, &errno) {
		if n := unix.ErrnoName(errno); n != "" {
			return n
		}
	}
	return err.Error()
}

func mono() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

func setTimeouts(fd int) {
	tv := unix.NsecToTimeval(int64(2 * time.Second))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
}

// tcpOnce connects, reads the server's id and closes; with reset, the
// close sends a reset, which leaves no TIME_WAIT behind.
func tcpOnce(dom int, sa unix.Sockaddr, reset bool) result {
	fd, err := unix.Socket(dom, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return result{Err: errName(err)}
	}
	defer unix.Close(fd)
	setTimeouts(fd)
	if reset {
		unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}
	var r result
	r.Start = mono()
	err = connect(fd, sa)
	r.End = mono()
	if err != nil {
		r.Err = errName(err)
		return r
	}
	if p, err := unix.Getpeername(fd); err == nil {
		r.Peer = saString(p)
	}
	var buf [256]byte
	var got []byte
	for {
		n, err := unix.Read(fd, buf[:])
		if err == unix.EINTR {
			continue
		}
		if n > 0 {
			got = append(got, buf[:n]...)
		}
		if err != nil {
			r.Err = "read: " + errName(err)
			return r
		}
		if n == 0 {
			break
		}
	}
	r.Backend = string(got)
	return r
}

// connect is a blocking connect(2) that a signal (the Go runtime sends
// some) does not cut short: the kernel goes on connecting, and we wait.
func connect(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err != unix.EINTR {
		return err
	}
	for {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(pfd, 2000)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return unix.ETIMEDOUT
		}
		soErr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if soErr != 0 {
			return unix.Errno(soErr)
		}
		return nil
	}
}

func udpSocket(dom int) (int, error) {
	fd, err := unix.Socket(dom, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		setTimeouts(fd)
	}
	return fd, err
}

// reply receives a datagram and fills in r from it.
func reply(fd int, r *result) {
	var buf [1500]byte
	n, from, err := unix.Recvfrom(fd, buf[:], 0)
	for err == unix.EINTR {
		n, from, err = unix.Recvfrom(fd, buf[:], 0)
	}
	if err != nil {
		r.Err = "recvfrom: " + errName(err)
		return
	}
	r.Backend, _, _ = strings.Cut(string(buf[:n]), "|")
	r.From = saString(from)
}

func udpConnected(dom int, sa unix.Sockaddr) result {
	fd, err := udpSocket(dom)
	if err != nil {
		return result{Err: errName(err)}
	}
	defer unix.Close(fd)
	var r result
	if err := unix.Connect(fd, sa); err != nil {
		r.Err = errName(err)
		return r
	}
	if p, err := unix.Getpeername(fd); err == nil {
		r.Peer = saString(p)
	}
	if _, err := unix.Write(fd, []byte("ping")); err != nil {
		r.Err = "send: " + errName(err)
		return r
	}
	reply(fd, &r)
	return r
}

func udpUnconnected(fd int, sa unix.Sockaddr) result {
	var r result
	if err := unix.Sendto(fd, []byte("ping"), 0, sa); err != nil {
		r.Err = errName(err)
		return r
	}
	reply(fd, &r)
	r.Peer = r.From
	return r
}

// bench times spec.Count connect(2) calls through the frontend and as
// many straight to spec.Direct, alternating in batches of 100 so that
// both see the same machine. Only connect(2) is timed; the socket is
// closed with a reset.
func bench(dom int, sa unix.Sockaddr, spec clientSpec) result {
	ap := netip.MustParseAddrPort(spec.Direct)
	_, direct := sockaddr(spec.Family, ap.Addr().String(), int(ap.Port()))
	var vip, dir []float64
	var failed, wrong int
	one := func(to unix.Sockaddr, times *[]float64) {
		fd, err := unix.Socket(dom, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			failed++
			return
		}
		unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
		start := mono()
		err = connect(fd, to)
		took := mono() - start
		if err != nil {
			failed++
		} else {
			*times = append(*times, float64(took))
			if p, err := unix.Getpeername(fd); err == nil && to == direct && saString(p) != spec.Direct {
				wrong++
			}
		}
		unix.Close(fd)
	}
	for done := 0; done < spec.Count; done += 100 {
		for range min(100, spec.Count-done) {
			one(sa, &vip)
		}
		for range min(100, spec.Count-done) {
			one(direct, &dir)
		}
	}
	return result{Bench: &benchResult{N: spec.Count, VIP: stats(vip), Direct: stats(dir), Failed: failed, Wrong: wrong}}
}

func stats(v []float64) benchStats {
	if len(v) == 0 {
		return benchStats{}
	}
	slices.Sort(v)
	var sum float64
	for _, x := range v {
		sum += x
	}
	return benchStats{Median: v[len(v)/2], Mean: sum / float64(len(v)), P90: v[len(v)*9/10]}
}
