// Package nat rewrites packets in place the way xdproxy's dataplane
// translates them: addresses, ports and ICMP echo identifiers (DNAT/SNAT),
// TTL, the packet an ICMP error quotes, and the replies xdproxy sends itself
// for services without endpoints (TCP RST, ICMP port unreachable).
//
// Every function works on a frame and the *packet.Packet that packet.Parse
// produced for it, and returned OK. Offsets in the Packet are trusted; a
// Packet from another frame, or one whose Parse failed, must not be passed.
// Functions that change the frame also update the Packet to match, except
// the reply builders, after which the Packet no longer describes the frame.
//
// Checksums are updated incrementally (RFC 1624): the cost of a rewrite does
// not depend on the payload length. This is only correct when the checksum
// was complete to begin with. Frames sent by a local stack over veth carry a
// partial checksum instead (see CompleteIfPartial), so the dataplane must
// call CompleteIfPartial before any rewrite.
//
// Nothing here allocates, locks or makes system calls; all of it runs per
// packet. IPv4 and IPv6 share one code path: IPv6 differs only in having no
// header checksum and in ICMPv6 covering a pseudo-header.
package nat
