// Package maglev builds Maglev consistent-hashing lookup tables
// (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
// Balancer", NSDI 2016).
//
// A table has a prime number of slots (DefaultSize, 16381, unless told
// otherwise); each slot names one backend. Every backend walks its own
// permutation of the slots, derived from two seeded xxhash values of its
// name, and the backends take turns claiming the next free slot of their
// permutation until all slots are taken. Because a backend's permutation
// depends only on its name and the table size, rebuilding the table after
// one of N backends leaves or joins moves only about 1/N of the slots, so
// most flows keep their backend without any per-flow state.
//
// Names must therefore be stable identities (xdproxy uses the backend's
// address and port bytes), not positions in a list. A Table is immutable
// after New returns it and safe for any number of concurrent readers;
// Lookup does not allocate.
package maglev
