package dataplane

import (
	"sync"

	"github.com/xdproxy/xdproxy/xdp/afxdp"
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
	Sock    *afxdp.Socket

	mu sync.Mutex
}

// NewPort wraps an open socket.
func NewPort(ifindex int, name string, queue int, sock *afxdp.Socket) *Port {
	return &Port{Ifindex: ifindex, Name: name, Queue: queue, Sock: sock}
}

// frameSize is the usable size of one UMEM frame.
func (p *Port) frameSize() int { return p.Sock.Config().FrameSize }
