// Package packet parses the frames xdproxy forwards: Ethernet II, one 802.1Q
// tag, IPv4 (options skipped) or IPv6 (fixed header and the fragment header),
// TCP, UDP and ICMP, including the packet an ICMP error quotes.
//
// Parsing never allocates and never reads outside the frame. The caller owns
// a Packet and passes it to Parse for every frame; Parse overwrites it and
// records offsets into the frame instead of copying headers, so a Packet is
// only meaningful together with the frame it was parsed from.
//
// A frame that cannot be forwarded gets a Reason instead of an error value:
// building error values per packet would allocate, and a small enum can be
// counted per reason.
//
// Addresses are Addr, a pointer-free [16]byte holding IPv4 in its
// IPv4-mapped IPv6 form, so that the hash tables built on it stay invisible
// to the garbage collector and IPv6 needs no second set of types.
package packet
