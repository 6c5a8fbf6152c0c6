package dataplane

import (
	"net"
	"sync"
)

// Port is one AF_XDP socket: one queue of one interface. Its receive ring
// belongs to the worker that owns the port; everything else on the socket
// (the free-frame stack, fill, TX and completion rings) is shared with
// workers on other ports that forward into this interface, so it is taken
// under mu — once per batch and egress port, never per packet.
type Port struct {
	Ifindex int
	Name    string
	Queue   int
	MAC     net.HardwareAddr
	Sock    Socket
	// FrameSize is the usable size of one of the socket's frames.
	FrameSize int

	mu     sync.Mutex
	closed bool // under mu: the socket is closed, transmit nothing
}

// NewPort wraps an open socket.
func NewPort(l Link, queue int, sock Socket, frameSize int) *Port {
	return &Port{Ifindex: l.Index, Name: l.Name, Queue: queue, MAC: l.MAC, Sock: sock, FrameSize: frameSize}
}

// close marks the port closed and closes its socket. Its own worker must
// have stopped; other workers find it closed under mu and drop what they
// would have sent.
func (p *Port) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	return p.Sock.Close()
}
