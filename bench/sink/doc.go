// Package sink is the far end of a benchmark: an XDP program that counts
// every IPv4 frame an interface receives (packets and bytes, per CPU) and
// drops it, and passes everything else (ARP, IPv6) so the neighbour tables
// of the path under test fill normally. Counting in XDP means loss is
// measured where it happens, not guessed from the sender.
//
// Attach must run on a thread inside the interface's network namespace
// (see testbed.DoIn); the Sink object can be read from anywhere. The
// program is attached through a bpf_link, so it goes away with the process
// even if Close is never called.
package sink
