package dataplane

import (
	"errors"
	"net"
	"time"

	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
	"github.com/xdproxy/xdproxy/xdp/socklb"
)

// The engine reaches the kernel only through the interfaces in this file.
// NewKernel returns the real one (XDP programs, AF_XDP sockets, BPF maps,
// netlink); the tests give the engine and its workers fakes that keep
// everything in memory, and faulty versions of those that fail on demand,
// so that the batch loop and the failure paths run without privileges.

// Socket is one AF_XDP socket as a worker drives it. *afxdp.Socket is the
// real one; its documentation gives the meaning of each method. A Socket
// is used by one goroutine at a time (see Port for who that is).
type Socket interface {
	Receive(descs []afxdp.Desc) int
	Frame(d afxdp.Desc) []byte
	Transmit(descs []afxdp.Desc) int
	Complete() int
	Refill() int
	Alloc() (afxdp.Desc, bool)
	Release(d afxdp.Desc)
	// Drive makes the kernel do the receive work it needs from us
	// without blocking (a busy-polling socket polls the queue) and
	// reports whether frames wait on the RX ring; the worker's idle spin
	// calls it.
	Drive() bool
	// Wait sleeps until frames arrive or timeout passes.
	Wait(timeout time.Duration) (bool, error)
	Stats() (afxdp.Stats, error)
	FD() int
	Close() error
}

// Link is what the engine knows of one interface.
type Link struct {
	Name  string
	Index int
	MAC   net.HardwareAddr
	// Queues is the number of receive queues (channels) in use now,
	// which an ethtool -L changes; not the number the device could have.
	Queues int
	// MTU is the device's MTU; 0 when unknown.
	MTU int
	// Addrs are its IPv4 and IPv6 addresses, link-local ones excluded.
	Addrs []packet.Addr
}

// Attachment is the XDP program attached to one interface.
type Attachment interface {
	// RegisterSocket makes the program redirect the frames of queue
	// into the socket fd.
	RegisterSocket(queue, fd int) error
	UnregisterSocket(queue int) error
	// Mode is the mode the program runs in.
	Mode() xdp.Mode
	// Adopted says the program took over an attachment an earlier
	// xdproxy left pinned (a restart).
	Adopted() bool
	// Close lets go of the program: a pinned one stays attached for the
	// next process, any other is detached.
	Close() error
	// Detach removes the program from the interface, pinned or not.
	Detach() error
}

// FlowWriter buffers reply tuples for the XDP program and writes them
// with one system call per Flush; see xdp.FlowWriter. One per worker.
type FlowWriter interface {
	Add(reply xdp.FlowKey) bool
	// Flush writes what Add buffered, in order, and says how many were
	// written; on error the rest were not.
	Flush() (int, error)
}

// Tables are the XDP program's tables that every interface shares.
// *xdp.Objects is the real one.
type Tables interface {
	// SetTables makes the program claim exactly these frontends and VIP
	// addresses.
	SetTables(frontends []xdp.Key, vips []packet.Addr) error
	NewFlowWriter(capacity int) FlowWriter
	DeleteFlows(keys []xdp.FlowKey) error
	ForEachFlow(fn func(xdp.FlowKey) bool) error
	Counters() (xdp.Counters, error)
	// SetSYNGuard turns the program's SYN guard on or off.
	SetSYNGuard(g xdp.SYNGuard) error
}

// Kernel is everything the engine asks of the kernel.
type Kernel interface {
	// Link describes the interface name; ErrNoLink when there is none.
	Link(name string) (Link, error)
	// WatchLinks calls changed (from another goroutine) whenever an
	// interface may have come, gone or changed its queues, until stop
	// is called.
	WatchLinks(changed func()) (stop func(), err error)
	// SetChannels sets the number of receive and transmit queues of an
	// interface (ethtool -L).
	SetChannels(name string, queues int) error
	// Attach attaches the XDP program to an interface.
	Attach(ifindex int, mode xdp.Mode) (Attachment, error)
	// AttachEgress attaches the egress program to an interface: it sends
	// the interface's outgoing packets that are exactly replies xdproxy
	// waits for to the interface SetEgressRedirect names.
	AttachEgress(ifindex int) (Attachment, error)
	SetEgressRedirect(ifindex int) error
	// OpenSocket opens an AF_XDP socket on one queue of an interface.
	OpenSocket(ifindex, queue int, cfg afxdp.Config) (Socket, error)
	// ExceptionLink makes sure the veth pair through which frames are
	// handed to the kernel's stack exists and is set up, and returns
	// its kernel end (frames arrive there as if received from a NIC)
	// and xdproxy's end (where a socket transmits them). The kernel routes
	// LocalSNATAddress out of the kernel end to xdproxy's end.
	ExceptionLink(name string) (kernelEnd, xdproxyEnd Link, err error)
	// LocalPortRange is the kernel's ephemeral port range
	// (net.ipv4.ip_local_port_range), where the node's own connections
	// take their source ports.
	LocalPortRange() (conntrack.PortRange, error)
	// ReservePorts adds r to net.ipv4.ip_local_reserved_ports, so the
	// kernel never picks those ports for the node's own connections;
	// added is false when the list held r already.
	ReservePorts(r conntrack.PortRange) (added bool, err error)
	// ReservedPorts is net.ipv4.ip_local_reserved_ports as ranges.
	ReservedPorts() ([]conntrack.PortRange, error)
	// Tables are the program's shared tables.
	Tables() Tables
	// LocalClients is the translation at the socket for clients on the
	// node (pods, host processes), nil when KernelOptions left it out.
	LocalClients() LocalClients
	// Resolver finds next hops through the named interfaces.
	Resolver() Resolver
	// Close releases what the Kernel holds (tables, route cache). It
	// does not remove the exception link, which outlives restarts.
	Close() error
}

// LocalClients translates the service connections of clients on the node
// at their sockets (cgroup BPF programs; *socklb.LB is the real one). Its
// frontends get the backends the table gives local-origin traffic.
type LocalClients interface {
	// Attach hooks the programs to a cgroup v2 (the node's root cgroup:
	// every pod and host process is under it).
	Attach(cgroupPath string) error
	SetFrontends([]socklb.Frontend) error
	// Counters reads the programs' counters.
	Counters() (socklb.Counters, error)
	// Close lets go of the programs, which stay attached when pinned;
	// Detach removes them.
	Close() error
	Detach() error
}

// LocalSNATAddress is the source address of masqueraded flows to backends
// on this node (pods behind veths, the node itself). Their replies are
// addressed to it, and the kernel routes it out of the exception link to
// xdproxy, where a worker translates them; a node address would have the
// kernel deliver them to itself instead.
var LocalSNATAddress = packet.MustParseAddr("169.254.42.2")

// ErrNoLink is returned by Kernel.Link for an interface that does not
// exist.
var ErrNoLink = errors.New("dataplane: no such interface")
