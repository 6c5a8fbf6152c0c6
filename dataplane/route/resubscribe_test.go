package route

import (
	"context"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/xdproxy/xdproxy/internal/testbed"
	"github.com/xdproxy/xdproxy/nat/packet"
	"k8s.io/apimachinery/pkg/util/wait"
)

// TestLostSubscriptionRecovers hands the Cache a subscription whose route
// channel then closes, as the netlink library does when its socket fails
// (an ENOBUFS overrun, for instance). The Cache must subscribe again, read
// everything again, and keep following changes.
func TestLostSubscriptionRecovers(t *testing.T) {
	tb := testbed.NewForTest(t, testbed.Options{Backends: 1})
	var fake *subscription
	var c *Cache
	err := tb.Do(tb.NodeNS(), func() error {
		var err error
		c, err = newCache(Options{Interfaces: []string{testbed.NodeLANIface}}, func(*Cache) (*subscription, error) {
			fake = &subscription{
				routes: make(chan netlink.RouteUpdate),
				neighs: make(chan netlink.NeighUpdate),
				links:  make(chan netlink.LinkUpdate),
				done:   make(chan struct{}),
			}
			return fake, nil
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// A change made while nothing listens...
	if _, err := tb.Exec(tb.NodeNS(), "ip", "route", "add", "198.19.0.0/16", "via", tb.Backend(0).Addr.String()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	svc := packet.MustParseAddr("198.19.1.1")
	if _, s := c.Lookup(svc); s != NoRoute {
		t.Fatalf("route seen without a subscription: %v", s)
	}
	// ...is found by the full read after the loss...
	close(fake.routes)
	close(fake.neighs)
	close(fake.links)
	if err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		_, s := c.Lookup(svc)
		return s != NoRoute, nil
	}); err != nil {
		t.Fatalf("route not seen after the subscription was lost and remade")
	}
	if st := c.Stats(); st.Resubscribes != 1 || st.Resyncs < 2 {
		t.Errorf("stats %+v, want 1 resubscribe and a second full read", st)
	}
	// ...and the new subscription follows later changes.
	if _, err := tb.Exec(tb.NodeNS(), "ip", "route", "del", "198.19.0.0/16"); err != nil {
		t.Fatal(err)
	}
	var s Status
	if err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		_, s = c.Lookup(svc)
		return s == NoRoute, nil
	}); err != nil {
		t.Errorf("route deletion after resubscribing not seen: %v", s)
	}
}
