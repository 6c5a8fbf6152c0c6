// Package config reads xdproxy's configuration file and returns it as a
// typed, validated Config.
//
// The file is versioned like kube-proxy's KubeProxyConfiguration: it starts
// with
//
//	apiVersion: xdproxy.io/v1alpha1
//	kind: XDProxyConfiguration
//
// and the rest of it is decoded into that version's on-disk types (strings,
// and pointers where leaving a field out differs from writing zero). Parse
// then turns them into a Config: prefixes are netip.Prefix, port ranges
// conntrack.PortRange, modes the xdp, afxdp and service enums, durations
// time.Duration, and every default is applied, once, here. Callers read
// Config's fields and never parse a string of the file again.
//
// Validation happens once, at load time, against the host the file is for
// (Host: which CPUs exist and which the process may use), and reports every
// problem at once, each under the path of its field
// ("interfaces[0].cpus[1]: CPU 7 does not exist (this machine has CPUs
// 0-1)"), so a bad file is fixed from the message alone. Unknown fields are
// errors too: a misspelt key would otherwise be silently ignored.
//
// A new file version gets its own on-disk types and a conversion into the
// same Config; Config itself is not a file format and may change freely.
package config
