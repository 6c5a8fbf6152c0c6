package socklb

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// hook is one of the programs and where it attaches.
type hook struct {
	name   string // in pin names
	prog   string
	attach ebpf.AttachType
}

var hooks = []hook{
	{"connect4", bpfProgSocklbConn4, ebpf.AttachCGroupInet4Connect},
	{"connect6", bpfProgSocklbConn6, ebpf.AttachCGroupInet6Connect},
	{"sendmsg4", bpfProgSocklbSend4, ebpf.AttachCGroupUDP4Sendmsg},
	{"sendmsg6", bpfProgSocklbSend6, ebpf.AttachCGroupUDP6Sendmsg},
	{"recvmsg4", bpfProgSocklbRecv4, ebpf.AttachCGroupUDP4Recvmsg},
	{"recvmsg6", bpfProgSocklbRecv6, ebpf.AttachCGroupUDP6Recvmsg},
	{"getpeername4", bpfProgSocklbPeer4, ebpf.AttachCgroupInet4GetPeername},
	{"getpeername6", bpfProgSocklbPeer6, ebpf.AttachCgroupInet6GetPeername},
}

// attachment is one program's link to one cgroup.
type attachment struct {
	hook    hook
	cgroup  uint64 // cgroup id
	link    link.Link
	pin     string // "" when not pinned
	adopted bool
}

// cgroup2SuperMagic is CGROUP2_SUPER_MAGIC, statfs(2)'s f_type of cgroup2.
const cgroup2SuperMagic = 0x63677270

// cgroupID returns the id of the cgroup v2 directory path: its inode
// number, which is what the kernel reports as the id of a cgroup link.
func cgroupID(path string) (uint64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return 0, err
	}
	if uint32(fs.Type) != cgroup2SuperMagic {
		return 0, fmt.Errorf("%s is not a cgroup v2 directory", path)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// Attach attaches every program to the cgroup v2 at cgroupPath (for
// instance the root of the cgroup2 mount): sockets created by processes in
// it or below are balanced. With Options.PinDir the links are pinned, and
// links an earlier process pinned for this cgroup are adopted: the new
// program replaces the old one in place (link update), so no socket call
// goes untranslated in between. Attach may be called for several cgroups;
// attaching the same cgroup twice is an error.
func (lb *LB) Attach(cgroupPath string) error {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	id, err := cgroupID(cgroupPath)
	if err != nil {
		return fmt.Errorf("socklb: attach: %w", err)
	}
	for _, a := range lb.links {
		if a.cgroup == id {
			return fmt.Errorf("socklb: already attached to %s", cgroupPath)
		}
	}
	var done []*attachment
	for _, h := range hooks {
		a, err := lb.attachOne(h, cgroupPath, id)
		if err != nil {
			for _, d := range done {
				d.release()
			}
			return fmt.Errorf("socklb: attaching %s to %s: %w", h.name, cgroupPath, err)
		}
		done = append(done, a)
	}
	for _, a := range done {
		if a.adopted {
			lb.adoptedLinks++
		}
	}
	lb.links = append(lb.links, done...)
	return nil
}

// AdoptedLinks reports how many links Attach took over from an earlier
// process through PinDir.
func (lb *LB) AdoptedLinks() int {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	return lb.adoptedLinks
}

func (lb *LB) attachOne(h hook, path string, id uint64) (*attachment, error) {
	prog := lb.progs[h.prog]
	if prog == nil {
		return nil, errors.New("LB is closed")
	}
	var pin string
	if lb.opts.PinDir != "" {
		pin = filepath.Join(lb.opts.PinDir, fmt.Sprintf("cgroup%d-%s", id, h.name))
		if a, err := adoptPinned(pin, h, id, prog); a != nil || err != nil {
			return a, err
		}
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: path, Attach: h.attach, Program: prog})
	if err != nil {
		return nil, err
	}
	a := &attachment{hook: h, cgroup: id, link: l}
	if pin != "" {
		if err := l.Pin(pin); err != nil {
			l.Close()
			return nil, fmt.Errorf("pinning: %w", err)
		}
		a.pin = pin
	}
	return a, nil
}

// adoptPinned takes over the link pinned at pin if it attaches h's kind of
// program to cgroup id, giving it prog. Any other link found there is
// unpinned (which detaches it) and adoptPinned returns nil.
func adoptPinned(pin string, h hook, id uint64, prog *ebpf.Program) (*attachment, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		os.Remove(pin)
		return nil, nil
	}
	info, err := l.Info()
	if err == nil && info.Type == link.CgroupType && info.Cgroup() != nil &&
		info.Cgroup().CgroupId == id && ebpf.AttachType(info.Cgroup().AttachType) == h.attach {
		if err := l.Update(prog); err != nil {
			l.Close()
			return nil, fmt.Errorf("giving the pinned link the new program: %w", err)
		}
		return &attachment{hook: h, cgroup: id, link: l, pin: pin, adopted: true}, nil
	}
	l.Unpin()
	l.Close()
	return nil, nil
}

// release undoes an attachment made by a failed Attach: a link it made is
// detached, an adopted one stays pinned (with the new program).
func (a *attachment) release() {
	if !a.adopted && a.pin != "" {
		a.link.Unpin()
	}
	a.link.Close()
}

// Detach removes every link this LB attached or adopted, pinned or not:
// sockets in those cgroups are no longer balanced. Links pinned for
// cgroups this LB did not Attach stay; RemovePins removes them.
func (lb *LB) Detach() error {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	var errs []error
	for _, a := range lb.links {
		if a.pin != "" {
			errs = append(errs, a.link.Unpin())
		}
		errs = append(errs, a.link.Close())
	}
	lb.links = nil
	return errors.Join(errs...)
}
