// Package feed says how the generator's frames reach the node under test,
// and sets that up on a bench/topo topology. There are two feeds.
//
// NIC ("nic", the default): the node's n0 receives XDP frames, as from a
// NIC driver. The generator transmits (AF_XDP, copy mode) on gx, one end
// of a second veth pair inside the generator namespace; an XDP program on
// the far end, gr, bpf_redirects every frame into g0, and the kernel hands
// it to g0's peer n0 as an xdp_frame (ndo_xdp_xmit). gr's NAPI is threaded
// and pinned to the generator CPU, so the redirect costs the generator's
// core, never the node's. On the node the frame meets an XDP program
// first: xdproxy's, or a plain XDP_PASS (AttachPass) on the kernel paths,
// which then build their skb on the node's core, as a NIC driver does.
//
//	gen ns                                          node ns
//	generator -> gx ==veth== gr [XDP redirect] -> g0 ==veth== n0 [XDP] -> ...
//	CPU gen                  NAPI on CPU gen                  NAPI on CPU fwd
//
// Pod ("pod"): the generator transmits on g0 itself, so n0 receives the
// skbs a veth carries from a pod (an XDP program on n0 sees each only
// after the veth has copied it into an XDP buffer).
//
// A veth accepts redirected frames only while its peer has NAPI (an XDP
// program, or GRO): with the NIC feed, something must be attached to n0
// before traffic flows. The programs are attached through bpf_links owned
// by the process; Close detaches them.
package feed
