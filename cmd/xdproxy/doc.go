// Command xdproxy is the node agent. It only parses flags and the config
// file and wires the parts together: the dataplane engine (XDP programs,
// AF_XDP sockets, pinned workers), the configured service source (a static
// file or the Kubernetes API), the metrics and health endpoints and the
// admin socket that `xdproxy admin` queries.
package main
