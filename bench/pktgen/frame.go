package pktgen

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
)

// Proto is what the generator sends.
type Proto int

const (
	UDP    Proto = iota // UDP datagrams
	TCPSyn              // TCP segments with only SYN set
	TCPAck              // TCP segments with only ACK set (mid-stream packets)
)

// ParseProto reads "udp", "tcp-syn" or "tcp-ack".
func ParseProto(s string) (Proto, error) {
	switch s {
	case "udp":
		return UDP, nil
	case "tcp-syn":
		return TCPSyn, nil
	case "tcp-ack":
		return TCPAck, nil
	}
	return 0, fmt.Errorf("pktgen: protocol %q, want udp, tcp-syn or tcp-ack", s)
}

func (p Proto) String() string {
	switch p {
	case UDP:
		return "udp"
	case TCPSyn:
		return "tcp-syn"
	case TCPAck:
		return "tcp-ack"
	}
	return fmt.Sprintf("Proto(%d)", int(p))
}

// Frame sizes count the Ethernet FCS, as RFC 2544 does: a 64-byte frame is
// 60 bytes in memory.
const (
	fcsLen       = 4
	MinFrameSize = 64
	MaxFrameSize = 1518
)

// Header offsets of the frames built here (no VLAN, no IP options).
const (
	ethLen    = 14
	ipOff     = ethLen
	ipLen     = 20
	l4Off     = ipOff + ipLen
	udpLen    = 8
	tcpLen    = 20
	ipSrcOff  = ipOff + 12
	ipDstOff  = ipOff + 16
	ipCsumOff = ipOff + 10
)

// FirstSourcePort and SourcePorts describe the source ports flows use:
// 1024-65535. Flows beyond SourcePorts take the next source address.
const (
	FirstSourcePort = 1024
	SourcePorts     = 65536 - FirstSourcePort
)

// FrameSpec describes the traffic.
type FrameSpec struct {
	Proto  Proto
	Size   int // frame size including FCS, 64..1518
	SrcMAC net.HardwareAddr
	DstMAC net.HardwareAddr
	// Src is the source address of flow 0; flow f uses Src +
	// f/SourcePorts with source port FirstSourcePort + f%SourcePorts.
	Src netip.Addr
	// Dst is the destination of flow 0; flow f goes to Dst + f%Dsts.
	Dst     netip.Addr
	Dsts    int // 0 means 1
	DstPort uint16
	// Flows is the number of distinct 5-tuples, 1..MaxFlows.
	Flows int
}

// MaxFlows bounds FrameSpec.Flows.
const MaxFlows = 1 << 24

// ErrSpec is wrapped by every FrameSpec validation error.
var ErrSpec = errors.New("pktgen: bad frame spec")

func (s FrameSpec) validate() error {
	switch {
	case s.Size < MinFrameSize || s.Size > MaxFrameSize:
		return fmt.Errorf("%w: size %d outside %d..%d", ErrSpec, s.Size, MinFrameSize, MaxFrameSize)
	case len(s.SrcMAC) != 6 || len(s.DstMAC) != 6:
		return fmt.Errorf("%w: source and destination MAC are required", ErrSpec)
	case !s.Src.Is4() || !s.Dst.Is4():
		return fmt.Errorf("%w: source and destination must be IPv4", ErrSpec)
	case s.Flows < 1 || s.Flows > MaxFlows:
		return fmt.Errorf("%w: %d flows outside 1..%d", ErrSpec, s.Flows, MaxFlows)
	case s.Dsts < 0:
		return fmt.Errorf("%w: %d destinations", ErrSpec, s.Dsts)
	case s.Proto != UDP && s.Proto != TCPSyn && s.Proto != TCPAck:
		return fmt.Errorf("%w: protocol %v", ErrSpec, s.Proto)
	}
	return nil
}

// Template is a built frame plus the partial checksums that let Write
// finish a frame for any flow in a few additions.
type Template struct {
	spec    FrameSpec
	frame   []byte
	csumOff int    // offset of the L4 checksum
	ipSum   uint32 // IPv4 header sum without the source and destination address
	l4Sum   uint32 // L4 sum (pseudo header included) without addresses and source port
	src     uint32
	dst     uint32
	dsts    uint32
}

// NewTemplate builds the frame for spec.
func NewTemplate(spec FrameSpec) (*Template, error) {
	if spec.Dsts == 0 {
		spec.Dsts = 1
	}
	if err := spec.validate(); err != nil {
		return nil, err
	}
	n := spec.Size - fcsLen
	f := make([]byte, n)
	copy(f[0:6], spec.DstMAC)
	copy(f[6:12], spec.SrcMAC)
	binary.BigEndian.PutUint16(f[12:14], 0x0800)

	ip := f[ipOff : ipOff+ipLen]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:4], uint16(n-ethLen))
	binary.BigEndian.PutUint16(ip[6:8], 0x4000) // DF
	ip[8] = 64
	l4 := f[l4Off:]
	t := &Template{spec: spec, frame: f, dsts: uint32(spec.Dsts)}
	t.src = be32(spec.Src.As4())
	t.dst = be32(spec.Dst.As4())
	switch spec.Proto {
	case UDP:
		ip[9] = 17
		binary.BigEndian.PutUint16(l4[2:4], spec.DstPort)
		binary.BigEndian.PutUint16(l4[4:6], uint16(len(l4)))
		t.csumOff = l4Off + 6
	default:
		ip[9] = 6
		binary.BigEndian.PutUint16(l4[2:4], spec.DstPort)
		binary.BigEndian.PutUint32(l4[4:8], 0x1000_0000) // sequence number
		l4[12] = 5 << 4
		if spec.Proto == TCPSyn {
			l4[13] = 0x02
		} else {
			l4[13] = 0x10
			binary.BigEndian.PutUint32(l4[8:12], 0x2000_0000)
		}
		binary.BigEndian.PutUint16(l4[14:16], 64240)
		t.csumOff = l4Off + 16
	}
	// Fill the payload with a recognisable pattern.
	hdr := udpLen
	if spec.Proto != UDP {
		hdr = tcpLen
	}
	for i := hdr; i < len(l4); i++ {
		l4[i] = byte(i)
	}
	// Partial sums with addresses, source port and checksums zero.
	t.ipSum = sum16(ip, 0)
	t.l4Sum = sum16(l4, 0) + uint32(ip[9]) + uint32(len(l4))
	return t, nil
}

// Len is the number of bytes Write writes (the frame without FCS).
func (t *Template) Len() int { return len(t.frame) }

// Spec returns the spec with defaults applied.
func (t *Template) Spec() FrameSpec { return t.spec }

// Write writes the frame of flow f (taken modulo Flows) into b, which must
// hold Len bytes, and returns Len. It does not allocate.
func (t *Template) Write(b []byte, f uint64) int {
	n := copy(b, t.frame)
	flow := uint32(f % uint64(t.spec.Flows))
	src := t.src + flow/SourcePorts
	sport := uint32(FirstSourcePort + flow%SourcePorts)
	dst := t.dst + flow%t.dsts
	binary.BigEndian.PutUint32(b[ipSrcOff:], src)
	binary.BigEndian.PutUint32(b[ipDstOff:], dst)
	binary.BigEndian.PutUint16(b[l4Off:], uint16(sport))
	addrs := src>>16 + src&0xffff + dst>>16 + dst&0xffff
	binary.BigEndian.PutUint16(b[ipCsumOff:], ^fold(t.ipSum+addrs))
	l4 := ^fold(t.l4Sum + addrs + sport)
	if l4 == 0 && t.spec.Proto == UDP {
		l4 = 0xffff // 0 means "no checksum" in UDP over IPv4
	}
	binary.BigEndian.PutUint16(b[t.csumOff:], l4)
	return n
}

// Flow returns the addresses and source port of flow f, for tests and
// for telling a ruleset which sources to expect.
func (t *Template) Flow(f uint64) (src netip.Addr, sport uint16, dst netip.Addr) {
	flow := uint32(f % uint64(t.spec.Flows))
	return addr4(t.src + flow/SourcePorts), uint16(FirstSourcePort + flow%SourcePorts), addr4(t.dst + flow%t.dsts)
}

// SourceAddrs is how many consecutive source addresses the flows use.
func (t *Template) SourceAddrs() int { return (t.spec.Flows + SourcePorts - 1) / SourcePorts }

func be32(a [4]byte) uint32 { return binary.BigEndian.Uint32(a[:]) }

func addr4(v uint32) netip.Addr {
	var a [4]byte
	binary.BigEndian.PutUint32(a[:], v)
	return netip.AddrFrom4(a)
}

// sum16 adds b as big-endian 16-bit words to s (one's complement, unfolded).
func sum16(b []byte, s uint32) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

func fold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}
