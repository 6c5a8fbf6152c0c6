// Package xdp loads and attaches xdproxy's XDP program, which sends into
// AF_XDP sockets only the frames xdproxy owns and lets everything else
// (ARP, SSH, pod traffic that is no service's) continue into the kernel.
//
// The program (bpf/xdp.c, compiled by bpf2go; the generated bpf_*.go and
// bpf_*.o files are committed) matches a frame against the tables that
// this package keeps: service frontends and VIP addresses, which SetTables
// writes, and the flows whose replies xdproxy expects, which the
// dataplane's workers write through FlowWriters. Ownership is exact: a
// reply is recognised by its 5-tuple, never by its source or by a port
// range, so the node's own connections on any port, and a client that
// talks to a pod directly, get their packets from the kernel as if xdproxy
// were not there. ICMP errors are claimed only when they quote a packet
// xdproxy sent, and later fragments only when the program redirected
// their first fragment (or they go to a VIP). The C file's header comment
// gives the decision order. A frame it cannot parse is passed; a frame it
// claims for a queue with no socket is dropped and counted (xdproxy is
// restarting, and the kernel would answer it with a reset).
//
// Lifetimes. Load creates the tables once; they are shared by the programs
// of every interface. Attach loads one program per interface, with its own
// XSKMAP, because receive queue numbers repeat across interfaces, and
// attaches it through a bpf_link: if the process dies, the kernel detaches
// the program with the last file descriptor. Attach also replaces a
// program of ours that an older xdproxy left attached through netlink, and
// refuses to touch anyone else's. Close every Attachment, and stop using
// every FlowWriter, before closing the Objects. Attach must run on a thread
// in the network namespace of the interface.
//
// Restarts. With Options.PinDir (a directory on a bpffs) the tables and
// each interface's link are pinned, so they outlive the process: while
// xdproxy restarts, the program keeps claiming its frames (and drops them,
// having no socket to give them to, rather than let the kernel reset the
// connections). The next Load adopts every pinned table whose layout
// still matches (Adopted; a table of another size or version is replaced),
// and the next Attach adopts the interface's pinned link and swaps its own
// program in without a moment's gap. Close then leaves the program
// attached; Detach and RemovePins are what removes it (xdproxy cleanup). A
// link pinned for an interface that has since been deleted and created
// again is dropped, not adopted.
//
// Objects and Attachment methods may be called from several goroutines;
// SetTables calls are serialised. A FlowWriter belongs to one goroutine;
// FlowWriters of several goroutines may flush at once. Nothing here runs
// per packet. FlowWriter.Flush, once per batch that opened connections,
// writes their reply tuples into the reply slots (replyslots.go), memory
// the program reads, with atomic stores and no system call; only tuples
// whose set is full cost one system call for all of them, into the flows
// map. The program looks in both.
//
// No package outside xdp imports cilium/ebpf for this program: the types
// here use nat/packet's Addr and Proto.
package xdp
