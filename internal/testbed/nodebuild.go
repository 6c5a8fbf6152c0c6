package testbed

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

func (nb *NodeBed) build() error {
	cg, err := newCgroup(nb.id)
	if err != nil {
		return err
	}
	nb.cgroup = cg

	handles := map[string]*nsHandles{}
	defer func() {
		for _, h := range handles {
			h.close()
		}
	}()
	for _, ns := range nb.Namespaces() {
		h, err := newNamespace(ns)
		if err != nil {
			return err
		}
		handles[ns] = h
		if err := linkUp(h, "lo"); err != nil {
			return err
		}
		// Link-local IPv6 addresses usable at once (see noDAD).
		if err := noDAD(h); err != nil {
			return err
		}
	}
	lan, node, node2, client := handles[nb.lan], handles[nb.node.NS], handles[nb.node2.NS], handles[nb.client.NS]

	// Sysctls first: "default" is what the interfaces made below start with.
	rp := strconv.Itoa(nb.opts.RPFilter)
	for _, h := range []*nsHandles{node, node2} {
		err := writeSysctls(h, [][2]string{
			{"net/ipv4/ip_forward", "1"},
			{"net/ipv4/conf/all/rp_filter", rp},
			{"net/ipv4/conf/default/rp_filter", rp},
			// The client routes node2's pods via the node, which forwards
			// them back out of eth0; a redirect would teach the client a
			// shortcut and change the path under a test.
			{"net/ipv4/conf/all/send_redirects", "0"},
			{"net/ipv4/conf/default/send_redirects", "0"},
		})
		if err != nil {
			return err
		}
	}
	err = writeSysctls(client, [][2]string{
		{"net/ipv4/conf/all/accept_redirects", "0"},
		{"net/ipv4/conf/default/accept_redirects", "0"},
	})
	if err != nil {
		return err
	}

	// The LAN: a bridge with one port per host. Ports join the bridge
	// before anything is addressed, so the first ARP already crosses it.
	mtu := nb.opts.MTU
	if err := addBridge(lan, LANBridge, mtu); err != nil {
		return err
	}
	uplinks := []struct {
		h     *nsHandles
		role  string
		queue int
	}{{node, RoleNode, nb.opts.Queues}, {node2, RoleNode2, 1}, {client, RoleClient, 1}}
	for _, u := range uplinks {
		if err := addVeth(u.h, NICName, lan, u.role, u.queue, mtu); err != nil {
			return err
		}
		if err := enslave(lan, u.role, LANBridge); err != nil {
			return err
		}
	}
	l, err := lan.nl.LinkByName(RoleNode)
	if err != nil {
		return fmt.Errorf("testbed: lan %s: %w", RoleNode, err)
	}
	nb.port.IfIndex, nb.port.MAC = l.Attrs().Index, l.Attrs().HardwareAddr

	// flannel's shape on the node: a bridge with the gateway address.
	if err := addBridge(node, CNIBridge, mtu); err != nil {
		return err
	}
	if err := addAddr(node, CNIBridge, cniGateway); err != nil {
		return err
	}

	for i := range nb.pods {
		if err := nb.plugPod(&nb.pods[i], handles, mtu); err != nil {
			return err
		}
	}

	for _, host := range []*Host{&nb.node, &nb.node2, &nb.client} {
		if err := address(handles[host.NS], host, nodeLAN.Bits(), 0); err != nil {
			return err
		}
	}
	routes := []struct {
		h   *nsHandles
		dst netip.Prefix // invalid: the default route
		via netip.Addr
	}{
		{node, node2PodCIDR, node2Addr},
		{node, netip.Prefix{}, lanClientAddr},
		{node2, nodePodCIDR, nodeAddr},
		{node2, netip.Prefix{}, lanClientAddr},
		{client, ClusterIPRange, nodeAddr},
		{client, podCIDR, nodeAddr},
	}
	for _, r := range routes {
		route := &netlink.Route{Gw: r.via.AsSlice()}
		if r.dst.IsValid() {
			route.Dst = prefixNet(r.dst)
		}
		if err := r.h.nl.RouteAdd(route); err != nil {
			return fmt.Errorf("testbed: %s: route %v via %s: %w", r.h.name, r.dst, r.via, err)
		}
	}

	// Everything has carrier before anyone sends.
	ready := map[*nsHandles][]string{
		lan:    {LANBridge, RoleNode, RoleNode2, RoleClient},
		node:   {NICName, CNIBridge},
		node2:  {NICName},
		client: {NICName},
	}
	for _, p := range nb.pods {
		ready[handles[p.NS]] = append(ready[handles[p.NS]], NICName)
		ready[handles[p.NodeNS]] = append(ready[handles[p.NodeNS]], p.HostIface)
	}
	for h, ifaces := range ready {
		for _, iface := range ifaces {
			if err := waitReady(h, iface, false); err != nil {
				return err
			}
		}
	}
	return nil
}

// plugPod connects a pod to its node, the Calico/Cilium way (a /32 route
// to a veth without an address; the pod's gateway 169.254.1.1 is a static
// neighbour with that veth's MAC) or flannel's (a port of cni0).
func (nb *NodeBed) plugPod(p *Pod, handles map[string]*nsHandles, mtu int) error {
	pod, node := handles[p.NS], handles[p.NodeNS]
	if err := addVeth(pod, NICName, node, p.HostIface, 1, mtu); err != nil {
		return err
	}
	hl, err := node.nl.LinkByName(p.HostIface)
	if err != nil {
		return fmt.Errorf("testbed: %s: %s: %w", node.name, p.HostIface, err)
	}
	p.HostIfIndex, p.HostMAC = hl.Attrs().Index, hl.Attrs().HardwareAddr
	if p.Bridged {
		if err := enslave(node, p.HostIface, CNIBridge); err != nil {
			return err
		}
		if err := address(pod, &p.Host, cniGateway.Bits(), 0); err != nil {
			return err
		}
		if err := pod.nl.RouteAdd(&netlink.Route{LinkIndex: p.IfIndex, Gw: p.Gateway.AsSlice()}); err != nil {
			return fmt.Errorf("testbed: %s: default route: %w", pod.name, err)
		}
		return nil
	}

	if err := linkUp(node, p.HostIface); err != nil {
		return err
	}
	hostRoute := &netlink.Route{LinkIndex: p.HostIfIndex, Dst: prefixNet(netip.PrefixFrom(p.Addr, 32)), Scope: netlink.SCOPE_LINK}
	if err := node.nl.RouteAdd(hostRoute); err != nil {
		return fmt.Errorf("testbed: %s: route to %s: %w", node.name, p.Name, err)
	}
	if err := address(pod, &p.Host, 32, 0); err != nil {
		return err
	}
	gw := prefixNet(netip.PrefixFrom(p.Gateway, 32))
	err = pod.nl.NeighAdd(&netlink.Neigh{
		LinkIndex:    p.IfIndex,
		Family:       unix.AF_INET,
		State:        netlink.NUD_PERMANENT,
		IP:           gw.IP,
		HardwareAddr: p.HostMAC,
	})
	if err != nil {
		return fmt.Errorf("testbed: %s: neighbour %s: %w", pod.name, p.Gateway, err)
	}
	if err := pod.nl.RouteAdd(&netlink.Route{LinkIndex: p.IfIndex, Dst: gw, Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("testbed: %s: route to %s: %w", pod.name, p.Gateway, err)
	}
	if err := pod.nl.RouteAdd(&netlink.Route{LinkIndex: p.IfIndex, Gw: gw.IP}); err != nil {
		return fmt.Errorf("testbed: %s: default route: %w", pod.name, err)
	}
	return nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// addBridge creates the bridge name in h and brings it up.
func addBridge(h *nsHandles, name string, mtu int) error {
	if err := h.nl.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, MTU: mtu}}); err != nil {
		return fmt.Errorf("testbed: %s: bridge %s: %w", h.name, name, err)
	}
	return linkUp(h, name)
}

// enslave makes port a port of bridge in h and brings it up.
func enslave(h *nsHandles, port, bridge string) error {
	p, err := h.nl.LinkByName(port)
	if err != nil {
		return fmt.Errorf("testbed: %s: %s: %w", h.name, port, err)
	}
	b, err := h.nl.LinkByName(bridge)
	if err != nil {
		return fmt.Errorf("testbed: %s: %s: %w", h.name, bridge, err)
	}
	if err := h.nl.LinkSetMasterByIndex(p, b.Attrs().Index); err != nil {
		return fmt.Errorf("testbed: %s: enslave %s to %s: %w", h.name, port, bridge, err)
	}
	return linkUp(h, port)
}

// addAddr puts the address p on iface in h.
func addAddr(h *nsHandles, iface string, p netip.Prefix) error {
	l, err := h.nl.LinkByName(iface)
	if err == nil {
		err = h.nl.AddrAdd(l, &netlink.Addr{IPNet: prefixNet(p)})
	}
	if err != nil {
		return fmt.Errorf("testbed: %s: address %s on %s: %w", h.name, p, iface, err)
	}
	return nil
}
