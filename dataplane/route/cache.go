package route

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"github.com/xdproxy/xdproxy/nat/packet"
	"golang.org/x/sys/unix"
)

// Options configure a Cache.
type Options struct {
	// Interfaces are the names of the interfaces xdproxy sends through.
	// Interfaces that appear later, or come back with a new index, are
	// picked up by name.
	Interfaces []string
	// Namespace is the network namespace to follow. Nil means the namespace
	// of the thread that calls New. The Cache keeps its own handle.
	Namespace *netns.NsHandle
	// ResolveInterval is the least time between two resolution requests
	// for one neighbour; 0 means one second, the kernel's retransmit time.
	ResolveInterval time.Duration
	// ResyncInterval is how often everything is read again in full, as a
	// guard against lost events; 0 means 30 seconds, negative never.
	ResyncInterval time.Duration
	// ErrorLog, if set, receives errors of the background goroutines.
	ErrorLog func(error)
}

// Stats are the Cache's counters.
type Stats struct {
	Generation      uint64 // snapshots published
	ResolveRequests uint64 // resolutions asked for by Lookup
	ResolveDropped  uint64 // asks lost because the resolver's queue was full
	Resolutions     uint64 // requests sent to the kernel
	ResolveErrors   uint64 // requests the kernel refused
	Resyncs         uint64 // full reads of links, routes and neighbours
	Resubscribes    uint64 // subscriptions lost and made again
	Errors          uint64 // other netlink failures
}

// resolveQueue bounds the resolver's backlog; an ask that finds it full is
// dropped and counted, never waited for.
const resolveQueue = 256

// Cache is the lookup table of a worker's egress. Lookup is safe for any
// number of concurrent callers.
type Cache struct {
	snap      atomic.Pointer[snapshot]
	resolveCh chan neighKey

	opts    Options
	managed map[string]bool
	ns      netns.NsHandle
	nl      *netlink.Handle // used only by the updater goroutine
	nlRes   *netlink.Handle // used only by the resolver goroutine

	st  state
	gen uint64

	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once

	resolveRequests, resolveDropped, resolutions, resolveErrors atomic.Uint64
	resyncs, resubscribes, errs                                 atomic.Uint64
}

// ErrNoInterfaces is returned by New when Options.Interfaces is empty.
var ErrNoInterfaces = errors.New("route: no interfaces configured")

// New reads the namespace's links, main routing table and neighbours,
// publishes the first snapshot and starts following changes.
func New(opts Options) (*Cache, error) { return newCache(opts, (*Cache).subscribe) }

// newCache is New with the first subscription made by subscribe, so tests
// can hand it one they break on purpose.
func newCache(opts Options, subscribe func(*Cache) (*subscription, error)) (*Cache, error) {
	if len(opts.Interfaces) == 0 {
		return nil, ErrNoInterfaces
	}
	if opts.ResolveInterval == 0 {
		opts.ResolveInterval = time.Second
	}
	if opts.ResyncInterval == 0 {
		opts.ResyncInterval = 30 * time.Second
	}
	c := &Cache{
		resolveCh: make(chan neighKey, resolveQueue),
		opts:      opts,
		managed:   map[string]bool{},
		stop:      make(chan struct{}),
	}
	for _, name := range opts.Interfaces {
		c.managed[name] = true
	}
	var err error
	if opts.Namespace != nil {
		var fd int
		if fd, err = unix.Dup(int(*opts.Namespace)); err == nil {
			c.ns = netns.NsHandle(fd)
		}
	} else {
		c.ns, err = netns.Get()
	}
	if err != nil {
		return nil, fmt.Errorf("route: namespace: %w", err)
	}
	if c.nl, err = netlink.NewHandleAt(c.ns); err == nil {
		c.nlRes, err = netlink.NewHandleAt(c.ns)
	}
	if err != nil {
		c.closeHandles()
		return nil, fmt.Errorf("route: netlink: %w", err)
	}
	// Subscribe before reading, so no change falls between the two.
	sub, err := subscribe(c)
	if err != nil {
		c.closeHandles()
		return nil, err
	}
	if err := c.start(sub); err != nil {
		sub.close()
		c.closeHandles()
		return nil, err
	}
	return c, nil
}

// start reads the kernel's state, publishes it and starts following sub.
func (c *Cache) start(sub *subscription) error {
	if err := c.readAll(); err != nil {
		return err
	}
	c.publish()
	c.wg.Add(2)
	go c.update(sub)
	go c.resolve()
	return nil
}

// Close stops following the kernel. Lookup keeps answering from the last
// snapshot.
func (c *Cache) Close() error {
	c.closeOnce.Do(func() {
		close(c.stop)
		c.wg.Wait()
		c.closeHandles()
	})
	return nil
}

func (c *Cache) closeHandles() {
	if c.nl != nil {
		c.nl.Close()
	}
	if c.nlRes != nil {
		c.nlRes.Close()
	}
	c.ns.Close()
}

// Stats returns the counters.
func (c *Cache) Stats() Stats {
	return Stats{
		Generation:      c.snap.Load().gen,
		ResolveRequests: c.resolveRequests.Load(),
		ResolveDropped:  c.resolveDropped.Load(),
		Resolutions:     c.resolutions.Load(),
		ResolveErrors:   c.resolveErrors.Load(),
		Resyncs:         c.resyncs.Load(),
		Resubscribes:    c.resubscribes.Load(),
		Errors:          c.errs.Load(),
	}
}

// Generation numbers the current snapshot; it grows with every change seen.
func (c *Cache) Generation() uint64 { return c.snap.Load().gen }

func (c *Cache) logErr(err error) {
	c.errs.Add(1)
	if c.opts.ErrorLog != nil {
		c.opts.ErrorLog(err)
	}
}

// Lookup returns the next hop for dst. It does not lock, block or allocate.
// On NeedsResolution, Hop carries the interface and next hop address but no
// DstMAC; ask again for later packets.
func (c *Cache) Lookup(dst packet.Addr) (Hop, Status) {
	s := c.snap.Load()
	t := &s.v6
	if dst.Is4() {
		t = &s.v4
	}
	r, ok := t.match(&dst)
	if !ok {
		return Hop{}, NoRoute
	}
	switch r.kind {
	case kindNotManaged:
		return Hop{IfIndex: r.ifindex}, NotManaged
	case kindUnreachable:
		return Hop{}, Unreachable
	case kindNoRoute:
		return Hop{}, NoRoute
	}
	h := Hop{IfIndex: r.ifindex, SrcMAC: r.srcMAC, NextHop: r.gw}
	if r.onLink {
		h.NextHop = dst
	}
	k := neighKey{addr: h.NextHop, ifindex: r.ifindex}
	if i := s.neigh.get(k.wordKey()); i != nil {
		n := &s.neighs[*i]
		if n.usable {
			h.DstMAC = n.mac
			if n.stale && n.asked.Load() == 0 && n.asked.CompareAndSwap(0, 1) {
				c.ask(k)
			}
			return h, Found
		}
		if n.asked.Load() == 0 && n.asked.CompareAndSwap(0, 1) {
			c.ask(k)
		}
		return h, NeedsResolution
	}
	slot, fp := pendingSlot(&k)
	if p := &s.pending[slot]; p.Load() != fp {
		p.Store(fp)
		c.ask(k)
	}
	return h, NeedsResolution
}

// pendingSlot hashes a neighbour key to a slot and a non-zero fingerprint.
func pendingSlot(k *neighKey) (int, uint64) {
	a0, a1 := words(&k.addr)
	h := (a0^uint64(k.ifindex))*0x9e3779b97f4a7c15 ^ a1*0xc2b2ae3d27d4eb4f
	h ^= h >> 29
	return int(h % pendingSlots), h | 1
}

func (c *Cache) ask(k neighKey) {
	select {
	case c.resolveCh <- k:
		c.resolveRequests.Add(1)
	default:
		c.resolveDropped.Add(1)
	}
}

// resolve turns asks into kernel neighbour resolutions, at most one per
// neighbour per ResolveInterval.
func (c *Cache) resolve() {
	defer c.wg.Done()
	last := map[neighKey]time.Time{}
	for {
		var k neighKey
		select {
		case <-c.stop:
			return
		case k = <-c.resolveCh:
		}
		now := time.Now()
		if t, ok := last[k]; ok && now.Sub(t) < c.opts.ResolveInterval {
			continue
		}
		if len(last) > 4096 {
			for key, t := range last {
				if now.Sub(t) >= c.opts.ResolveInterval {
					delete(last, key)
				}
			}
		}
		last[k] = now
		n := &netlink.Neigh{LinkIndex: int(k.ifindex), Family: netlink.FAMILY_V6, IP: net.IP(k.addr[:]), Flags: netlink.NTF_USE}
		if k.addr.Is4() {
			n.Family, n.IP = netlink.FAMILY_V4, net.IP(k.addr[12:])
		}
		c.resolutions.Add(1)
		// NTF_USE makes the kernel create the entry if needed and treat it as
		// wanted by a packet: it solicits the neighbour, or re-probes a stale
		// one, and reports the outcome as neighbour events.
		if err := c.nlRes.NeighSet(n); err != nil {
			c.resolveErrors.Add(1)
			if c.opts.ErrorLog != nil {
				c.opts.ErrorLog(fmt.Errorf("route: resolve %v on ifindex %d: %w", k.addr, k.ifindex, err))
			}
		}
	}
}
