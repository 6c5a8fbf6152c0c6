// Package service holds the service table that workers consult for every
// new flow: an immutable snapshot compiled from a Model, looked up with an
// open-addressing hash on pointer-free keys, plus backend selection
// (random, round robin, Maglev) and ClientIP session affinity.
//
// A Table is never modified after Compile returns it. Any number of workers
// may read one while the control plane compiles the next; publishing a new
// table is one atomic pointer store (see Current). Workers load the pointer
// once per batch and must not keep it across batches.
package service
