package xdp

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Mode is how a program is attached to an interface.
type Mode int

const (
	// Auto tries Native and falls back to Generic.
	Auto Mode = iota
	// Native runs the program in the driver, before an skb exists.
	Native
	// Generic runs the program in the kernel's receive path on an skb;
	// any driver supports it, slower.
	Generic
)

func (m Mode) String() string {
	switch m {
	case Auto:
		return "auto"
	case Native:
		return "native"
	case Generic:
		return "generic"
	}
	return fmt.Sprintf("mode-%d", int(m))
}

// Errors of Attach, for errors.Is.
var (
	// ErrForeignProgram: another program than ours is attached.
	ErrForeignProgram = errors.New("xdp: interface has another XDP program")
	// ErrBusy: our program is attached through a bpf_link, which a live
	// process (another xdproxy, or this one) holds.
	ErrBusy = errors.New("xdp: interface has xdproxy's program attached by a live process")
)

// Attachment is the program attached to one interface.
type Attachment struct {
	ifname string
	mode   Mode // the mode in effect, never Auto
	link   link.Link
	inst   *instance
	pin    string // where the link is pinned; "" when it is not
	// adopted says the link was found pinned by an earlier process and
	// now runs this Attachment's program.
	adopted bool
}

// Attach loads a program for the interface ifindex and attaches it in the
// given mode. A program of ours left attached through netlink by an older
// or killed xdproxy is detached first; any other program makes Attach fail
// with ErrForeignProgram. The calling thread must be in the interface's
// network namespace.
//
// With Options.PinDir the link is pinned, and a link an earlier process
// pinned for this interface is adopted: the new program replaces the old
// one in place (an atomic swap in the kernel, no moment without a
// program), so frames keep being classified across a restart.
func (o *Objects) Attach(ifindex int, mode Mode) (*Attachment, error) {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %d: %w", ifindex, err)
	}
	attrs := l.Attrs()
	queues := max(attrs.NumRxQueues, 1)
	inst, err := o.newInstance(queues)
	if err != nil {
		return nil, err
	}
	var pin string
	if o.opts.PinDir != "" {
		pin = filepath.Join(o.opts.PinDir, "link-"+attrs.Name)
		if a, err := adoptPinned(pin, l, inst); a != nil || err != nil {
			if err != nil {
				inst.close()
			}
			return a, err
		}
	}
	if err := removeStale(l); err != nil {
		inst.close()
		return nil, err
	}

	var tries []Mode
	switch mode {
	case Auto:
		tries = []Mode{Native, Generic}
	case Native, Generic:
		tries = []Mode{mode}
	default:
		inst.close()
		return nil, fmt.Errorf("xdp: unknown mode %d", int(mode))
	}
	var errs []error
	for _, m := range tries {
		flags := link.XDPGenericMode
		if m == Native {
			flags = link.XDPDriverMode
		}
		lk, err := link.AttachXDP(link.XDPOptions{Program: inst.prog, Interface: ifindex, Flags: flags})
		if err == nil {
			a := &Attachment{ifname: attrs.Name, mode: m, link: lk, inst: inst}
			if pin != "" {
				if err := lk.Pin(pin); err != nil {
					a.Close()
					return nil, fmt.Errorf("xdp: pinning the link of %s: %w", attrs.Name, err)
				}
				a.pin = pin
			}
			return a, nil
		}
		errs = append(errs, fmt.Errorf("%v: %w", m, err))
	}
	inst.close()
	return nil, fmt.Errorf("xdp: attaching to %s: %w", attrs.Name, errors.Join(errs...))
}

// adoptPinned takes over the link pinned at pin if it is an XDP link on l,
// giving it inst's program. A pinned link of another interface (l was
// deleted and created again) is unpinned, which detaches it; then
// adoptPinned returns nil and the caller attaches afresh.
func adoptPinned(pin string, l netlink.Link, inst *instance) (*Attachment, error) {
	lk, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		os.Remove(pin)
		return nil, nil
	}
	attrs := l.Attrs()
	info, err := lk.Info()
	if err == nil && info.Type == link.XDPType && info.XDP() != nil && int(info.XDP().Ifindex) == attrs.Index {
		if err := lk.Update(inst.prog); err != nil {
			lk.Close()
			return nil, fmt.Errorf("xdp: giving the pinned link of %s the new program: %w", attrs.Name, err)
		}
		mode := Native
		if x := attrs.Xdp; x != nil && x.AttachMode == nl.XDP_ATTACHED_SKB {
			mode = Generic
		}
		return &Attachment{ifname: attrs.Name, mode: mode, link: lk, inst: inst, pin: pin, adopted: true}, nil
	}
	// Not this interface's any more.
	lk.Unpin()
	lk.Close()
	return nil, nil
}

// removeStale detaches our program if netlink shows it attached to l.
func removeStale(l netlink.Link) error {
	attrs := l.Attrs()
	x := attrs.Xdp
	if x == nil || !x.Attached {
		return nil
	}
	var flags int
	switch x.AttachMode {
	case nl.XDP_ATTACHED_DRV:
		flags = unix.XDP_FLAGS_DRV_MODE
	case nl.XDP_ATTACHED_SKB:
		flags = unix.XDP_FLAGS_SKB_MODE
	case nl.XDP_ATTACHED_HW:
		flags = unix.XDP_FLAGS_HW_MODE
	default:
		// XDP_ATTACHED_MULTI: programs in several modes at once, never
		// something xdproxy does.
		return fmt.Errorf("%w: %s has XDP programs attached in several modes", ErrForeignProgram, attrs.Name)
	}
	name, err := programName(x.ProgId)
	if err != nil {
		return fmt.Errorf("xdp: %s has XDP program id %d attached: %w", attrs.Name, x.ProgId, err)
	}
	if name != ProgramName {
		return fmt.Errorf("%w: %s has program %q (id %d); detach it or use another interface",
			ErrForeignProgram, attrs.Name, name, x.ProgId)
	}
	err = netlink.LinkSetXdpFdWithFlags(l, -1, flags)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("%w: %s, program id %d, through a bpf_link", ErrBusy, attrs.Name, x.ProgId)
	}
	if err != nil {
		return fmt.Errorf("xdp: detaching stale program id %d from %s: %w", x.ProgId, attrs.Name, err)
	}
	return nil
}

func programName(id uint32) (string, error) {
	p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
	if err != nil {
		return "", err
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return "", err
	}
	return info.Name, nil
}

// Mode returns the mode the program runs in: Native or Generic.
func (a *Attachment) Mode() Mode { return a.mode }

// Interface returns the interface's name at the time of Attach.
func (a *Attachment) Interface() string { return a.ifname }

// RegisterSocket makes the program redirect frames of receive queue queue
// into the AF_XDP socket fd. The socket may be replaced by registering
// another on the same queue.
func (a *Attachment) RegisterSocket(queue, fd int) error {
	if a.inst.xsks == nil {
		return fmt.Errorf("xdp: %s: the egress program takes no sockets", a.ifname)
	}
	if queue < 0 || uint32(queue) >= a.inst.xsks.MaxEntries() {
		return fmt.Errorf("xdp: %s has no queue %d (has %d)", a.ifname, queue, a.inst.xsks.MaxEntries())
	}
	if err := a.inst.xsks.Put(uint32(queue), uint32(fd)); err != nil {
		return fmt.Errorf("xdp: registering socket for %s queue %d: %w", a.ifname, queue, err)
	}
	return nil
}

// UnregisterSocket stops redirecting queue's frames; they reach the kernel
// again.
func (a *Attachment) UnregisterSocket(queue int) error {
	if a.inst.xsks == nil {
		return nil
	}
	err := a.inst.xsks.Delete(uint32(queue))
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("xdp: unregistering socket of %s queue %d: %w", a.ifname, queue, err)
	}
	return nil
}

// Adopted reports whether Attach took over a link an earlier process
// pinned.
func (a *Attachment) Adopted() bool { return a.adopted }

// Close releases the program. An unpinned one is detached; a pinned one
// stays attached, running, for the next process to adopt.
func (a *Attachment) Close() error {
	return errors.Join(a.link.Close(), a.inst.close())
}

// Detach removes the program from the interface, pinned or not.
func (a *Attachment) Detach() error {
	var err error
	if a.pin != "" {
		err = a.link.Unpin()
		a.pin = ""
	}
	return errors.Join(err, a.Close())
}

// AttachEgress attaches the egress program (bpf/xdp.c, xdproxy_egress) to
// the interface's tc egress hook through TCX. With Options.PinDir its
// link is pinned and adopted by the next process like Attach's. The
// Attachment has no sockets: RegisterSocket fails on it.
func (o *Objects) AttachEgress(ifindex int) (*Attachment, error) {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return nil, fmt.Errorf("xdp: interface %d: %w", ifindex, err)
	}
	name := l.Attrs().Name
	inst, err := o.newEgressInstance()
	if err != nil {
		return nil, err
	}
	var pin string
	if o.opts.PinDir != "" {
		pin = filepath.Join(o.opts.PinDir, "egress-"+name)
		lk, err := link.LoadPinnedLink(pin, nil)
		if err == nil {
			info, ierr := lk.Info()
			if ierr == nil && info.Type == link.TCXType && info.TCX() != nil && int(info.TCX().Ifindex) == ifindex {
				if err := lk.Update(inst.prog); err != nil {
					lk.Close()
					inst.close()
					return nil, fmt.Errorf("xdp: giving the pinned egress link of %s the new program: %w", name, err)
				}
				return &Attachment{ifname: name, mode: Native, link: lk, inst: inst, pin: pin, adopted: true}, nil
			}
			lk.Unpin()
			lk.Close()
		} else if !errors.Is(err, os.ErrNotExist) {
			os.Remove(pin)
		}
	}
	lk, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: inst.prog, Attach: ebpf.AttachTCXEgress})
	if err != nil {
		inst.close()
		return nil, fmt.Errorf("xdp: attaching the egress program to %s: %w", name, err)
	}
	a := &Attachment{ifname: name, mode: Native, link: lk, inst: inst}
	if pin != "" {
		if err := lk.Pin(pin); err != nil {
			a.Close()
			return nil, fmt.Errorf("xdp: pinning the egress link of %s: %w", name, err)
		}
		a.pin = pin
	}
	return a, nil
}

// SetEgressRedirect tells the egress programs where to send the replies
// they catch: the interface ifindex (the exception link's kernel end); 0
// makes them let everything go.
func (o *Objects) SetEgressRedirect(ifindex int) error {
	cfg := bpfEgressConfig{RedirectIfindex: uint32(ifindex)}
	if err := o.egressConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("xdp: egress config: %w", err)
	}
	return nil
}
