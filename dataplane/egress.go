package dataplane

import "net"

// egress is every port the workers may transmit into. The engine builds a
// new one whenever an interface comes, goes or changes its queues and
// publishes it with one atomic store; a worker loads it once per batch and
// works out its own routing from it only when it changed.
type egress struct {
	ifaces []egressIface
	// kernel is the socket on xdproxy's end of the exception link, nil
	// when there is none; kernelMAC the MAC of its kernel end, the
	// destination of every frame handed to the kernel's stack.
	kernel    *Port
	kernelMAC net.HardwareAddr
}

// egressIface is one served interface and its ports in queue order.
type egressIface struct {
	ifindex int
	ports   []*Port
}
