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
// UDPReplied means a reply went through; such a flow keeps the unreplied
// timeout until it is assured (see Timeouts.UDPReplied).
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
	// TCPUnacknowledged caps the timeout of an ESTABLISHED flow that is
	// not assured: one picked up mid-stream (an ACK without a handshake)
	// that has not seen a packet from the other side yet. Netfilter
	// nf_conntrack_tcp_timeout_unacknowledged applies the same cap.
	TCPUnacknowledged time.Duration
	// UDPUnreplied is netfilter's udp_timeout: the timeout of a UDP flow
	// until it is assured (unreplied, or replied for less than 2 s).
	UDPUnreplied time.Duration
	// UDPReplied is netfilter's udp_timeout_stream: the timeout of an
	// assured UDP flow (see UDPReplied the state).
	UDPReplied time.Duration
	ICMPEcho   time.Duration
	Other      time.Duration // netfilter generic_timeout
}

// DefaultTimeouts are netfilter's defaults (Linux 6.x sysctls
// nf_conntrack_tcp_timeout_*, nf_conntrack_udp_timeout{,_stream},
// nf_conntrack_icmp_timeout, nf_conntrack_generic_timeout).
var DefaultTimeouts = Timeouts{
	TCPSynSent:        120 * time.Second,
	TCPSynRecv:        60 * time.Second,
	TCPEstablished:    432000 * time.Second,
	TCPFinWait:        120 * time.Second,
	TCPCloseWait:      60 * time.Second,
	TCPLastAck:        30 * time.Second,
	TCPTimeWait:       120 * time.Second,
	TCPClose:          10 * time.Second,
	TCPUnacknowledged: 300 * time.Second,
	UDPUnreplied:      30 * time.Second,
	UDPReplied:        120 * time.Second,
	ICMPEcho:          30 * time.Second,
	Other:             600 * time.Second,
}

// KubeProxyTimeouts are the timeouts a node has under kube-proxy:
// DefaultTimeouts with kube-proxy's two overrides, TCP ESTABLISHED 24h
// (--conntrack-tcp-timeout-established) and CLOSE_WAIT 1h
// (--conntrack-tcp-timeout-close-wait). kube-proxy leaves the UDP timeouts
// at the kernel's values by default, and so does this. The daemon uses
// these unless its configuration says otherwise.
var KubeProxyTimeouts = func() Timeouts {
	t := DefaultTimeouts
	t.TCPEstablished = 24 * time.Hour
	t.TCPCloseWait = time.Hour
	return t
}()

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
		TCPSynSent:        pick(t.TCPSynSent, d.TCPSynSent),
		TCPSynRecv:        pick(t.TCPSynRecv, d.TCPSynRecv),
		TCPEstablished:    pick(t.TCPEstablished, d.TCPEstablished),
		TCPFinWait:        pick(t.TCPFinWait, d.TCPFinWait),
		TCPCloseWait:      pick(t.TCPCloseWait, d.TCPCloseWait),
		TCPLastAck:        pick(t.TCPLastAck, d.TCPLastAck),
		TCPTimeWait:       pick(t.TCPTimeWait, d.TCPTimeWait),
		TCPClose:          pick(t.TCPClose, d.TCPClose),
		TCPUnacknowledged: pick(t.TCPUnacknowledged, d.TCPUnacknowledged),
		UDPUnreplied:      pick(t.UDPUnreplied, d.UDPUnreplied),
		UDPReplied:        pick(t.UDPReplied, d.UDPReplied),
		ICMPEcho:          pick(t.ICMPEcho, d.ICMPEcho),
		Other:             pick(t.Other, d.Other),
	}
}

// byState returns the timeouts in milliseconds indexed by assured (0 or 1)
// and State. Assured only matters for two states: an ESTABLISHED flow that
// is not assured is capped at TCPUnacknowledged, and a UDPReplied flow that
// is not assured yet keeps the unreplied timeout (netfilter's udp_timeout
// until the flow is a stream).
func (t Timeouts) byState() [2][NumStates]uint64 {
	ms := func(d time.Duration) uint64 { return uint64(d / time.Millisecond) }
	assured := [NumStates]uint64{
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
	unassured := assured
	unassured[TCPEstablished] = min(ms(t.TCPEstablished), ms(t.TCPUnacknowledged))
	unassured[UDPReplied] = ms(t.UDPUnreplied)
	return [2][NumStates]uint64{unassured, assured}
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
	statusAssured     = 1 << 2 // the flow is assured: never early-dropped
)

func assuredBit(status uint8) uint8 { return status >> 2 & 1 }

// udpStreamMs is how long after its creation a replied UDP flow must still
// see packets to become a stream (netfilter's stream_ts, 2 s).
const udpStreamMs = 2000

// next runs the state machine for one packet. It is a pure function of the
// current state, the status bits, the packet's direction and TCP flags, and
// for UDP of whether the flow is older than 2 s (udpOld).
func next(s State, status uint8, dir Direction, tcpFlags uint8, udpOld bool) (State, uint8) {
	seenBefore := status&statusSeenReply != 0
	if dir == Reply {
		status |= statusSeenReply
	}
	switch s {
	case UDPUnreplied:
		if dir == Reply {
			return UDPReplied, status
		}
		return s, status
	case UDPReplied:
		// nf_conntrack_udp_packet: with a reply seen before this
		// packet, a packet more than 2 s after the flow began makes
		// it a stream, assured. The first reply itself does not.
		if seenBefore && udpOld {
			status |= statusAssured
		}
		return s, status
	case ICMPEcho, OtherActive, StateFree:
		return s, status
	}
	ns, nst := nextTCP(s, status, dir, tcpFlags)
	// Assured once ESTABLISHED with traffic seen both ways: the final ACK
	// of a handshake (the SYN-ACK was the reply), or a flow picked up
	// mid-stream once the other side answers. The bit stays until a SYN
	// restarts the flow.
	if ns == TCPEstablished && nst&statusSeenReply != 0 {
		nst |= statusAssured
	}
	return ns, nst
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
