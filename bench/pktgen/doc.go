// Package pktgen is xdproxy's own traffic generator (this kernel has no
// pktgen module). It writes Ethernet/IPv4 UDP, TCP SYN or TCP ACK frames
// for a chosen number of flows and sends them at a paced rate, for a
// duration or a count, in one of two modes:
//
//   - AF_XDP transmit (copy mode on veth): steady and exactly paced, the
//     mode the zero-loss search uses. One goroutine on one locked OS thread
//     writes frames straight into the socket's UMEM and kicks the kernel
//     once per batch.
//   - BPF_PROG_RUN live frames: an XDP program that rewrites the source
//     port for the flow and redirects to the device, run by the kernel
//     Repeat times per call. Several times faster, but it sends in bursts
//     (a call cannot be paced inside), so it serves to find ceilings.
//
// Frames (Template) are built once; per packet only the flow's source
// address, source port and destination address are written and the IPv4
// and L4 checksums are finished from precomputed partial sums, with no
// allocation. The Sink side of a measurement lives in bench/sink.
//
// Threading: a Sender is used by one goroutine. Send runs until its budget
// is spent or the stop channel closes.
package pktgen
