// Package layout holds no code, only the test that keeps xdproxy's import
// rules (README.md, "Architecture"): packages form layers, and a package
// imports only its own layer and the layers below it:
//
//	nat/packet                                   packet types
//	nat, nat/conntrack                           rewrites, connection tracking
//	xdp, xdp/afxdp, xdp/socklb                   the kernel-facing layer
//	dataplane/service, dataplane/maglev,
//	dataplane/route                              tables the workers read
//	dataplane                                    processor, workers, engine
//	control/...                                  config, sources, health, agent
//	cmd/...                                      flags and wiring
//
// Inside control/ the order is changes, health, metrics and runner; then
// k8sconv; then kubesource and filesource; then config; then agent.
// bench/, deploy/ and internal/ stand at the side: they may import any
// layer, and no product package (any of the layers above) imports them or
// links the "testing" package. A command imports only control/agent and
// control/config from this module.
//
// The test reads the imports with `go list`, so it needs the go command;
// it looks at the packages' own files, not their tests.
package layout
