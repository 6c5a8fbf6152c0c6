package xdp

import (
	"encoding/binary"
	"net"
	"testing"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
)

// Test hosts. IPv4 from 198.18.0.0/15, IPv6 from the benchmarking prefix
// 2001:2::/48.
const (
	node4    = "198.18.0.1"
	vip4     = "198.18.1.10"
	backend4 = "198.18.2.20"
	client4  = "198.18.3.30"
	remote4  = "198.18.3.40" // something the node talks to through SNAT
	router4  = "198.18.3.1"

	node6    = "2001:2::1"
	vip6     = "2001:2::10"
	backend6 = "2001:2::20"
	client6  = "2001:2::30"
	remote6  = "2001:2::40"
	router6  = "2001:2::ff"
)

var (
	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
)

func serialize(t testing.TB, ls ...gopacket.SerializableLayer) []byte {
	t.Helper()
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true}, ls...); err != nil {
		t.Fatal(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

func eth(et layers.EthernetType) *layers.Ethernet {
	return &layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: et}
}

func ip4(src, dst string, proto layers.IPProtocol) *layers.IPv4 {
	return &layers.IPv4{Version: 4, TTL: 64, Protocol: proto, SrcIP: net.ParseIP(src).To4(), DstIP: net.ParseIP(dst).To4()}
}

func ip6(src, dst string, next layers.IPProtocol) *layers.IPv6 {
	return &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: next, SrcIP: net.ParseIP(src), DstIP: net.ParseIP(dst)}
}

func tcp(sport, dport uint16) *layers.TCP {
	return &layers.TCP{SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(dport), SYN: true, Window: 1024}
}

func udp(sport, dport uint16) *layers.UDP {
	return &layers.UDP{SrcPort: layers.UDPPort(sport), DstPort: layers.UDPPort(dport)}
}

// tcp4 is an IPv4 TCP frame.
func tcp4(t testing.TB, src string, sport uint16, dst string, dport uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv4), ip4(src, dst, layers.IPProtocolTCP), tcp(sport, dport))
}

func udp4(t testing.TB, src string, sport uint16, dst string, dport uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv4), ip4(src, dst, layers.IPProtocolUDP), udp(sport, dport))
}

func tcp6(t testing.TB, src string, sport uint16, dst string, dport uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv6), ip6(src, dst, layers.IPProtocolTCP), tcp(sport, dport))
}

func udp6(t testing.TB, src string, sport uint16, dst string, dport uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv6), ip6(src, dst, layers.IPProtocolUDP), udp(sport, dport))
}

func echo4(t testing.TB, src, dst string, typ uint8, id uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv4), ip4(src, dst, layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, 0), Id: id, Seq: 1})
}

func echo6(t testing.TB, src, dst string, typ uint8, id uint16) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv6), ip6(src, dst, layers.IPProtocolICMPv6),
		&layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(typ, 0)},
		&layers.ICMPv6Echo{Identifier: id, SeqNumber: 1})
}

// ipPacket returns an IP packet without Ethernet header, for quoting.
func ipPacket(t testing.TB, ls ...gopacket.SerializableLayer) []byte {
	return serialize(t, ls...)
}

// icmpErr4 is an ICMPv4 error from router4 to dst that quotes quote.
func icmpErr4(t testing.TB, dst string, typ, code uint8, quote []byte) []byte {
	return serialize(t, eth(layers.EthernetTypeIPv4), ip4(router4, dst, layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, code)}, gopacket.Payload(quote))
}

// icmpErr6 is an ICMPv6 error from router6 to dst that quotes quote.
func icmpErr6(t testing.TB, dst string, typ, code uint8, quote []byte) []byte {
	// gopacket's ICMPv6 layer is four bytes; the next four (unused, or
	// the MTU of Packet Too Big) come before the quote.
	rest := append([]byte{0, 0, 0x05, 0x00}, quote...)
	return serialize(t, eth(layers.EthernetTypeIPv6), ip6(router6, dst, layers.IPProtocolICMPv6),
		&layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(typ, code)}, gopacket.Payload(rest))
}

// frag4 is an IPv4 fragment at byte offset off carrying payload.
func frag4(t testing.TB, src, dst string, off uint16, more bool, payload ...gopacket.SerializableLayer) []byte {
	return frag4ID(t, 77, src, dst, off, more, payload...)
}

// frag4ID is frag4 with the given IP identification.
func frag4ID(t testing.TB, id uint16, src, dst string, off uint16, more bool, payload ...gopacket.SerializableLayer) []byte {
	ip := ip4(src, dst, layers.IPProtocolTCP)
	ip.Id = id
	ip.FragOffset = off / 8
	if more {
		ip.Flags = layers.IPv4MoreFragments
	}
	return serialize(t, append([]gopacket.SerializableLayer{eth(layers.EthernetTypeIPv4), ip}, payload...)...)
}

// frag6 is an IPv6 fragment at byte offset off whose fragment header says
// next, followed by payload. gopacket cannot serialise the fragment
// header, so it is written by hand.
func frag6(t testing.TB, src, dst string, next layers.IPProtocol, off uint16, more bool, payload ...gopacket.SerializableLayer) []byte {
	return frag6ID(t, 0x1234, src, dst, next, off, more, payload...)
}

// frag6ID is frag6 with the given fragment identification.
func frag6ID(t testing.TB, id uint32, src, dst string, next layers.IPProtocol, off uint16, more bool, payload ...gopacket.SerializableLayer) []byte {
	hdr := make([]byte, 8)
	hdr[0] = byte(next)
	fo := off &^ 7
	if more {
		fo |= 1
	}
	binary.BigEndian.PutUint16(hdr[2:4], fo)
	binary.BigEndian.PutUint32(hdr[4:8], id)
	body := ipPacket(t, payload...)
	return serialize(t, eth(layers.EthernetTypeIPv6), ip6(src, dst, layers.IPProtocolIPv6Fragment),
		gopacket.Payload(append(hdr, body...)))
}

func arp(t testing.TB) []byte {
	return serialize(t, eth(layers.EthernetTypeARP), &layers.ARP{
		AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4,
		HwAddressSize: 6, ProtAddressSize: 4, Operation: layers.ARPRequest,
		SourceHwAddress: macA, SourceProtAddress: net.ParseIP(client4).To4(),
		DstHwAddress: make([]byte, 6), DstProtAddress: net.ParseIP(vip4).To4(),
	})
}

// edit returns a copy of frame with f applied.
func edit(frame []byte, f func(b []byte) []byte) []byte {
	return f(append([]byte(nil), frame...))
}
