package conntrack

import (
	"time"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Direction says which way a packet travels relative to the flow's first
// packet.
type Direction uint8

const (
	// Original is the direction of the first packet: client -> frontend.
	Original Direction = iota
	// Reply is the way back: backend -> us.
	Reply
)

func (d Direction) String() string {
	if d == Reply {
		return "reply"
	}
	return "original"
}

// State is the tracked state of a flow. TCP states follow netfilter's names;
// UDP, ICMP echo and other protocols have their own small sets so that one
// number picks the timeout.
type State uint8

// States. StateFree marks an unused entry and is never returned for a flow.
const (
	StateFree State = iota
	TCPNone         // inserted, first packet not yet seen by Update
	TCPSynSent
	TCPSynRecv
	TCPEstablished
	TCPFinWait   // one side sent FIN
	TCPCloseWait // the other side acknowledged that FIN
	TCPLastAck   // both sides sent FIN
	TCPTimeWait  // the last FIN was acknowledged
	TCPClose     // reset seen
	UDPUnreplied
	UDPReplied
	ICMPEcho
	OtherActive // any other protocol (SCTP is tracked without its state machine)

	NumStates
)

var stateNames = [NumStates]string{
	StateFree:      "free",
	TCPNone:        "tcp_none",
	TCPSynSent:     "tcp_syn_sent",
	TCPSynRecv:     "tcp_syn_recv",
	TCPEstablished: "tcp_established",
	TCPFinWait:     "tcp_fin_wait",
	TCPCloseWait:   "tcp_close_wait",
	TCPLastAck:     "tcp_last_ack",
	TCPTimeWait:    "tcp_time_wait",
	TCPClose:       "tcp_close",
	UDPUnreplied:   "udp_unreplied",
	UDPReplied:     "udp_replied",
	ICMPEcho:       "icmp_echo",
	OtherActive:    "other",
}

func (s State) String() string {
	if s < NumStates {
		return stateNames[s]
	}
	return "unknown"
}

// Timeouts is how long a flow lives without packets, per state. A zero field
// takes the default from DefaultTimeouts.
type Timeouts struct {
	TCPSynSent     time.Duration // also used before the first Update (TCPNone)
	TCPSynRecv     time.Duration
	TCPEstablished time.Duration
	TCPFinWait     time.Duration
	TCPCloseWait   time.Duration
	TCPLastAck     time.Duration
	TCPTimeWait    time.Duration
	TCPClose       time.Duration
	UDPUnreplied   time.Duration // netfilter udp_timeout
	UDPReplied     time.Duration // netfilter udp_timeout_stream
	ICMPEcho       time.Duration
	Other          time.Duration // netfilter generic_timeout
}

// DefaultTimeouts are netfilter's defaults (Linux 6.x sysctls
// nf_conntrack_tcp_timeout_*, nf_conntrack_udp_timeout{,_stream},
// nf_conntrack_icmp_timeout, nf_conntrack_generic_timeout).
var DefaultTimeouts = Timeouts{
	TCPSynSent:     120 * time.Second,
	TCPSynRecv:     60 * time.Second,
	TCPEstablished: 432000 * time.Second,
	TCPFinWait:     120 * time.Second,
	TCPCloseWait:   60 * time.Second,
	TCPLastAck:     30 * time.Second,
	TCPTimeWait:    120 * time.Second,
	TCPClose:       10 * time.Second,
	UDPUnreplied:   30 * time.Second,
	UDPReplied:     120 * time.Second,
	ICMPEcho:       30 * time.Second,
	Other:          600 * time.Second,
}

// withDefaults fills zero fields from DefaultTimeouts.
func (t Timeouts) withDefaults() Timeouts {
	pick := func(v, d time.Duration) time.Duration {
		if v <= 0 {
			return d
		}
		return v
	}
	d := DefaultTimeouts
	return Timeouts{
		TCPSynSent:     pick(t.TCPSynSent, d.TCPSynSent),
		TCPSynRecv:     pick(t.TCPSynRecv, d.TCPSynRecv),
		TCPEstablished: pick(t.TCPEstablished, d.TCPEstablished),
		TCPFinWait:     pick(t.TCPFinWait, d.TCPFinWait),
		TCPCloseWait:   pick(t.TCPCloseWait, d.TCPCloseWait),
		TCPLastAck:     pick(t.TCPLastAck, d.TCPLastAck),
		TCPTimeWait:    pick(t.TCPTimeWait, d.TCPTimeWait),
		TCPClose:       pick(t.TCPClose, d.TCPClose),
		UDPUnreplied:   pick(t.UDPUnreplied, d.UDPUnreplied),
		UDPReplied:     pick(t.UDPReplied, d.UDPReplied),
		ICMPEcho:       pick(t.ICMPEcho, d.ICMPEcho),
		Other:          pick(t.Other, d.Other),
	}
}

// byState returns the timeouts in milliseconds indexed by State.
func (t Timeouts) byState() [NumStates]uint64 {
	ms := func(d time.Duration) uint64 { return uint64(d / time.Millisecond) }
	return [NumStates]uint64{
		TCPNone:        ms(t.TCPSynSent),
		TCPSynSent:     ms(t.TCPSynSent),
		TCPSynRecv:     ms(t.TCPSynRecv),
		TCPEstablished: ms(t.TCPEstablished),
		TCPFinWait:     ms(t.TCPFinWait),
		TCPCloseWait:   ms(t.TCPCloseWait),
		TCPLastAck:     ms(t.TCPLastAck),
		TCPTimeWait:    ms(t.TCPTimeWait),
		TCPClose:       ms(t.TCPClose),
		UDPUnreplied:   ms(t.UDPUnreplied),
		UDPReplied:     ms(t.UDPReplied),
		ICMPEcho:       ms(t.ICMPEcho),
		OtherActive:    ms(t.Other),
	}
}

// initialState is the state of a flow of proto right after Insert.
func initialState(p packet.Proto) State {
	switch p {
	case packet.ProtoTCP:
		return TCPNone
	case packet.ProtoUDP:
		return UDPUnreplied
	case packet.ProtoICMP, packet.ProtoICMPv6:
		return ICMPEcho
	}
	return OtherActive
}

// Status bits kept next to the state.
const (
	statusSeenReply   = 1 << 0 // a packet went through in the Reply direction
	statusCloserReply = 1 << 1 // the first FIN came from the Reply direction
)

// next runs the state machine for one packet. It is a pure function of the
// current state, the status bits, the packet's direction and TCP flags.
func next(s State, status uint8, dir Direction, tcpFlags uint8) (State, uint8) {
	if dir == Reply {
		status |= statusSeenReply
	}
	switch s {
	case UDPUnreplied:
		if dir == Reply {
			return UDPReplied, status
		}
		return s, status
	case UDPReplied, ICMPEcho, OtherActive, StateFree:
		return s, status
	}
	return nextTCP(s, status, dir, tcpFlags)
}

// nextTCP is a simplified netfilter TCP machine: it looks at flags and
// direction only, never at sequence numbers or windows.
func nextTCP(s State, status uint8, dir Direction, flags uint8) (State, uint8) {
	closer := Original
	if status&statusCloserReply != 0 {
		closer = Reply
	}
	switch {
	case flags&packet.TCPRst != 0:
		return TCPClose, status
	case flags&packet.TCPSyn != 0 && flags&packet.TCPAck == 0:
		if dir != Original {
			return s, status // simultaneous open is not modelled
		}
		switch s {
		case TCPNone:
			return TCPSynSent, status
		case TCPTimeWait, TCPClose:
			// The client reuses its port: the flow starts over with
			// the same translation.
			return TCPSynSent, 0
		}
		return s, status
	case flags&packet.TCPSyn != 0: // SYN+ACK
		if dir == Reply && (s == TCPNone || s == TCPSynSent) {
			return TCPSynRecv, status
		}
		return s, status
	case flags&packet.TCPFin != 0:
		switch s {
		case TCPNone, TCPSynRecv, TCPEstablished:
			status &^= statusCloserReply
			if dir == Reply {
				status |= statusCloserReply
			}
			return TCPFinWait, status
		case TCPFinWait, TCPCloseWait:
			if dir != closer {
				return TCPLastAck, status
			}
		}
		return s, status
	case flags&packet.TCPAck != 0:
		switch s {
		case TCPNone:
			if dir == Original {
				return TCPEstablished, status // picked up mid-stream, like nf_conntrack_tcp_loose
			}
		case TCPSynRecv:
			if dir == Original {
				return TCPEstablished, status
			}
		case TCPFinWait:
			if dir != closer {
				return TCPCloseWait, status
			}
		case TCPLastAck:
			if dir == closer {
				return TCPTimeWait, status
			}
		}
	}
	return s, status
}
