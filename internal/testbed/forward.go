package testbed

import (
	"io"
	"net"
	"time"
)

// ForwardInto listens on 127.0.0.1 inside network namespace ns and copies
// every connection to target (host:port in the caller's namespace), so
// that a process in ns reaches a server on the root namespace's loopback
// (an API server on 127.0.0.1, say). Closing the listener stops it.
func ForwardInto(ns, target string) (net.Listener, error) {
	return ForwardIntoAt(ns, "127.0.0.1:0", target)
}

// ForwardIntoAt is ForwardInto listening on listen (host:port in ns).
func ForwardIntoAt(ns, listen, target string) (net.Listener, error) {
	var ln net.Listener
	// The socket belongs to the namespace it was made in; serving it from
	// any thread afterwards is fine.
	err := DoIn(ns, func() (err error) {
		ln, err = net.Listen("tcp", listen)
		return err
	})
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go relay(c, target)
		}
	}()
	return ln, nil
}

func relay(c net.Conn, target string) {
	defer c.Close()
	up, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		return // the client sees a closed connection and retries
	}
	defer up.Close()
	go func() {
		_, _ = io.Copy(up, c)
		_ = up.(*net.TCPConn).CloseWrite()
	}()
	_, _ = io.Copy(c, up)
}
