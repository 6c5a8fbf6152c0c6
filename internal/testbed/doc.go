// Package testbed builds throw-away network-namespace topologies for
// privileged tests, benchmarks and demos of xdproxy. There are two shapes.
//
// # New: client, node, backends
//
//	client ns            node ns (xdproxy runs here)         lan ns             backend ns (xN)
//	c0 198.18.0.2/24 --- n0 198.18.0.1/24
//	                     n1 198.18.1.1/24 ------------------ ln ] br0 [ lbI --- b0 198.18.1.(11+I)/24
//
// The node forwards between n0 and n1 with the kernel (ip_forward=1,
// rp_filter off), so plain routing works before xdproxy attaches. The
// client's default route points at the node and so covers the ClusterIP
// range ClusterIPRange (198.19.0.0/16) used by tests. With Options.IPv6 the
// same shape is repeated in 2001:db8:18::/48.
//
// # NewNode: a node as the product will meet it
//
//	lan ns:  bridge br0, the LAN 198.18.0.0/24
//	         |                             |                            |
//	         port "node"                   port "node2"                 port "client"
//	         (Queues tx queues)            |                            |
//	         |                             |                            |
//	node ns: eth0 198.18.0.10    node2 ns: eth0 198.18.0.20  client ns: eth0 198.18.0.100
//	         (Queues rx+tx queues)
//	 routes: 10.244.2.0/24 via .20         10.244.1.0/24 via .10        198.19.0.0/16 via .10
//	         default via .100              default via .100             10.244.0.0/16 via .10
//	         |                             |
//	         +- cali-a -- pod-a            +- cali-a -- n2-pod-a
//	         |            10.244.1.10/32   |            10.244.2.10/32
//	         +- cali-b -- pod-b            +- cali-b -- n2-pod-b
//	         |            10.244.1.11/32                10.244.2.11/32
//	         +- cni0 10.244.1.129/25 (bridge)
//	              +- veth-c -- pod-c
//	                           10.244.1.130/25
//
// Every pod's interface is eth0; a routed pod's default route is via
// 169.254.1.1, pod-c's via 10.244.1.129.
//
// The node is where xdproxy runs: its NIC eth0 has NodeOptions.Queues rx and
// tx queues (4 by default), and so has its peer on the LAN, so flows from
// different senders spread over the node's rx queues (a veth receives on
// the queue its peer sent on, chosen by the flow's hash). Both nodes
// forward (ip_forward=1) without ICMP redirects, with rp_filter as
// NodeOptions.RPFilter says. Pods pod-a, pod-b, n2-pod-a and n2-pod-b are
// routed the Calico/Cilium way: a /32 route to a host-side veth that has no
// address, and in the pod a default route via 169.254.1.1, a permanent
// neighbour with that veth's MAC. Pod pod-c sits on the bridge cni0, as
// with flannel. The client is off the cluster; it routes the service range
// (ServiceCIDR, 198.19.0.0/16) and the pod range via the node, as with
// externalIPs or load-balancer IPs announced by BGP, and it is the nodes'
// default gateway (it does not forward).
//
// Every NodeBed has a cgroup v2 directory of its own (Cgroup), under the
// cgroup2 mount found in /proc/self/mountinfo; it stands in for the node's
// root cgroup. StartInCgroup starts a process in a namespace and in it.
// NodeBed.StartServers starts the test server in every pod and in the
// client; those of the node's pods run in the cgroup.
//
// # Servers
//
// The servers (package testserver) are the running program started again:
// StartServers runs /proc/self/exe inside each namespace with the
// environment variable XDPROXY_TESTBED_SERVER=1, and ServeIfRequested,
// called first in main or TestMain, turns that process into the server.
// No Go toolchain is needed at run time. A program that does not call it is
// caught: StartServers fails with ErrNoServeHook.
//
// # Names and cleanup
//
// Namespaces are named "xdpt-<pid>-<random>-<role>", and a NodeBed's cgroup
// "xdpt-<pid>-<random>", so parallel runs do not collide and CleanupStale
// can delete what a killed run left behind.
//
// Rules for callers:
//   - Close deletes every namespace (and the cgroup, after killing what runs
//     in it); call it (or use NewForTest, NewNodeForTest) even when a test
//     fails. It is idempotent.
//   - Do runs its function on one OS thread inside the namespace. Goroutines
//     the function starts do not inherit the namespace, but sockets it opens
//     stay in it after Do returns.
//   - Command and Exec use "ip netns exec", which mounts the namespace's own
//     sysfs over /sys: /sys/class/net shows the namespace's interfaces, but
//     /sys/fs/bpf and the cgroup tree are hidden. The tuning helpers
//     (SetRPS, SetThreadedNAPI) rely on that. A process that needs bpffs or
//     cgroups (xdproxy does) must be started with StartIn or
//     NodeBed.Start / StartInCgroup, which change only the network
//     namespace.
package testbed
