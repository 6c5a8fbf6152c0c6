package route

import (
	"errors"
	"fmt"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// subscription is one set of netlink event sockets. The netlink library
// closes a channel when its socket fails (an overrun, for instance); the
// updater then subscribes again and reads everything anew.
type subscription struct {
	routes chan netlink.RouteUpdate
	neighs chan netlink.NeighUpdate
	links  chan netlink.LinkUpdate
	done   chan struct{}
}

// close ends the subscription. The library's receive goroutines may be
// blocked sending into a full channel; drain until they close them.
func (s *subscription) close() {
	close(s.done)
	go func() {
		for range s.routes {
		}
	}()
	go func() {
		for range s.neighs {
		}
	}()
	go func() {
		for range s.links {
		}
	}()
}

func (s *subscription) closed() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// eventQueue is the room each event channel has while the updater compiles.
const eventQueue = 1024

// receiveBuffer is asked for each event socket so a burst of changes does
// not overrun it.
const receiveBuffer = 4 << 20

func (c *Cache) subscribe() (*subscription, error) {
	s := &subscription{
		routes: make(chan netlink.RouteUpdate, eventQueue),
		neighs: make(chan netlink.NeighUpdate, eventQueue),
		links:  make(chan netlink.LinkUpdate, eventQueue),
		done:   make(chan struct{}),
	}
	onErr := func(err error) {
		if !s.closed() { // closing the socket ourselves is no error
			c.logErr(fmt.Errorf("route: subscription: %w", err))
		}
	}
	// A channel the library did not take is closed here, so close can
	// drain all three alike.
	err := netlink.RouteSubscribeWithOptions(s.routes, s.done, netlink.RouteSubscribeOptions{
		Namespace: &c.ns, ErrorCallback: onErr, ReceiveBufferSize: receiveBuffer, ReceiveBufferForceSize: true,
	})
	if err != nil {
		close(s.routes)
		close(s.neighs)
		close(s.links)
	} else if err = netlink.NeighSubscribeWithOptions(s.neighs, s.done, netlink.NeighSubscribeOptions{
		Namespace: &c.ns, ErrorCallback: onErr, ReceiveBufferSize: receiveBuffer, ReceiveBufferForceSize: true,
	}); err != nil {
		close(s.neighs)
		close(s.links)
	} else if err = netlink.LinkSubscribeWithOptions(s.links, s.done, netlink.LinkSubscribeOptions{
		Namespace: &c.ns, ErrorCallback: onErr, ReceiveBufferSize: receiveBuffer, ReceiveBufferForceSize: true,
	}); err != nil {
		close(s.links)
	}
	if err != nil {
		s.close()
		return nil, fmt.Errorf("route: subscribe: %w", err)
	}
	return s, nil
}

// dumpRetries bounds the re-reads of a dump the kernel marked interrupted
// (the table changed while it was read).
const dumpRetries = 5

func retryDump[T any](list func() ([]T, error)) ([]T, error) {
	for i := 0; ; i++ {
		v, err := list()
		if !errors.Is(err, netlink.ErrDumpInterrupted) || i == dumpRetries {
			return v, err
		}
	}
}

func (c *Cache) readLinks() error {
	links, err := retryDump(c.nl.LinkList)
	if err != nil {
		return fmt.Errorf("route: list links: %w", err)
	}
	c.st.links = make(map[int]linkInfo, len(links))
	for _, l := range links {
		a := l.Attrs()
		info := linkInfo{name: a.Name, up: a.Flags&unix.IFF_UP != 0 || a.RawFlags&unix.IFF_UP != 0, managed: c.managed[a.Name]}
		copy(info.mac[:], a.HardwareAddr)
		c.st.links[a.Index] = info
	}
	return nil
}

func (c *Cache) readRoutes() error {
	routes, err := retryDump(func() ([]netlink.Route, error) {
		return c.nl.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	})
	if err != nil {
		return fmt.Errorf("route: list routes: %w", err)
	}
	c.st.routes = routes
	return nil
}

func (c *Cache) readNeighs() error {
	c.st.neighs = map[neighKey]neighInfo{}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		neighs, err := retryDump(func() ([]netlink.Neigh, error) { return c.nl.NeighList(0, family) })
		if err != nil {
			return fmt.Errorf("route: list neighbours: %w", err)
		}
		for i := range neighs {
			c.applyNeigh(unix.RTM_NEWNEIGH, &neighs[i])
		}
	}
	return nil
}

// readAll reads links first: which neighbours are kept depends on them.
func (c *Cache) readAll() error {
	c.resyncs.Add(1)
	if err := c.readLinks(); err != nil {
		return err
	}
	if err := c.readRoutes(); err != nil {
		return err
	}
	return c.readNeighs()
}

// applyNeigh folds one neighbour message into the state; only IPv4 and IPv6
// entries of managed interfaces are kept.
func (c *Cache) applyNeigh(typ uint16, n *netlink.Neigh) {
	if n.Family != netlink.FAMILY_V4 && n.Family != netlink.FAMILY_V6 || n.Flags&netlink.NTF_PROXY != 0 {
		return
	}
	if !c.st.links[n.LinkIndex].managed {
		return
	}
	addr, ok := addrFromIP(n.IP)
	if !ok {
		return
	}
	k := neighKey{addr: addr, ifindex: int32(n.LinkIndex)}
	if typ == unix.RTM_DELNEIGH {
		delete(c.st.neighs, k)
		return
	}
	info := neighInfo{state: n.State, hasMAC: len(n.HardwareAddr) == 6}
	copy(info.mac[:], n.HardwareAddr)
	c.st.neighs[k] = info
}

func (c *Cache) publish() {
	c.gen++
	c.snap.Store(compile(&c.st, c.gen))
}

// maxBatch bounds how many queued events one publish absorbs, so a storm
// of events still publishes now and then.
const maxBatch = 4096

// batch collects what a run of events asks the updater to do.
type batch struct {
	routes, links, lost bool
}

func (c *Cache) onRoute(b *batch, u netlink.RouteUpdate, ok bool) {
	b.lost = b.lost || !ok
	b.routes = b.routes || ok && u.Table == unix.RT_TABLE_MAIN
}

func (c *Cache) onLink(b *batch, ok bool) {
	b.lost = b.lost || !ok
	b.links = b.links || ok
}

func (c *Cache) onNeigh(b *batch, u netlink.NeighUpdate, ok bool) {
	b.lost = b.lost || !ok
	if ok {
		c.applyNeigh(u.Type, &u.Neigh)
	}
}

// update follows the subscriptions until Close. Route and link events
// trigger a fresh read of the (few) routes and links; neighbour events,
// which are many, are applied one by one. Queued events are absorbed before
// one snapshot is published for all of them.
func (c *Cache) update(sub *subscription) {
	defer c.wg.Done()
	var resync <-chan time.Time
	if c.opts.ResyncInterval > 0 {
		t := time.NewTicker(c.opts.ResyncInterval)
		defer t.Stop()
		resync = t.C
	}
	defer func() {
		if sub != nil {
			sub.close()
		}
	}()
	for {
		var b batch
		select {
		case <-c.stop:
			return
		case <-resync:
			b.links = true
		case u, ok := <-sub.routes:
			c.onRoute(&b, u, ok)
		case _, ok := <-sub.links:
			c.onLink(&b, ok)
		case u, ok := <-sub.neighs:
			c.onNeigh(&b, u, ok)
		}
	drain:
		for i := 0; i < maxBatch && !b.lost; i++ {
			select {
			case u, ok := <-sub.routes:
				c.onRoute(&b, u, ok)
			case _, ok := <-sub.links:
				c.onLink(&b, ok)
			case u, ok := <-sub.neighs:
				c.onNeigh(&b, u, ok)
			default:
				break drain
			}
		}
		var err error
		switch {
		case b.lost:
			sub.close()
			if sub = c.resubscribeAndRead(); sub == nil {
				return
			}
		case b.links:
			// A link change can change which neighbours are kept.
			err = c.readAll()
		case b.routes:
			err = c.readRoutes()
		}
		if err != nil {
			c.logErr(err)
		}
		c.publish()
	}
}

// resubscribeAndRead subscribes again, with backoff, and reads everything;
// nil means the Cache was closed meanwhile.
func (c *Cache) resubscribeAndRead() *subscription {
	c.resubscribes.Add(1)
	backoff := 10 * time.Millisecond
	for {
		sub, err := c.subscribe()
		if err == nil {
			if err = c.readAll(); err == nil {
				return sub
			}
			sub.close()
		}
		c.logErr(err)
		select {
		case <-c.stop:
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}
