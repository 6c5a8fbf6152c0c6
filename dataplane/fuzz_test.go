package dataplane

import (
	"bytes"
	"testing"

	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// FuzzProcess feeds arbitrary frames to a Processor with real services and
// tracked flows: it must never panic, never write past the frame's length
// (except a reply, within the capacity), and every frame it forwards or
// replies with must have valid checksums when the input's were valid.
func FuzzProcess(f *testing.F) {
	seed := func(proto packet.Proto, src, dst string, sport, dport uint16, flags uint8) {
		f.Add(frame(f, proto, addr(src), addr(dst), sport, dport, flags, []byte("payload")))
	}
	seed(packet.ProtoTCP, "198.18.0.2", "198.19.0.10", 40000, 80, packet.TCPSyn)
	seed(packet.ProtoTCP, "203.0.113.7", "198.19.0.10", 40001, 80, packet.TCPAck)
	seed(packet.ProtoUDP, "198.18.0.2", "198.19.0.20", 40002, 53, 0)
	seed(packet.ProtoUDP, "198.18.0.2", "198.19.0.31", 40003, 53, 0)
	seed(packet.ProtoTCP, "198.18.0.2", "198.19.0.30", 40004, 80, packet.TCPSyn)
	seed(packet.ProtoTCP, "198.18.1.11", "198.18.0.2", 8080, 40000, packet.TCPSyn|packet.TCPAck)
	h := newHarness(f, testModel(), 4096)
	// Track a few flows so that replies and ICMP errors can match.
	for i := uint16(0); i < 4; i++ {
		h.proc.Process(frame(f, packet.ProtoTCP, addr("198.18.0.2"), addr("198.19.0.10"), 40000+i, 80, packet.TCPSyn, nil), 1)
	}
	const guard = 64
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) > 1500 {
			return
		}
		buf := make([]byte, len(in)+guard, 2048)
		copy(buf, in)
		for i := len(in); i < len(buf); i++ {
			buf[i] = 0xa5
		}
		var before packet.Packet
		validIn := packet.Parse(in, &before) == packet.OK && !before.Fragmented &&
			nat.ValidIPHeader(in, &before) && nat.ValidL4(in, &before)
		v := h.proc.Process(buf[:len(in)], 2)
		if v.Action == Forward && !bytes.Equal(buf[len(in):len(in)+guard], bytes.Repeat([]byte{0xa5}, guard)) {
			t.Fatalf("forwarding wrote past the frame")
		}
		if v.Action != Forward && v.Action != Reply {
			return
		}
		if v.Len > cap(buf) || v.Len < packet.EthernetLen {
			t.Fatalf("verdict length %d", v.Len)
		}
		var out packet.Packet
		if r := packet.Parse(buf[:v.Len], &out); r != packet.OK {
			t.Fatalf("output does not parse: %v", r)
		}
		if validIn && !out.Fragmented && (!nat.ValidIPHeader(buf[:v.Len], &out) || !nat.ValidL4(buf[:v.Len], &out)) {
			t.Fatalf("valid input became an invalid %v output", v.Action)
		}
	})
}
