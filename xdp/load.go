package xdp

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"
)

// ProgramName is the kernel name of xdproxy's XDP program, by which Attach
// recognises a program an earlier xdproxy left behind.
const ProgramName = bpfProgXdproxyXdp

// Default table sizes.
const (
	DefaultMaxFrontends = 65536
	DefaultMaxAddrs     = 65536
	DefaultMaxFlows     = 262144
	DefaultMaxFragments = 8192
	// synSeenSets is the number of 8-entry sets in the SYN guard's table
	// of first SYNs (32 bytes each: 32 MiB). A flood writes entries at
	// its rate; a client's entry must outlive the flood's writes to its
	// set until it retransmits, 1 s and then 3 s and 7 s after its first
	// SYN: at 1 Mpps (a Poisson draw of mean about 1 per set and second)
	// fewer than 8 of the flood's SYNs land in its set in 1 s for all but
	// 1 in 100,000 clients, in 3 s for 99%, in 7 s for 60%.
	synSeenSets = 1 << 20
)

// Options size the shared tables; zero fields take the defaults. Every
// entry of frontends, addrs and flows costs kernel memory up front (the
// hash maps are preallocated).
type Options struct {
	MaxFrontends int
	MaxAddrs     int
	// MaxFlows bounds the replies the program recognises at once (see
	// FlowWriter). The table is a plain hash: when it is full, writes
	// fail (FlowWriter reports which) and nothing is evicted.
	MaxFlows int
	// MaxFragments bounds the datagrams whose later fragments the program
	// follows at once; the least recently used is forgotten first.
	MaxFragments int
	// PinDir, when set, is a directory on a bpffs where the tables and
	// every interface's link are pinned, so that they outlive the process:
	// the program keeps classifying frames while xdproxy restarts, and
	// the next Load and Attach adopt what they find there (see doc.go).
	PinDir string
}

func (o Options) withDefaults() Options {
	if o.MaxFrontends == 0 {
		o.MaxFrontends = DefaultMaxFrontends
	}
	if o.MaxAddrs == 0 {
		o.MaxAddrs = DefaultMaxAddrs
	}
	if o.MaxFlows == 0 {
		o.MaxFlows = DefaultMaxFlows
	}
	if o.MaxFragments == 0 {
		o.MaxFragments = DefaultMaxFragments
	}
	return o
}

// Objects holds the tables shared by every interface's program.
type Objects struct {
	opts  Options
	spec  *ebpf.CollectionSpec // sized; Attach loads programs from it
	cache *btf.Cache

	frontends, flows, frags, addrs, counters, egressConfig *ebpf.Map
	synGuard, synSeen, replySlotsMap                       *ebpf.Map
	// replies is reply_slots mapped into the process: FlowWriter writes
	// there first (replyslots.go).
	replies *replySlots

	mu    sync.Mutex  // serialises SetTables
	state *tableState // nil: read the maps back before the next sync

	// adopted counts the tables Load found pinned by an earlier process
	// and took over.
	adopted int
}

// Adopted reports how many of the shared tables Load took over from an
// earlier process through PinDir (0: they are new).
func (o *Objects) Adopted() int { return o.adopted }

// newMap creates the table name, or with PinDir adopts the one pinned
// there. A pinned table whose layout differs (another version, other
// sizes) is replaced: adopted reports false.
func (o *Objects) newMap(name string) (m *ebpf.Map, adopted bool, err error) {
	spec := o.spec.Maps[name]
	if o.opts.PinDir == "" {
		m, err = ebpf.NewMap(spec)
		return m, false, err
	}
	path := filepath.Join(o.opts.PinDir, name)
	if old, err := ebpf.LoadPinnedMap(path, nil); err == nil {
		info, ierr := old.Info()
		if ierr == nil && info.Type == spec.Type && info.KeySize == spec.KeySize &&
			info.ValueSize == spec.ValueSize && info.MaxEntries == spec.MaxEntries && info.Flags == spec.Flags {
			return old, true, nil
		}
		old.Close()
		if err := os.Remove(path); err != nil {
			return nil, false, fmt.Errorf("replacing pinned %s of another layout: %w", path, err)
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
		return fmt.Errorf("xdp: pin directory: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("xdp: pin directory: %w", err)
	}
	if uint32(st.Type) != bpfFSMagic {
		return fmt.Errorf("xdp: pin directory %s is not on a bpffs (mount -t bpf bpf %s)", dir, filepath.Dir(dir))
	}
	return nil
}

// RemovePins removes everything Load and Attach pinned in dir: programs
// whose link nothing else holds are detached. For xdproxy cleanup.
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

// Load creates the shared tables and checks that the kernel accepts the
// program, so that a verifier rejection shows at start-up, not at the
// first Attach.
func Load(opts Options) (*Objects, error) {
	opts = opts.withDefaults()
	for _, n := range []int{opts.MaxFrontends, opts.MaxAddrs, opts.MaxFlows, opts.MaxFragments} {
		if n < 1 || n > 1<<24 {
			return nil, fmt.Errorf("xdp: table size %d out of range 1..%d", n, 1<<24)
		}
	}
	spec, err := loadBpf()
	if err != nil {
		return nil, err
	}
	spec.Maps[bpfMapFrontends].MaxEntries = uint32(opts.MaxFrontends)
	spec.Maps[bpfMapAddrs].MaxEntries = uint32(opts.MaxAddrs)
	spec.Maps[bpfMapFlows].MaxEntries = uint32(opts.MaxFlows)
	spec.Maps[bpfMapFrags].MaxEntries = uint32(opts.MaxFragments)
	spec.Maps[bpfMapSynSeen].MaxEntries = synSeenSets
	replySetCount := replySets(opts.MaxFlows)
	spec.Maps[bpfMapReplySlots].MaxEntries = uint32(replySlotCount(replySetCount))

	o := &Objects{opts: opts, spec: spec, cache: btf.NewCache()}
	if opts.PinDir != "" {
		if err := checkBPFFS(opts.PinDir); err != nil {
			return nil, err
		}
	}
	adopted, slotsAdopted := 0, false
	for name, m := range map[string]**ebpf.Map{
		bpfMapFrontends:    &o.frontends,
		bpfMapFlows:        &o.flows,
		bpfMapFrags:        &o.frags,
		bpfMapAddrs:        &o.addrs,
		bpfMapCounters:     &o.counters,
		bpfMapEgressConfig: &o.egressConfig,
		bpfMapSynGuard:     &o.synGuard,
		bpfMapSynSeen:      &o.synSeen,
		bpfMapReplySlots:   &o.replySlotsMap,
	} {
		var ok bool
		if *m, ok, err = o.newMap(name); err != nil {
			o.Close()
			return nil, fmt.Errorf("xdp: creating map %s: %w", name, err)
		}
		if ok {
			adopted++
			slotsAdopted = slotsAdopted || name == bpfMapReplySlots
		}
	}
	o.adopted = adopted
	if o.replies, err = openReplySlots(o.replySlotsMap, replySetCount, slotsAdopted); err != nil {
		o.Close()
		return nil, fmt.Errorf("xdp: %w", err)
	}
	if adopted == 0 {
		// The maps are new and empty: nothing to read back.
		o.state = &tableState{
			frontends: map[bpfSvcKey]struct{}{},
			addrs:     map[bpfAddrKey]uint32{},
		}
	}

	inst, err := o.newInstance(1)
	if err != nil {
		o.Close()
		return nil, err
	}
	inst.close()
	if inst, err = o.newEgressInstance(); err != nil {
		o.Close()
		return nil, err
	}
	inst.close()
	return o, nil
}

// Close releases the tables. Programs still attached keep their own
// references, so Close every Attachment first.
func (o *Objects) Close() error {
	errs := []error{o.replies.close()}
	for _, m := range []*ebpf.Map{o.frontends, o.flows, o.frags, o.addrs, o.counters, o.egressConfig, o.synGuard, o.synSeen, o.replySlotsMap} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	return errors.Join(errs...)
}

// instance is one loaded program; an XDP one has its own XSKMAP.
type instance struct {
	prog *ebpf.Program
	xsks *ebpf.Map // nil for the egress program
}

// shared are the maps every program uses in common.
func (o *Objects) shared() map[string]*ebpf.Map {
	return map[string]*ebpf.Map{
		bpfMapFrontends:    o.frontends,
		bpfMapFlows:        o.flows,
		bpfMapFrags:        o.frags,
		bpfMapAddrs:        o.addrs,
		bpfMapCounters:     o.counters,
		bpfMapEgressConfig: o.egressConfig,
		bpfMapSynGuard:     o.synGuard,
		bpfMapSynSeen:      o.synSeen,
		bpfMapReplySlots:   o.replySlotsMap,
	}
}

// load loads the one program prog of the spec, sharing o's maps; queues
// sizes its XSKMAP.
func (o *Objects) load(prog string, queues int) (*ebpf.Collection, error) {
	spec := o.spec.Copy()
	for name := range spec.Programs {
		if name != prog {
			delete(spec.Programs, name)
		}
	}
	spec.Maps[bpfMapXsks].MaxEntries = uint32(queues)
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		MapReplacements: o.shared(),
		Cache:           o.cache,
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("xdp: kernel rejected %s: %+v", prog, ve)
		}
		return nil, fmt.Errorf("xdp: loading %s: %w", prog, err)
	}
	return coll, nil
}

// newInstance loads an XDP program whose XSKMAP has room for queues
// receive queues, sharing every other map with o.
func (o *Objects) newInstance(queues int) (*instance, error) {
	coll, err := o.load(bpfProgXdproxyXdp, queues)
	if err != nil {
		return nil, err
	}
	inst := &instance{
		prog: coll.DetachProgram(bpfProgXdproxyXdp),
		xsks: coll.DetachMap(bpfMapXsks),
	}
	coll.Close() // only the clones of the shared maps are left in it
	return inst, nil
}

// newEgressInstance loads the tc egress program.
func (o *Objects) newEgressInstance() (*instance, error) {
	coll, err := o.load(bpfProgXdproxyEgress, 1)
	if err != nil {
		return nil, err
	}
	inst := &instance{prog: coll.DetachProgram(bpfProgXdproxyEgress)}
	coll.Close()
	return inst, nil
}

func (i *instance) close() error {
	err := i.prog.Close()
	if i.xsks != nil {
		err = errors.Join(err, i.xsks.Close())
	}
	return err
}
