package dataplane

import (
	"github.com/xdproxy/xdproxy/nat/packet"
	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// IOFloor configures the I/O floor mode, a benchmarking mode and nothing
// else: workers forward every frame they receive untouched but for its
// Ethernet addresses. No parsing, no conntrack, no service table, no
// reply tuples: what is left is the cost of the sockets and of the worker
// loop (receive, transmit, completions, the copy into another interface's
// UMEM), the floor under any translation. Services still decide which
// frames the XDP program hands to the workers. Never run it on a node that
// carries real traffic: nothing is translated or tracked.
type IOFloor struct {
	// Peers are addresses behind the served interfaces, one per
	// direction. A worker sends every frame to the next hop of the first
	// peer that the routes send out of an interface other than the one
	// it received on, with that interface's MAC as source: with two
	// interfaces and a peer behind each, the first forwards to the second
	// and back. Next hops are resolved once per batch (Resolver), so the
	// peers' neighbours are learnt as for any destination.
	Peers []packet.Addr
}

func (f *IOFloor) enabled() bool { return f != nil && len(f.Peers) > 0 }

// floorHop is where this worker's frames go in I/O floor mode.
func (w *Worker) floorHop() (NextHop, packet.Reason) {
	reason := packet.DropNoRoute
	for _, peer := range w.cfg.IOFloor.Peers {
		hop, r := w.resolver.Resolve(peer)
		switch {
		case r != packet.OK:
			reason = r
		case !hop.ViaKernel && hop.Ifindex != w.port.Ifindex:
			return hop, packet.OK
		}
	}
	return NextHop{}, reason
}

// floorBatch is processBatch in I/O floor mode.
func (w *Worker) floorBatch(descs []afxdp.Desc) {
	b := &w.batch
	b.rx += uint64(len(descs))
	hop, r := w.floorHop()
	if r != packet.OK {
		b.byReason[r] += uint64(len(descs))
		w.release = append(w.release, descs...)
	} else {
		sock := w.port.Sock
		for _, d := range descs {
			frame := sock.Frame(d)
			if len(frame) < packet.EthernetLen {
				b.byReason[packet.DropShortEthernet]++
				w.release = append(w.release, d)
				continue
			}
			copy(frame[0:6], hop.Dst[:])
			copy(frame[6:12], hop.Src[:])
			w.toInterface(d, hop.Ifindex)
			b.forwarded++
		}
	}
	w.flushCross()
	w.flushOwn()
	w.Counters.add(b)
}
