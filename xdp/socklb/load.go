package socklb

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Default table sizes. The hash tables are preallocated: every entry costs
// kernel memory (on the order of 100 bytes) from Load on.
const (
	DefaultMaxFrontends = 65536
	DefaultMaxBackends  = 131072
	DefaultMaxAffinity  = 65536
	DefaultMaxReverse   = 262144
)

// Options size the tables; zero fields take the defaults.
type Options struct {
	// MaxFrontends bounds the frontends (address, port, protocol).
	MaxFrontends int
	// MaxBackends bounds the backends of all distinct backend sets
	// together (frontends with the same backends share one set), and
	// must leave room for the new sets of one SetFrontends call while
	// the old ones are still in place.
	MaxBackends int
	// MaxAffinity bounds the (service, client netns) pairs with session
	// affinity remembered at once; the least recently used goes first.
	MaxAffinity int
	// MaxReverse bounds the sockets whose backend is remembered, for
	// recvmsg and getpeername, and for the backend an unconnected UDP
	// socket keeps; the least recently used goes first (see doc.go).
	MaxReverse int
	// NodeNetnsCookie is the netns cookie (SO_NETNS_COOKIE) of the
	// node's network namespace, the only one where frontends on a
	// loopback address (127.0.0.1 NodePorts) apply. 0: the namespace of
	// the thread that calls Load.
	NodeNetnsCookie uint64
	// PinDir, when set, is a directory on a bpffs where the tables and
	// the cgroup links are pinned, so that they outlive the process:
	// sockets keep being balanced while xdproxy restarts, and the next
	// Load and Attach adopt what they find there (see doc.go).
	PinDir string
}

func (o Options) withDefaults() Options {
	if o.MaxFrontends == 0 {
		o.MaxFrontends = DefaultMaxFrontends
	}
	if o.MaxBackends == 0 {
		o.MaxBackends = DefaultMaxBackends
	}
	if o.MaxAffinity == 0 {
		o.MaxAffinity = DefaultMaxAffinity
	}
	if o.MaxReverse == 0 {
		o.MaxReverse = DefaultMaxReverse
	}
	return o
}

// LB holds the socket programs and their tables.
type LB struct {
	opts Options

	frontends, backends, members *ebpf.Map
	affinity, reverse, counters  *ebpf.Map
	progs                        map[string]*ebpf.Program // by program name
	waiter                       *graceWaiter

	mu    sync.Mutex // serialises SetFrontends, Attach, Detach, Close
	t     tables
	state *state // what the tables hold; nil once closed
	links []*attachment

	adopted      int
	adoptedLinks int
}

// Adopted reports how many of the tables Load took over from an earlier
// process through PinDir (0: they are new). The frontends, backends and
// members tables are adopted together or not at all.
func (lb *LB) Adopted() int { return lb.adopted }

// tableGroup are the tables that must agree with each other: frontends
// point into backends and members.
var tableGroup = []string{bpfMapFrontends, bpfMapBackends, bpfMapMembers}

// Load creates (or, with PinDir, adopts) the tables and loads the
// programs, so that a verifier rejection shows at start-up. It attaches
// nothing: call SetFrontends, then Attach.
func Load(opts Options) (*LB, error) {
	opts = opts.withDefaults()
	for _, n := range []int{opts.MaxFrontends, opts.MaxBackends, opts.MaxAffinity, opts.MaxReverse} {
		if n < 1 || n > 1<<24 {
			return nil, fmt.Errorf("socklb: table size %d out of range 1..%d", n, 1<<24)
		}
	}
	if opts.NodeNetnsCookie == 0 {
		c, err := netnsCookie()
		if err != nil {
			return nil, fmt.Errorf("socklb: the node's netns cookie: %w", err)
		}
		opts.NodeNetnsCookie = c
	}
	spec, err := loadBpf()
	if err != nil {
		return nil, err
	}
	spec.Maps[bpfMapFrontends].MaxEntries = uint32(opts.MaxFrontends)
	spec.Maps[bpfMapBackends].MaxEntries = uint32(opts.MaxBackends)
	spec.Maps[bpfMapMembers].MaxEntries = uint32(opts.MaxBackends)
	spec.Maps[bpfMapAffinity].MaxEntries = uint32(opts.MaxAffinity)
	spec.Maps[bpfMapReverse].MaxEntries = uint32(opts.MaxReverse)
	if err := spec.Variables[bpfVarNodeNetns].Set(opts.NodeNetnsCookie); err != nil {
		return nil, fmt.Errorf("socklb: setting node_netns: %w", err)
	}
	if opts.PinDir != "" {
		if err := checkBPFFS(opts.PinDir); err != nil {
			return nil, err
		}
	}

	lb := &LB{opts: opts, progs: map[string]*ebpf.Program{}}
	maps := map[string]**ebpf.Map{
		bpfMapFrontends: &lb.frontends,
		bpfMapBackends:  &lb.backends,
		bpfMapMembers:   &lb.members,
		bpfMapAffinity:  &lb.affinity,
		bpfMapReverse:   &lb.reverse,
		bpfMapCounters:  &lb.counters,
	}
	// The group is adopted only if all of it matches.
	group := true
	for _, name := range tableGroup {
		group = group && pinnedMatches(opts.PinDir, spec.Maps[name])
	}
	for name, m := range maps {
		adopt := true
		for _, g := range tableGroup {
			if g == name {
				adopt = group
			}
		}
		var ok bool
		if *m, ok, err = newMap(opts.PinDir, spec.Maps[name], adopt); err != nil {
			lb.Close()
			return nil, fmt.Errorf("socklb: creating map %s: %w", name, err)
		}
		if ok {
			lb.adopted++
		}
	}

	replace := map[string]*ebpf.Map{}
	for name, m := range maps {
		replace[name] = *m
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: replace})
	if err != nil {
		lb.Close()
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("socklb: kernel rejected the programs: %+v", ve)
		}
		return nil, fmt.Errorf("socklb: loading programs: %w", err)
	}
	for _, h := range hooks {
		lb.progs[h.prog] = coll.DetachProgram(h.prog)
	}
	coll.Close()

	if lb.waiter, err = newGraceWaiter(); err != nil {
		lb.Close()
		return nil, err
	}
	lb.t = tables{frontends: lb.frontends, backends: lb.backends, members: lb.members, grace: lb.waiter.wait}
	if group {
		lb.state, err = readState(lb.frontends, lb.backends, lb.members)
		if err != nil {
			lb.Close()
			return nil, fmt.Errorf("socklb: reading adopted tables back: %w", err)
		}
	} else {
		lb.state = newState()
	}
	return lb, nil
}

// Close releases the programs and tables. Links that are not pinned are
// detached with it; pinned links stay attached, and their programs keep
// using the pinned tables, until Detach or RemovePins.
func (lb *LB) Close() error {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	var errs []error
	for _, a := range lb.links {
		errs = append(errs, a.link.Close())
	}
	lb.links = nil
	lb.state = nil
	for _, p := range lb.progs {
		if p != nil {
			errs = append(errs, p.Close())
		}
	}
	lb.progs = nil
	for _, m := range []*ebpf.Map{lb.frontends, lb.backends, lb.members, lb.affinity, lb.reverse, lb.counters} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	if lb.waiter != nil {
		errs = append(errs, lb.waiter.close())
	}
	return errors.Join(errs...)
}

// pinnedMatches reports whether dir holds a pinned map of spec's layout.
func pinnedMatches(dir string, spec *ebpf.MapSpec) bool {
	if dir == "" {
		return false
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, spec.Name), nil)
	if err != nil {
		return false
	}
	defer m.Close()
	return sameLayout(m, spec)
}

func sameLayout(m *ebpf.Map, spec *ebpf.MapSpec) bool {
	info, err := m.Info()
	return err == nil && info.Type == spec.Type && info.KeySize == spec.KeySize &&
		info.ValueSize == spec.ValueSize && info.MaxEntries == spec.MaxEntries
}

// newMap creates the table of spec, or with dir adopts the one pinned
// there when adopt allows and its layout matches; otherwise a pinned
// table is replaced.
func newMap(dir string, spec *ebpf.MapSpec, adopt bool) (m *ebpf.Map, adopted bool, err error) {
	if dir == "" {
		m, err = ebpf.NewMap(spec)
		return m, false, err
	}
	path := filepath.Join(dir, spec.Name)
	if old, err := ebpf.LoadPinnedMap(path, nil); err == nil {
		if adopt && sameLayout(old, spec) {
			return old, true, nil
		}
		old.Close()
		if err := os.Remove(path); err != nil {
			return nil, false, fmt.Errorf("replacing pinned %s: %w", path, err)
		}
	}
	m, err = ebpf.NewMap(spec)
	if err != nil {
		return nil, false, err
	}
	if err := m.Pin(path); err != nil {
		m.Close()
		return nil, false, fmt.Errorf("pinning %s: %w", path, err)
	}
	return m, false, nil
}

// bpfFSMagic is BPF_FS_MAGIC, statfs(2)'s f_type of a bpffs.
const bpfFSMagic = 0xcafe4a11

// checkBPFFS makes dir (on a mounted bpffs) if it is missing.
func checkBPFFS(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("socklb: pin directory: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("socklb: pin directory: %w", err)
	}
	if uint32(st.Type) != bpfFSMagic {
		return fmt.Errorf("socklb: pin directory %s is not on a bpffs (mount -t bpf bpf %s)", dir, filepath.Dir(dir))
	}
	return nil
}

// RemovePins removes everything Load and Attach pinned in dir: links that
// nothing else holds are detached, tables that no program uses are freed.
// For xdproxy cleanup.
func RemovePins(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// netnsCookie returns the netns cookie of the calling thread's network
// namespace.
func netnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
}

// graceWaiter waits for an RCU grace period: the kernel waits for every
// running (non-sleepable) BPF program to finish before an update of a
// map-in-map returns, so that user space knows no program still uses the
// old value (maybe_wait_bpf_programs in kernel/bpf/syscall.c). The
// programs here never look at this map; only the wait matters.
type graceWaiter struct {
	outer, inner *ebpf.Map
}

func newGraceWaiter() (*graceWaiter, error) {
	innerSpec := &ebpf.MapSpec{Name: "socklb_grace_in", Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1}
	inner, err := ebpf.NewMap(innerSpec)
	if err != nil {
		return nil, fmt.Errorf("socklb: grace map: %w", err)
	}
	outer, err := ebpf.NewMap(&ebpf.MapSpec{
		Name: "socklb_grace", Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 1,
		InnerMap: innerSpec,
	})
	if err != nil {
		inner.Close()
		return nil, fmt.Errorf("socklb: grace map: %w", err)
	}
	return &graceWaiter{outer: outer, inner: inner}, nil
}

func (g *graceWaiter) wait() error {
	if err := g.outer.Put(uint32(0), g.inner); err != nil {
		return fmt.Errorf("socklb: waiting for running programs: %w", err)
	}
	return nil
}

func (g *graceWaiter) close() error {
	return errors.Join(g.outer.Close(), g.inner.Close())
}
