// Command xdproxy is the node agent. It only parses flags and the config
// file; control/agent wires the parts together. `xdproxy admin` talks to
// a running agent over its admin socket, and `xdproxy cleanup` removes
// what an agent keeps across restarts.
package main
