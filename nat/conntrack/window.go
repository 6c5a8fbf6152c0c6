package conntrack

import (
	"encoding/binary"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TCPSegment is what UpdateTCP needs from a TCP packet.
type TCPSegment struct {
	Flags uint8 // packet.TCPSyn, packet.TCPAck, ...
	Seq   uint32
	Ack   uint32
	// Window is the window field as on the wire, before scaling.
	Window uint16
	// WScale is the window scale option of a SYN or SYN-ACK (capped at
	// 14); HasWScale says whether the option was present.
	WScale    uint8
	HasWScale bool
	Len       uint32 // payload bytes
}

// ParseTCPSegment reads a TCP segment: tcp runs from the TCP header to the
// end of the IP payload (frame[p.L4:p.End] of a parsed packet). Options
// are read only in SYNs, for the window scale. It does not allocate; it
// returns false if tcp is shorter than its header says.
func ParseTCPSegment(tcp []byte) (TCPSegment, bool) {
	if len(tcp) < 20 {
		return TCPSegment{}, false
	}
	doff := int(tcp[12]>>4) * 4
	if doff < 20 || doff > len(tcp) {
		return TCPSegment{}, false
	}
	var seg TCPSegment
	seg.ReadNoOptions(tcp, doff)
	if seg.Flags&packet.TCPSyn != 0 {
		readWScale(&seg, tcp[20:doff])
	}
	return seg, true
}

// ReadNoOptions is ParseTCPSegment into s for a segment whose header
// length doff the caller checked (20 <= doff <= len(tcp)) and which is not
// a SYN: no option matters then. It inlines into the per-packet path, and
// it writes s in place: a segment returned by value and then copied is a
// failed store-to-load forward on amd64.
func (s *TCPSegment) ReadNoOptions(tcp []byte, doff int) {
	_ = tcp[19]
	s.Seq = binary.BigEndian.Uint32(tcp[4:8])
	s.Ack = binary.BigEndian.Uint32(tcp[8:12])
	s.Flags = tcp[13]
	s.Window = binary.BigEndian.Uint16(tcp[14:16])
	s.WScale, s.HasWScale = 0, false
	s.Len = uint32(len(tcp) - doff)
}

// readWScale reads the window scale option of a SYN from its options.
func readWScale(seg *TCPSegment, opts []byte) {
	for len(opts) > 0 {
		switch opts[0] {
		case 0: // end of options
			return
		case 1: // no-op
			opts = opts[1:]
			continue
		}
		if len(opts) < 2 || opts[1] < 2 || int(opts[1]) > len(opts) {
			return // malformed: keep what the header says
		}
		if opts[0] == 3 && opts[1] == 3 {
			seg.WScale, seg.HasWScale = min(opts[2], maxWScale), true
		}
		opts = opts[opts[1]:]
	}
}

// Closed reports whether flow h is a TCP flow whose connection has ended
// (TIME_WAIT or CLOSE): a SYN from its client on the same tuple then opens
// a new connection. netfilter destroys such a flow and translates the SYN
// afresh, so that a new connection never inherits a backend the service
// may no longer have; a dataplane does the same with Delete. (Update and
// UpdateTCP, given that SYN, restart the flow with its old translation.)
func (t *Table) Closed(h Handle) bool {
	if h.idx == 0 || h.idx > uint32(len(t.entries)) {
		return false
	}
	tm := t.entries[h.idx-1].timer.Load()
	s := timerState(tm)
	return timerGen(tm) == h.gen && (s == TCPTimeWait || s == TCPClose)
}

// UpdateResult says what UpdateTCP did with a packet.
type UpdateResult uint8

const (
	UpdateOK          UpdateResult = iota // the flow was updated: forward the packet
	UpdateGone                            // the flow no longer exists (Update's false)
	UpdateOutOfWindow                     // an RST or FIN outside the window: ignored, drop the packet
)

func (r UpdateResult) String() string {
	switch r {
	case UpdateOK:
		return "ok"
	case UpdateGone:
		return "gone"
	case UpdateOutOfWindow:
		return "out_of_window"
	}
	return "unknown"
}

// Reason maps the result to the dataplane's drop reason: an out-of-window
// RST or FIN does not fit the tracked connection.
func (r UpdateResult) Reason() packet.Reason {
	if r == UpdateOutOfWindow {
		return packet.DropOutOfWindow
	}
	return packet.OK
}

// Window tracking word, one per direction of an entry (entry.win):
//
//	bits  0-31  end: the highest sequence number the side sent, plus one
//	            (seq + payload, SYN and FIN count one)
//	bits 32-47  the largest window the side advertised outside SYNs, raw
//	bits 48-51  the side's window scale option (from its SYN)
//	bit  52     seen: end and the window are known
//	bit  53     the side's SYN carried the window scale option
//	bits 54-63  the entry's generation (low 10 bits): a word of another
//	            lifetime of the entry is never written
const (
	winEndMask    = 1<<32 - 1
	winMaxShift   = 32
	winMaxMask    = 0xffff << winMaxShift
	winScaleShift = 48
	winScaleMask  = 0xf << winScaleShift
	winSeen       = 1 << 52
	winWScaleOK   = 1 << 53
	winTagShift   = 54

	maxWScale = 14 // RFC 7323
	// winLag is how far a side's end may run ahead of the stored one
	// before it is stored again: a bulk sender writes its word once per
	// 16 KiB, not once per packet. Checks allow for the lag.
	winLag = 16 << 10
	// maxUnscaled bounds a window not known yet: no SYN window is larger.
	maxUnscaled = 65535
	// maxAckWindow is how far behind the other side's end an ACK may be
	// when its sender's window is not known (netfilter's MAXACKWINCONST).
	maxAckWindow = 66000
)

func winTag(gen uint16) uint64   { return uint64(gen&0x3ff) << winTagShift }
func winEnd(w uint64) uint32     { return uint32(w) }
func winMaxRaw(w uint64) uint64  { return w & winMaxMask >> winMaxShift }
func sameTag(w, tag uint64) bool { return w>>winTagShift == tag>>winTagShift }

// window is the largest window side w advertised, scaled when both SYNs
// carried the option (other is the other side's word); 0 if unknown.
func window(w, other uint64) int64 {
	win := int64(winMaxRaw(w))
	if w&other&winWScaleOK != 0 {
		win <<= w & winScaleMask >> winScaleShift
	}
	return win
}

// segEnd is seq + len, SYN and FIN counting one.
func segEnd(seg *TCPSegment) uint32 {
	end := seg.Seq + seg.Len
	if seg.Flags&packet.TCPSyn != 0 {
		end++
	}
	if seg.Flags&packet.TCPFin != 0 {
		end++
	}
	return end
}

// inWindow says whether seg, sent by the side whose word is wd to the side
// whose word is wr, fits what is known of the connection; s is the flow's
// state before the packet. The rules are in doc.go ("TCP windows").
func inWindow(s State, wd, wr uint64, seg *TCPSegment) bool {
	if wd&winSeen == 0 {
		if wr&winSeen == 0 {
			return true // nothing known of either side
		}
		if seg.Flags&packet.TCPAck == 0 {
			// RFC 9293: an RST answering a SYN must acknowledge it
			// (a client in SYN-SENT ignores one that does not), and
			// so must one before the handshake is done; in a flow
			// picked up mid-stream, a peer that lost the connection
			// resets without an ACK (seq = the ACK it received).
			return seg.Flags&packet.TCPRst != 0 && s >= TCPEstablished
		}
		return ackInWindow(seg.Ack, wr, wd)
	}
	wnd := window(wr, wd)
	if wnd == 0 {
		wnd = maxUnscaled
	}
	off := int64(int32(seg.Seq - winEnd(wd)))
	end := off + int64(segEnd(seg)-seg.Seq)
	return end >= -wnd && off <= wnd+winLag
}

// ackInWindow says whether ack, sent by the side whose word is wd, may
// acknowledge the other side, whose word wr is known: no further than that
// side's end (plus the lag), no further behind than wd's window.
func ackInWindow(ack uint32, wr, wd uint64) bool {
	off := int64(int32(ack - winEnd(wr)))
	return off <= winLag && off >= -max(maxAckWindow, window(wd, wr))
}

// UpdateTCP is Update for a TCP packet whose header the caller has (see
// ParseTCPSegment): it also tracks, per direction, the highest sequence
// end and the largest window, and ignores an RST or FIN whose sequence
// number is outside the window (doc.go, "TCP windows"): such a packet
// changes nothing and is counted, and UpdateOutOfWindow tells the caller
// to drop it. For other protocols it is Update.
//
// It does not lock or allocate. Beyond Update's work it loads the two
// window words, which share a cache line with the keys Lookup read, and
// writes the sender's word only when its end moved forward by more than
// 16 KiB, it advertised a larger window, or it sent a SYN, FIN or RST.
func (t *Table) UpdateTCP(h Handle, dir Direction, seg *TCPSegment, now int64) (State, UpdateResult) {
	if h.idx == 0 || h.idx > uint32(len(t.entries)) {
		return StateFree, UpdateGone
	}
	e := &t.entries[h.idx-1]
	nowMs := msOf(now)
	tm := e.timer.Load()
	s := timerState(tm)
	if s == StateFree || timerGen(tm) != h.gen {
		return StateFree, UpdateGone
	}
	if s < TCPNone || s > TCPClose {
		ns, ok := t.advance(e, h, dir, seg.Flags, nowMs)
		if !ok {
			return ns, UpdateGone
		}
		return ns, UpdateOK
	}
	dir &= 1
	tag := winTag(h.gen)
	if seg.Flags&(packet.TCPSyn|packet.TCPRst|packet.TCPFin) == 0 {
		// Most segments: data or an ACK that moves its side's end by
		// no more than the lag and does not advertise a larger window.
		// track would record nothing, in the window or not, so only
		// the state machine runs: one load of the window word more than
		// Update.
		wd := e.win[dir].Load()
		if sameTag(wd, tag) && wd&winSeen != 0 && int32(segEnd(seg)-winEnd(wd)) <= winLag &&
			uint64(seg.Window) <= winMaxRaw(wd) {
			ns, ok := t.advance(e, h, dir, seg.Flags, nowMs)
			if !ok {
				return ns, UpdateGone
			}
			return ns, UpdateOK
		}
	}
	if seg.Flags&(packet.TCPRst|packet.TCPFin) != 0 {
		wd, wr := e.win[dir].Load(), e.win[dir^1].Load()
		if !sameTag(wd, tag) || !sameTag(wr, tag) {
			return StateFree, UpdateGone // reused since the timer was read
		}
		// RFC 9293 (3.10.7.3): a client in SYN-SENT that gets an
		// unacceptable ACK, from a peer still holding an older connection
		// of the same tuple (an early-dropped flow's SNAT port handed out
		// again), answers with a RST whose sequence number is that ACK
		// and which carries no ACK. It is outside the client's own window
		// by nature, and it must get through: it is what clears the stale
		// state on the peer.
		staleReset := dir == Original && s < TCPEstablished && seg.Flags&(packet.TCPRst|packet.TCPAck) == packet.TCPRst
		if !staleReset && !inWindow(s, wd, wr, seg) {
			c := &t.ownerOf(h.idx - 1).c
			if seg.Flags&packet.TCPRst != 0 {
				c.outOfWindowRST.Add(1)
			} else {
				c.outOfWindowFIN.Add(1)
			}
			return s, UpdateOutOfWindow
		}
	}
	ns, ok := t.advance(e, h, dir, seg.Flags, nowMs)
	if !ok {
		return ns, UpdateGone
	}
	track(e, tag, dir, s, ns, seg)
	return ns, UpdateOK
}

// track records seg, sent in direction dir, in the window words of e; prev
// and ns are the flow's states before and after the packet. A segment that
// is not in the window is not recorded. A SYN that (re)starts the
// handshake sets its side afresh: the client's SYN when the flow is (again)
// in SYN_SENT, the server's SYN-ACK when it is in SYN_RECV and acknowledges
// the client's SYN.
func track(e *entry, tag uint64, dir Direction, prev, ns State, seg *TCPSegment) {
	wp := &e.win[dir]
	syn := seg.Flags&packet.TCPSyn != 0
	ack := seg.Flags&packet.TCPAck != 0
	reinit := syn && (dir == Original && !ack && ns == TCPSynSent || dir == Reply && ack && ns == TCPSynRecv)
	end := segEnd(seg)
	for {
		wd := wp.Load()
		if !sameTag(wd, tag) {
			return
		}
		wr := e.win[dir^1].Load()
		var nw uint64
		switch {
		case reinit:
			if dir == Reply && wr&winSeen != 0 && !ackInWindow(seg.Ack, wr, wd) {
				return // does not acknowledge the SYN
			}
			nw = tag | winSeen | uint64(end)
			if seg.HasWScale {
				nw |= winWScaleOK | uint64(min(seg.WScale, maxWScale))<<winScaleShift
			}
		case !inWindow(prev, wd, wr, seg):
			return
		case wd&winSeen == 0:
			// First packet of this side (picked up mid-stream, or
			// the first after a restore).
			nw = wd&^winEndMask | winSeen | uint64(end)
		default:
			nw = wd
			off := int32(end - winEnd(wd))
			if off > winLag || off > 0 && seg.Flags&(packet.TCPFin|packet.TCPRst) != 0 {
				nw = nw&^winEndMask | uint64(end)
			}
		}
		if !syn && uint64(seg.Window) > winMaxRaw(nw) {
			nw = nw&^winMaxMask | uint64(seg.Window)<<winMaxShift
		}
		if nw == wd || wp.CompareAndSwap(wd, nw) {
			break
		}
	}
	if reinit && dir == Original && (prev == TCPTimeWait || prev == TCPClose) {
		// The client reuses the flow for a new connection: the
		// server's side belongs to the old one.
		rp := &e.win[Reply]
		for {
			wr := rp.Load()
			if !sameTag(wr, tag) || wr == tag || rp.CompareAndSwap(wr, tag) {
				return
			}
		}
	}
}
