// Package socklb balances the service connections of clients on the node
// itself, pods and host processes, at the socket instead of per packet.
//
// xdproxy's packet path only sees frames that arrive on a NIC. A pod on
// the node, or a host process, that calls a cluster IP, a NodePort (on a
// node address or 127.0.0.1), an external IP or a load-balancer IP sends
// packets that never cross a NIC on their way in. socklb translates them
// where they start, as Cilium's socket LB does: cgroup BPF programs
// (bpf/socklb.c, compiled by bpf2go; the generated bpf_*.go and bpf_*.o
// files are committed) rewrite the destination of connect(2) and
// sendmsg(2) to a backend the program chooses, and rewrite the backend
// back to the frontend in what recvmsg(2) and getpeername(2) return. The
// socket then talks to the backend directly; no packet needs a rewrite,
// and the client sees the address it asked for.
//
// # Programs
//
// One object, eight programs, all attached to one cgroup v2 (Attach):
// connect4/6 (TCP and connected UDP), sendmsg4/6 (unconnected UDP),
// recvmsg4/6 (UDP sources), getpeername4/6. A destination that is no
// frontend is left alone. A frontend's backend is chosen uniformly at
// random (bpf_get_prandom_u32), as kube-proxy does, unless ClientIP
// affinity applies. An unconnected UDP socket keeps the backend it got
// for a frontend (the pin) as long as that backend stays in the
// frontend's set, as conntrack keeps a UDP flow on one endpoint. IPv4,
// IPv6, and IPv4-mapped destinations of dual-stack AF_INET6 sockets are
// translated (frontends are keyed by the mapped address either way).
// Only TCP and UDP: SCTP sockets are not translated.
//
// # Tables
//
//	frontends  (addr, port, proto) -> service id, backend set, count,
//	           affinity timeout, flags.
//	backends   (set, index) -> backend, index < count.
//	members    (set, backend) -> index: "is this backend in the set", so
//	           a remembered backend (affinity, pin) is checked against
//	           the frontend's current backends in one lookup.
//	affinity   LRU (service id, client netns cookie) -> backend, expiry.
//	reverse    LRU (socket cookie, backend) -> frontend, for recvmsg and
//	           getpeername; and (socket cookie, frontend) -> backend, the
//	           pins of unconnected UDP sockets.
//	counters   per-CPU counters (Counters).
//
// # Updates
//
// A backend set is immutable once written. SetFrontends writes the sets
// that are new (the backends first, then their members), then points
// each new or changed frontend at its set with one map update that
// replaces the whole entry (set and count together), deletes the stale
// frontends, and then deletes the sets nothing points at any more, but
// only after an RCU grace period: the kernel waits for every running BPF
// program before an update of a map-in-map returns, and SetFrontends
// updates a private one for that. A program that found a frontend entry
// therefore finds every backend of its set, old or new, never a mix; and
// once SetFrontends has returned, no connect can be given a backend that
// is no longer listed. Frontends with the same backends (a service port's
// cluster IP, NodePorts and load-balancer IPs, usually) share one set, so
// MaxBackends counts distinct sets, plus room for the new sets of one
// call while the old ones still exist. Set ids are never reused while a
// set is in the tables.
//
// One window remains, the kernel's: a hash table hands a replaced or
// deleted element to its next write at once, without waiting for readers
// (true of every BPF hash map). A program interrupted between finding a
// frontend and copying its 24-byte entry, for as long as two more writes
// take, could read a mix. The programs copy the entry first thing.
//
// # Affinity
//
// Kube-proxy's ClientIP affinity is per client address; here it is per
// client network namespace (one pod, or the node's host namespace, whose
// processes share one entry). The first connect picks a backend at
// random and remembers it for the service id with an expiry; a connect
// within the timeout reuses it, and each use moves the expiry to
// now+timeout (bpf_ktime_get_coarse_ns, a few milliseconds coarse). A
// remembered backend that left the frontend's set is replaced by a new
// choice. Entries live in an LRU: beyond MaxAffinity clients the least
// recently used lose their affinity early.
//
// # What the client sees, and limits
//
//   - No endpoints: with Frontend.Reject, connect(2) and sendto(2) fail
//     with ECONNREFUSED (bpf_set_retval), which is what a client of
//     kube-proxy's reject rule gets on TCP; without it they fail with
//     EPERM (the hook's only other answer; kube-proxy would drop, and
//     the client would time out).
//   - Loopback frontends (127.0.0.1 NodePorts, which kube-proxy's
//     iptables mode allows for IPv4) apply only to sockets in the node's
//     network namespace (Options.NodeNetnsCookie): a pod's 127.0.0.1 is
//     its own.
//   - The backend sees the client's own address: there is no
//     masquerade, so masqueradeAll cannot apply to local clients, and a
//     pod that calls its own service and is given itself connects to
//     itself and sees its own address (hairpin), where kube-proxy would
//     masquerade.
//   - getpeername and recvmsg show the frontend only while the socket's
//     reverse entry is in the LRU: with more than MaxReverse sockets
//     talking to services, the oldest show the backend's address.
//     Replies still arrive, since the socket is connected to the backend
//     itself. A socket that sends to two frontends that share a backend
//     sees the last one as the source of that backend's datagrams.
//   - A socket's cgroup is fixed when it is created: sockets created
//     before Attach, or by processes outside the cgroup, are not
//     translated, and neither is traffic that reaches a service address
//     from anywhere else (that is the XDP path's job).
//   - Sockets already connected keep their backend when it leaves the
//     set: TCP connections as with kube-proxy, but also connected UDP
//     sockets, which kube-proxy would move by clearing their conntrack
//     entries (Cilium destroys such sockets with a socket iterator and
//     bpf_sock_destroy; not done here). Unconnected UDP sockets move: a
//     pin is checked against the set on every send.
//
// # Lifetimes
//
// Load creates the tables and loads the programs; Attach links the
// programs to a cgroup; Close releases everything, which detaches links
// that are not pinned. With Options.PinDir (a directory on a bpffs) the
// tables and links are pinned, so they outlive the process: sockets keep
// being balanced, with the last backends written, while xdproxy restarts.
// The next Load adopts the tables whose layout still matches (Adopted;
// frontends, backends and members only together) with their contents and
// reads them back, so its first SetFrontends writes only differences; the
// next Attach of the same cgroup adopts each pinned link and swaps its
// own program in (link update, no gap). Call SetFrontends before Attach,
// so that the new programs start with current tables. Close leaves pinned
// links attached; Detach and RemovePins remove them.
//
// LB methods may be called from several goroutines; they are serialised.
// Nothing here runs per packet: the programs run once per connect(2), per
// sendmsg(2) with an address, and per recvmsg(2) and getpeername(2) that
// asks for the peer.
package socklb
