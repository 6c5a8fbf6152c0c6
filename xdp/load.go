package xdp

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
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

	frontends, flows, frags, addrs, counters *ebpf.Map

	mu    sync.Mutex  // serialises SetTables
	state *tableState // nil: read the maps back before the next sync
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

	o := &Objects{opts: opts, spec: spec, cache: btf.NewCache()}
	for name, m := range map[string]**ebpf.Map{
		bpfMapFrontends: &o.frontends,
		bpfMapFlows:     &o.flows,
		bpfMapFrags:     &o.frags,
		bpfMapAddrs:     &o.addrs,
		bpfMapCounters:  &o.counters,
	} {
		if *m, err = ebpf.NewMap(spec.Maps[name]); err != nil {
			o.Close()
			return nil, fmt.Errorf("xdp: creating map %s: %w", name, err)
		}
	}
	// The maps are new and empty: nothing to read back.
	o.state = &tableState{
		frontends: map[bpfSvcKey]struct{}{},
		addrs:     map[bpfAddrKey]uint32{},
	}

	inst, err := o.newInstance(1)
	if err != nil {
		o.Close()
		return nil, err
	}
	inst.close()
	return o, nil
}

// Close releases the tables. Programs still attached keep their own
// references, so Close every Attachment first.
func (o *Objects) Close() error {
	var errs []error
	for _, m := range []*ebpf.Map{o.frontends, o.flows, o.frags, o.addrs, o.counters} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	return errors.Join(errs...)
}

// instance is one loaded program with its own XSKMAP.
type instance struct {
	prog *ebpf.Program
	xsks *ebpf.Map
}

// newInstance loads a program whose XSKMAP has room for queues receive
// queues, sharing every other map with o.
func (o *Objects) newInstance(queues int) (*instance, error) {
	spec := o.spec.Copy()
	spec.Maps[bpfMapXsks].MaxEntries = uint32(queues)
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		MapReplacements: map[string]*ebpf.Map{
			bpfMapFrontends: o.frontends,
			bpfMapFlows:     o.flows,
			bpfMapFrags:     o.frags,
			bpfMapAddrs:     o.addrs,
			bpfMapCounters:  o.counters,
		},
		Cache: o.cache,
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("xdp: kernel rejected the program: %+v", ve)
		}
		return nil, fmt.Errorf("xdp: loading program: %w", err)
	}
	inst := &instance{
		prog: coll.DetachProgram(bpfProgXdproxyXdp),
		xsks: coll.DetachMap(bpfMapXsks),
	}
	coll.Close() // only the clones of the shared maps are left in it
	return inst, nil
}

func (i *instance) close() error {
	return errors.Join(i.prog.Close(), i.xsks.Close())
}
