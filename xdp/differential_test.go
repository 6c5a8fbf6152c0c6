package xdp

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"maps"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// FuzzProgramAgainstParse is a differential fuzz of the XDP program against
// the Go side: every frame the fuzzer makes (mutations of the frames
// TestVerdicts uses) is run through the real program with BPF_PROG_RUN,
// against testTables, and through packet.Parse and progModel, a Go model of
// the program's decision order (bpf/xdp.c's header comment) over the same
// tables. The rules it checks:
//
//  1. The program gives XDP_PASS or XDP_REDIRECT (a socket is registered)
//     and counts the frame in exactly one of redirected, passed,
//     no_socket and parse_failed; a redirect in exactly one match counter.
//  2. Not xdproxy's frame: where Parse fails (a Pass* or Drop* reason), or
//     Parse succeeds and the model finds no frontend, flow, remembered
//     fragment or ICMP error about xdproxy's packets, the program must not
//     redirect it. Exceptions are the differences below, each checked as
//     narrowly as it can be.
//  3. xdproxy's frame: where Parse succeeds and the model claims the frame,
//     the program must redirect it, by the same rule (frontend, flow,
//     fragment, icmp_error).
//  4. A first fragment claimed by a frontend or a flow is remembered in the
//     program's frags table under (src, dst, IP id, protocol), unless the
//     program counted frag_track_failed.
//
// Differences kept (the program is the judge of what is xdproxy's, Parse of
// what the dataplane can translate; neither is changed by this test):
//
//   - Length fields. The program checks headers against the end of the
//     frame only: it does not read the IPv4 total length, the IPv6 payload
//     length, the TCP data offset or the UDP length, and it reads only the
//     ports (4 bytes) of the TCP or UDP header an ICMP error quotes, where
//     Parse wants 8 (RFC 792's minimum). So it may claim a frame Parse
//     rejects with DropBadIPTotalLen, DropShortL4, DropBadTCPOffset,
//     DropBadUDPLength or DropShortICMPQuote. That is allowed only when the
//     model, run on programView(frame) (those fields made consistent with
//     the frame), claims it by the same rule: the program then saw the
//     frame as a well-formed one of ours. Such a frame is malformed; the
//     kernel would drop it too (ip_rcv checks the lengths, TCP the data
//     offset, UDP its length, icmp_unreach wants 8 quoted bytes), and the
//     dataplane drops it, counted under Parse's reason.
//   - IPv6 later fragments. The program follows a later fragment to a VIP,
//     or of a datagram whose head it redirected, whatever next header the
//     fragment header names; Parse passes a fragment whose next header is
//     another extension header (PassIPv6ExtHeader). Allowed when the model's
//     fragment rule holds for the fragment. The head of such a datagram
//     (next header an extension header) is never claimed by either, so only
//     fragments to a VIP, which only services use, can differ.
//
// A difference it found and that was fixed on the Go side: Parse took an
// ICMP error quoting an echo of the other ICMP version (type 128 in an
// ICMPv4 quote, or protocol 58 in one) for an echo, and the model then
// claimed the error where the program, rightly, passed it
// (testdata/fuzz/FuzzProgramAgainstParse/11042813f087830b).
//
// Frames shorter than an Ethernet header, which BPF_PROG_RUN refuses, and
// longer than an Ethernet frame with a VLAN tag are skipped. The frags
// table is the only state the program keeps: the seeds' fragment heads are
// remembered by both sides before fuzzing, and what an input adds is
// removed again after it, so inputs do not depend on each other.
func FuzzProgramAgainstParse(f *testing.F) {
	o, a := newTestInstance(f)
	if err := a.RegisterSocket(0, xskSocket(f)); err != nil {
		f.Fatal(err)
	}
	m := newProgModel()
	for _, c := range verdictCases(f) {
		if err := m.compare(f, o, a, c.frame); err != nil {
			f.Fatalf("seed %q: %v", c.name, err)
		}
		f.Add(c.frame)
	}
	primed := maps.Clone(m.frags)
	f.Fuzz(func(t *testing.T, frame []byte) {
		if len(frame) < packet.EthernetLen || len(frame) > maxFuzzFrame {
			t.Skip("BPF_PROG_RUN takes an Ethernet frame")
		}
		err := m.compare(t, o, a, frame)
		m.restore(t, o, primed)
		if err != nil {
			t.Fatal(err)
		}
	})
}

// maxFuzzFrame is the longest frame fuzzed: 1500 bytes of IP, an Ethernet
// header and a VLAN tag.
const maxFuzzFrame = 1500 + packet.EthernetLen + packet.VLANLen

// datagram identifies a fragmented datagram as the frags table does.
type datagram struct {
	src, dst packet.Addr
	id       uint32 // the IPv4 identification or the IPv6 fragment id
	proto    packet.Proto
}

// key is d in the program's layout: the IPv4 id in host order, the IPv6 id
// as it is on the wire.
func (d datagram) key() bpfFragKey {
	k := bpfFragKey{Src: [16]uint8(d.src), Dst: [16]uint8(d.dst), Id: d.id, Proto: uint8(d.proto)}
	if !d.src.Is4() {
		k.Id = binary.NativeEndian.Uint32(binary.BigEndian.AppendUint32(nil, d.id))
	}
	return k
}

// progModel is the program's decision (bpf/xdp.c, "Decision order") over
// packet.Parse's view of a frame and the tables of testTables.
type progModel struct {
	frontends map[Key]bool
	flows     map[FlowKey]bool
	vips      map[packet.Addr]bool
	frags     map[datagram]bool // first fragments claimed by a frontend or a flow
}

func newProgModel() *progModel {
	m := &progModel{frontends: map[Key]bool{}, flows: map[FlowKey]bool{}, vips: map[packet.Addr]bool{}, frags: map[datagram]bool{}}
	for _, k := range testFrontends {
		m.frontends[k] = true
	}
	for _, k := range testFlows {
		m.flows[k] = true
	}
	for _, a := range testVIPs {
		m.vips[a] = true
	}
	return m
}

// decide returns Parse's reason for frame and, when it is OK, the rule that
// claims the frame (passed for none) and the datagram the program must
// remember (nil for none).
func (m *progModel) decide(frame []byte) (packet.Reason, rule, *datagram) {
	var p packet.Packet
	if r := packet.Parse(frame, &p); r != packet.OK {
		return r, passed, nil
	}
	dg := datagram{src: p.Src, dst: p.Dst, id: p.FragID, proto: p.Proto}
	switch {
	case p.IsLaterFragment():
		if m.frags[dg] || m.vips[p.Dst] {
			return packet.OK, fragment, nil
		}
		return packet.OK, passed, nil
	case p.IsICMPError:
		in := p.InnerTuple()
		// Sent toward a backend: the quoted packet reversed is a reply
		// xdproxy waits for. Sent to a client: from a frontend.
		if m.flows[FlowKey{in.Dst, in.Src, in.DstPort, in.SrcPort, in.Proto}] || m.frontends[Key{in.Src, in.SrcPort, in.Proto}] {
			return packet.OK, icmpError, nil
		}
		return packet.OK, passed, nil
	}
	claim := passed
	if m.frontends[Key{p.Dst, p.DstPort, p.Proto}] {
		claim = frontend
	} else if !isEchoRequest(&p) && m.flows[FlowKey{p.Src, p.Dst, p.SrcPort, p.DstPort, p.Proto}] {
		claim = flow
	}
	if claim != passed && p.IsFirstFragment() {
		return packet.OK, claim, &dg
	}
	return packet.OK, claim, nil
}

// isEchoRequest: the identifier of an echo request is the sender's choice,
// so an echo request is never a reply xdproxy waits for.
func isEchoRequest(p *packet.Packet) bool {
	return (p.Proto == packet.ProtoICMP && p.ICMPType == packet.ICMPv4Echo) ||
		(p.Proto == packet.ProtoICMPv6 && p.ICMPType == packet.ICMPv6Echo)
}

// programRule is the rule the program applied, from its counters' change.
func programRule(c Counters) (rule, error) {
	if c.Redirected+c.Passed+c.NoSocket+c.ParseFailed != 1 {
		return 0, fmt.Errorf("not in exactly one outcome counter: %+v", c)
	}
	switch {
	case c.Passed == 1:
		return passed, nil
	case c.ParseFailed == 1:
		return parseFailed, nil
	case c.NoSocket == 1:
		return 0, fmt.Errorf("no_socket with a socket registered: %+v", c)
	}
	matches := map[rule]uint64{frontend: c.MatchFrontend, flow: c.MatchFlow, fragment: c.MatchFragment, icmpError: c.MatchICMPError}
	var got []rule
	for r, n := range matches {
		for range n {
			got = append(got, r)
		}
	}
	if len(got) != 1 {
		return 0, fmt.Errorf("redirected with %d match counters: %+v", len(got), c)
	}
	return got[0], nil
}

func claims(r rule) bool { return r != passed && r != parseFailed }

// compare runs frame through the program and the model and returns what
// breaks the rules of FuzzProgramAgainstParse. The model remembers the
// datagrams it claims first fragments of, as the program does.
func (m *progModel) compare(t testing.TB, o *Objects, a *Attachment, frame []byte) error {
	t.Helper()
	reason, want, dg := m.decide(frame)
	ret, c := runFrame(t, o, a, frame)
	got, err := programRule(c)
	if err == nil {
		err = m.judge(frame, reason, want, got, ret)
	}
	if err != nil {
		return fmt.Errorf("%v\nParse: %v, model: %v; program: verdict %d, counters %+v\n%s", err, reason, want, ret, c, hex.Dump(frame))
	}
	if dg != nil && got == want {
		m.frags[*dg] = true
		var one uint8
		if err := o.frags.Lookup(dg.key(), &one); err != nil && c.FragTrackFailed == 0 {
			return fmt.Errorf("first fragment claimed (%v) but its datagram %+v is not in frags: %v\n%s", got, *dg, err, hex.Dump(frame))
		}
	}
	return nil
}

// judge applies rules 1-3 and the kept differences.
func (m *progModel) judge(frame []byte, reason packet.Reason, want, got rule, ret uint32) error {
	if claims(got) != (ret == xdpRedirect) || (!claims(got) && ret != xdpPass) {
		return fmt.Errorf("verdict %d does not match rule %v", ret, got)
	}
	switch {
	case reason == packet.OK && claims(want):
		if got != want {
			return fmt.Errorf("xdproxy's frame (%v) not claimed the same way: program %v", want, got)
		}
	case !claims(got):
		return nil // not xdproxy's, and not taken
	case reason == packet.OK:
		return fmt.Errorf("program claims (%v) a frame that is not xdproxy's", got)
	case lengthReasons[reason]:
		view := programView(frame)
		r, viewRule, _ := m.decide(view)
		switch {
		case r == packet.OK && viewRule == got:
		case r == packet.PassIPv6ExtHeader && got == fragment && m.laterFragmentClaimed(view):
			// Both differences at once.
		default:
			return fmt.Errorf("program claims (%v) a frame Parse rejects (%v), and not as its length-consistent view (%v, %v)", got, reason, r, viewRule)
		}
	case reason == packet.PassIPv6ExtHeader && got == fragment:
		if !m.laterFragmentClaimed(frame) {
			return fmt.Errorf("program claims an IPv6 later fragment (next header an extension header) the model's fragment rule does not")
		}
	default:
		return fmt.Errorf("program claims (%v) a frame Parse rejects (%v)", got, reason)
	}
	return nil
}

// lengthReasons are Parse's verdicts on length fields the program does not
// read (see "Length fields" above).
var lengthReasons = map[packet.Reason]bool{
	packet.DropBadIPTotalLen:  true,
	packet.DropShortL4:        true,
	packet.DropBadTCPOffset:   true,
	packet.DropBadUDPLength:   true,
	packet.DropShortICMPQuote: true,
}

// programView returns a copy of frame with the fields the program does not
// read made consistent with the frame: the IPv4 total length or IPv6
// payload length reaching the end of the frame, a TCP data offset of 5, a
// UDP length reaching the end of the frame, and an ICMP error's quoted TCP
// or UDP header padded with zeros to 8 bytes (the program reads only its
// ports).
func programView(frame []byte) []byte {
	b := append([]byte(nil), frame...)
	be := binary.BigEndian
	l3 := packet.EthernetLen
	et := be.Uint16(b[12:14])
	if et == packet.EtherTypeVLAN || et == packet.EtherTypeQinQ {
		if len(b) < l3+packet.VLANLen {
			return b
		}
		et = be.Uint16(b[16:18])
		l3 += packet.VLANLen
	}
	var l4 int
	var proto uint8
	var family int
	switch et {
	case packet.EtherTypeIPv4:
		if len(b) < l3+packet.IPv4MinLen {
			return b
		}
		family, proto, l4 = 4, b[l3+9], l3+int(b[l3]&0x0f)*4
		if be.Uint16(b[l3+6:])&0x1fff != 0 {
			l4 = -1 // a later fragment
		}
	case packet.EtherTypeIPv6:
		if len(b) < l3+packet.IPv6Len {
			return b
		}
		family, proto, l4 = 6, b[l3+6], l3+packet.IPv6Len
		if proto == 44 && len(b) >= l4+packet.IPv6FragLen {
			if be.Uint16(b[l4+2:])&0xfff8 != 0 {
				l4 = -1
			} else {
				proto = b[l4]
				l4 += packet.IPv6FragLen
			}
		}
	default:
		return b
	}
	if l4 >= 0 && l4 <= len(b) {
		switch packet.Proto(proto) {
		case packet.ProtoTCP:
			if len(b) >= l4+packet.TCPMinLen {
				b[l4+12] = 5<<4 | b[l4+12]&0x0f
			}
		case packet.ProtoUDP:
			if len(b) >= l4+packet.UDPLen {
				be.PutUint16(b[l4+4:], uint16(len(b)-l4))
			}
		case packet.ProtoICMP, packet.ProtoICMPv6:
			b = padQuote(b, family, l4)
		}
	}
	if family == 4 {
		be.PutUint16(b[l3+2:], uint16(len(b)-l3))
	} else {
		be.PutUint16(b[l3+4:], uint16(len(b)-l3-packet.IPv6Len))
	}
	return b
}

// padQuote pads the TCP or UDP header quoted by the ICMP error at l4 with
// zeros to 8 bytes.
func padQuote(b []byte, family, l4 int) []byte {
	q := l4 + packet.ICMPLen
	var l4q int
	var proto uint8
	switch {
	case family == 4 && len(b) >= q+packet.IPv4MinLen:
		l4q, proto = q+int(b[q]&0x0f)*4, b[q+9]
	case family == 6 && len(b) >= q+packet.IPv6Len:
		l4q, proto = q+packet.IPv6Len, b[q+6]
	default:
		return b
	}
	if (packet.Proto(proto) == packet.ProtoTCP || packet.Proto(proto) == packet.ProtoUDP) && len(b) >= l4q+4 && len(b) < l4q+8 {
		b = append(b, make([]byte, l4q+8-len(b))...)
	}
	return b
}

// laterFragmentClaimed reports whether frame, an IPv6 later fragment,
// meets the model's fragment rule: its datagram remembered, or to a VIP.
func (m *progModel) laterFragmentClaimed(frame []byte) bool {
	be := binary.BigEndian
	l3 := packet.EthernetLen
	if et := be.Uint16(frame[12:14]); et == packet.EtherTypeVLAN || et == packet.EtherTypeQinQ {
		l3 += packet.VLANLen
	}
	h := frame[l3:]
	if len(h) < packet.IPv6Len+packet.IPv6FragLen || h[6] != 44 || be.Uint16(h[packet.IPv6Len+2:])&0xfff8 == 0 {
		return false
	}
	dg := datagram{src: packet.Addr(h[8:24]), dst: packet.Addr(h[24:40]),
		id: be.Uint32(h[packet.IPv6Len+4:]), proto: packet.Proto(h[packet.IPv6Len])}
	return m.frags[dg] || m.vips[dg.dst]
}

// restore removes from the model and from the program's frags table every
// datagram not in keep.
func (m *progModel) restore(t testing.TB, o *Objects, keep map[datagram]bool) {
	t.Helper()
	maps.DeleteFunc(m.frags, func(d datagram, _ bool) bool { return !keep[d] })
	want := map[bpfFragKey]bool{}
	for d := range keep {
		want[d.key()] = true
	}
	var k bpfFragKey
	var v uint8
	var stale []bpfFragKey
	for it := o.frags.Iterate(); it.Next(&k, &v); {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	for _, k := range stale {
		if err := o.frags.Delete(k); err != nil {
			t.Fatalf("frags: delete %+v: %v", k, err)
		}
	}
}

// TestProgramDifferences shows each kept difference of
// FuzzProgramAgainstParse on one frame: Parse rejects it, the program
// claims it, and the fuzz target's judge allows that.
func TestProgramDifferences(t *testing.T) {
	o, a := newTestInstance(t)
	if err := a.RegisterSocket(0, xskSocket(t)); err != nil {
		t.Fatal(err)
	}
	m := newProgModel()
	be := binary.BigEndian
	const ip, l4 = packet.EthernetLen, packet.EthernetLen + packet.IPv4MinLen
	for _, c := range []struct {
		name   string
		frame  []byte
		reason packet.Reason
		rule   rule
	}{
		{"IPv4 total length beyond the frame", edit(tcp4(t, client4, 12345, vip4, 80), func(b []byte) []byte {
			be.PutUint16(b[ip+2:], 1000)
			return b
		}), packet.DropBadIPTotalLen, frontend},
		{"IPv4 total length ending inside the TCP header", edit(tcp4(t, client4, 12345, vip4, 80), func(b []byte) []byte {
			be.PutUint16(b[ip+2:], packet.IPv4MinLen+10)
			return b
		}), packet.DropShortL4, frontend},
		{"TCP data offset beyond the packet", edit(tcp4(t, client4, 12345, vip4, 80), func(b []byte) []byte {
			b[l4+12] = 0xf0
			return b
		}), packet.DropBadTCPOffset, frontend},
		{"UDP length beyond the packet", edit(udp4(t, client4, 5000, vip4, 53), func(b []byte) []byte {
			be.PutUint16(b[l4+4:], 500)
			return b
		}), packet.DropBadUDPLength, frontend},
		{"ICMP error quoting 4 bytes of a masqueraded TCP header", icmpErr4(t, router4, 3, 4,
			ipPacket(t, ip4(node4, backend4, layers.IPProtocolTCP), tcp(61001, 8080))[:packet.IPv4MinLen+4]), packet.DropShortICMPQuote, icmpError},
		{"IPv6 later fragment to a VIP, next header destination options", frag6ID(t, 10, client6, vip6, layers.IPProtocolIPv6Destination, 1448, false,
			gopacket.Payload(make([]byte, 64))), packet.PassIPv6ExtHeader, fragment},
	} {
		reason, _, _ := m.decide(c.frame)
		ret, cs := runFrame(t, o, a, c.frame)
		got, err := programRule(cs)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if reason != c.reason || got != c.rule {
			t.Errorf("%s: Parse %v, program %v; want %v and %v", c.name, reason, got, c.reason, c.rule)
		}
		if err := m.judge(c.frame, reason, passed, got, ret); err != nil {
			t.Errorf("%s: not allowed: %v", c.name, err)
		}
	}
}
