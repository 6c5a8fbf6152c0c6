// Package config reads and validates xdproxy's YAML configuration file.
//
// Validation happens once, at load time, and every error names the field
// it is about (for example "interfaces[0].cpus: 1 CPU for 2 queues"), so a
// bad file is fixed from the message alone. Unknown fields are errors too:
// a misspelt key would otherwise be silently ignored.
package config
