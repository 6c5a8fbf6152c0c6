package feed

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/xdproxy/xdproxy/bench/topo"
	"github.com/xdproxy/xdproxy/internal/testbed"
)

// Kind is a feed.
type Kind string

// The feeds.
const (
	NIC Kind = "nic"
	Pod Kind = "pod"
)

// Kinds lists every feed, the default first.
var Kinds = []Kind{NIC, Pod}

// Parse reads a feed name.
func Parse(s string) (Kind, error) {
	k := Kind(strings.TrimSpace(s))
	if !slices.Contains(Kinds, k) {
		return "", fmt.Errorf("feed %q: want nic or pod", s)
	}
	return k, nil
}

// ParseList reads a comma-separated list of feed names; empty means NIC.
func ParseList(s string) ([]Kind, error) {
	if strings.TrimSpace(s) == "" {
		return []Kind{NIC}, nil
	}
	var out []Kind
	for _, f := range strings.Split(s, ",") {
		k, err := Parse(f)
		if err != nil {
			return nil, err
		}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out, nil
}

// TopoOptions are the topology options the feed needs.
func (k Kind) TopoOptions() topo.Options { return topo.Options{FeedPair: k == NIC} }

// TxIface is the generator namespace's interface the generator transmits on.
func (k Kind) TxIface() string {
	if k == NIC {
		return topo.FeedTxIface
	}
	return topo.GenIface
}

// Describe says, for a report, how frames reach the node and which CPU
// does what.
func (k Kind) Describe(p topo.Plan) string {
	switch k {
	case NIC:
		return fmt.Sprintf("NIC-shaped: the generator sends with AF_XDP on %s, an XDP program on its veth peer %s redirects every frame into %s, so %s receives XDP frames (xdp_frame via ndo_xdp_xmit) as from a NIC driver; CPU %d runs the generator and %s's NAPI (threaded, pinned), CPU %d runs %s's NAPI, which meets the frame with an XDP program first (xdproxy's, or XDP_PASS on the kernel paths, which then build the skb there)",
			topo.FeedTxIface, topo.FeedRedirIface, topo.GenIface, topo.NodeInIface, p.GenCPU, topo.FeedRedirIface, p.ForwardCPU, topo.NodeInIface)
	case Pod:
		return fmt.Sprintf("from a pod's veth: the generator sends with AF_XDP on %s, so %s receives skbs from its veth peer (an XDP program there sees each only after the veth copied it into an XDP buffer); CPU %d runs the generator, CPU %d runs %s's NAPI (threaded, pinned)",
			topo.GenIface, topo.NodeInIface, p.GenCPU, p.ForwardCPU, topo.NodeInIface)
	}
	return string(k)
}

// Feed is a live feed on a topology.
type Feed struct {
	Kind Kind
	// Threads are the generator side's NAPI kthreads (gr's), pinned to the
	// generator CPU; none for Pod.
	Threads []int
	prog    *ebpf.Program
	link    link.Link
}

// Setup prepares t for the feed: for NIC, the redirect program on gr
// (towards g0) with gr's NAPI threaded, pinned to genCPU and given nice.
// For Pod there is nothing to do. t must have been made with
// k.TopoOptions().
func Setup(t *topo.Topology, k Kind, genCPU, nice int) (_ *Feed, err error) {
	f := &Feed{Kind: k}
	if k != NIC {
		return f, nil
	}
	if t.FeedRedirIndex == 0 {
		return nil, errors.New("feed: the topology has no feed pair (topo.Options.FeedPair)")
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.Close())
		}
	}()
	err = testbed.DoIn(t.Gen, func() error {
		f.prog, f.link, err = attach("feed_redirect", redirectProgram(t.GenIndex), t.FeedRedirIndex)
		return err
	})
	if err != nil {
		return nil, err
	}
	if f.Threads, err = t.SetThreaded(t.Gen, topo.FeedRedirIface); err != nil {
		return nil, err
	}
	if err := topo.Pin(genCPU, f.Threads...); err != nil {
		return nil, err
	}
	return f, topo.SetNice(nice, f.Threads...)
}

// Close detaches the redirect program.
func (f *Feed) Close() error {
	var errs []error
	if f.link != nil {
		errs = append(errs, f.link.Close())
		f.link = nil
	}
	if f.prog != nil {
		errs = append(errs, f.prog.Close())
		f.prog = nil
	}
	return errors.Join(errs...)
}

// Pass is an attached XDP_PASS program.
type Pass struct {
	prog *ebpf.Program
	link link.Link
}

// AttachPass attaches a program that passes every frame to ifindex (in the
// calling thread's namespace, see testbed.DoIn): with the NIC feed the
// kernel paths need one on n0, because a veth takes redirected frames only
// while its peer has NAPI, and a real NIC's frames meet the driver's
// receive path, not a veth's skb path.
func AttachPass(ifindex int) (*Pass, error) {
	p, l, err := attach("feed_pass", asm.Instructions{asm.Mov.Imm(asm.R0, xdpPass), asm.Return()}, ifindex)
	if err != nil {
		return nil, err
	}
	return &Pass{prog: p, link: l}, nil
}

// Close detaches the program.
func (p *Pass) Close() error { return errors.Join(p.link.Close(), p.prog.Close()) }

// XDP return codes.
const xdpPass = 2

// redirectProgram: return bpf_redirect(ifindex, 0), which is XDP_REDIRECT.
func redirectProgram(ifindex int) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Imm(asm.R1, int32(ifindex)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
	}
}

func attach(name string, insns asm.Instructions, ifindex int) (*ebpf.Program, link.Link, error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: ebpf.XDP, License: "GPL", Instructions: insns})
	if err != nil {
		return nil, nil, fmt.Errorf("feed: loading %s: %w", name, err)
	}
	l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: link.XDPDriverMode})
	if err != nil {
		prog.Close()
		return nil, nil, fmt.Errorf("feed: attaching %s to ifindex %d: %w", name, ifindex, err)
	}
	return prog, l, nil
}
