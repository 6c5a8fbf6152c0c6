// Package route tells a worker where a packet goes next: for a destination
// address, the egress interface, that interface's MAC (the new source MAC)
// and the next hop's MAC (the new destination MAC).
//
// A Cache reads the kernel's main routing table, its neighbour (ARP/NDP)
// table and its links through netlink in one network namespace, and keeps
// following them through netlink subscriptions. Every change produces a new
// immutable snapshot that is published through an atomic pointer, so
// Lookup takes no lock, makes no syscall and does not allocate.
//
// Only interfaces named in Options.Interfaces are egress candidates: a
// destination whose best route leaves through another interface gets
// NotManaged and belongs to the kernel. A destination whose next hop has no
// usable neighbour entry gets NeedsResolution; the Cache then asks the
// kernel, off the packet path, to resolve that neighbour (a netlink
// RTM_NEWNEIGH with NTF_USE, which makes the kernel send ARP or NDP
// solicitations as if it had a packet to send), and the answer arrives as a
// neighbour event that publishes a new snapshot.
//
// The kernel sends such solicitations from the interface's IPv6 link-local
// address and skips them while it has none that is usable (just after the
// link came up); the Cache asks again after Options.ResolveInterval.
//
// Because the workers' packets bypass the kernel, the kernel never sees
// them confirm a neighbour. Lookup therefore asks for the same resolution
// when it uses a STALE entry, which makes the kernel re-probe it (STALE,
// DELAY, PROBE, then REACHABLE or FAILED) the way it would for its own
// traffic, so a next hop that changed its MAC or went away is noticed.
//
// Limits: only the main table is read (no policy routing); of a multipath
// route the first usable next hop is used; routes through an interface that
// is administratively down are ignored.
//
// A Cache must be closed to stop its goroutines and netlink sockets.
package route
