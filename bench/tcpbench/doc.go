// Package tcpbench measures TCP connection rate and request latency
// through a service VIP with real sockets: each client connection
// connects, sends a small request, reads the server's small response to
// the end and closes; the server answers and closes first, so TIME_WAIT
// stays on the server and the client's ports recycle.
//
// Serve and Run use the calling process's network namespace (run them
// under "ip netns exec").
package tcpbench
