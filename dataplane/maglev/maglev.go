package maglev

import (
	"errors"
	"fmt"
	"math/bits"

	"github.com/cespare/xxhash/v2"
)

// DefaultSize is the default number of slots, a prime. The paper asks for
// a size well above 100 times the number of backends to keep every
// backend's share within about 1% of the ideal; 16381 serves up to ~160
// backends that well and larger sets a little less evenly.
const DefaultSize = 16381

// MaxSize bounds the table size (64 Mi slots, 256 MiB) so that a typo
// cannot ask for an absurd allocation.
const MaxSize = 1 << 26

// MaxBackends bounds the backends of one table; slots store uint32 indexes
// and a table must have more slots than backends.
const MaxBackends = 1 << 24

// Seeds of the two hashes that give a backend its permutation. Changing
// them reshuffles every table, so they are fixed.
const (
	offsetSeed = 0x6d61676c65763031 // "maglev01"
	skipSeed   = 0x6d61676c65763032 // "maglev02"
)

// Errors returned by New; test with errors.Is.
var (
	ErrSizeNotPrime    = errors.New("maglev: table size must be a prime no larger than MaxSize")
	ErrNoBackends      = errors.New("maglev: no backends with a positive weight")
	ErrTooManyBackends = errors.New("maglev: more backends than the table has slots")
	ErrWeights         = errors.New("maglev: weights must be empty or one per backend")
)

// Options tunes New. The zero value gives DefaultSize and equal weights.
type Options struct {
	// Size is the number of slots; it must be a prime larger than the
	// number of backends. 0 means DefaultSize.
	Size uint64
	// Weights, when set, holds one weight per backend: a backend gets a
	// share of the slots proportional to its weight. A zero weight
	// removes the backend from the table (it keeps its index).
	Weights []uint32
}

// Table maps a flow hash to a backend index.
type Table struct {
	size    uint64
	entries []uint32
}

// New builds the table for the backends with the given names. Backend i
// of the result is names[i]. Names should be distinct; two backends with
// the same name share one permutation and split its slots.
func New(names [][]byte, opts Options) (*Table, error) {
	size := opts.Size
	if size == 0 {
		size = DefaultSize
	}
	if size > MaxSize || !IsPrime(size) {
		return nil, fmt.Errorf("%w: %d", ErrSizeNotPrime, size)
	}
	n := len(names)
	if opts.Weights != nil && len(opts.Weights) != n {
		return nil, fmt.Errorf("%w: %d weights for %d backends", ErrWeights, len(opts.Weights), n)
	}
	if n > MaxBackends || uint64(n) >= size {
		return nil, fmt.Errorf("%w: %d backends, %d slots", ErrTooManyBackends, n, size)
	}
	var maxWeight uint32
	for i := 0; i < n; i++ {
		w := uint32(1)
		if opts.Weights != nil {
			w = opts.Weights[i]
		}
		maxWeight = max(maxWeight, w)
	}
	if maxWeight == 0 {
		return nil, ErrNoBackends
	}

	// pos[i] is backend i's current place in its permutation
	// (offset + j*skip) mod size, advanced by adding skip.
	pos := make([]uint64, n)
	skip := make([]uint64, n)
	var d xxhash.Digest
	for i, name := range names {
		pos[i] = seeded(&d, offsetSeed, name) % size
		skip[i] = seeded(&d, skipSeed, name)%(size-1) + 1
	}

	const free = ^uint32(0)
	entries := make([]uint32, size)
	for i := range entries {
		entries[i] = free
	}
	// Weighted turns: each pass credits every backend its weight, and a
	// backend claims one slot per maxWeight of credit it holds. With equal
	// weights every backend claims exactly one slot per pass, which is the
	// paper's algorithm.
	var credit []uint64
	if opts.Weights != nil {
		credit = make([]uint64, n)
	}
	filled := uint64(0)
	for filled < size {
		for i := 0; i < n && filled < size; i++ {
			turns := uint64(1)
			if credit != nil {
				credit[i] += uint64(opts.Weights[i])
				turns = credit[i] / uint64(maxWeight)
				credit[i] -= turns * uint64(maxWeight)
			}
			for ; turns > 0 && filled < size; turns-- {
				c := pos[i]
				for entries[c] != free {
					c += skip[i]
					if c >= size {
						c -= size
					}
				}
				entries[c] = uint32(i)
				filled++
				c += skip[i]
				if c >= size {
					c -= size
				}
				pos[i] = c
			}
		}
	}
	return &Table{size: size, entries: entries}, nil
}

func seeded(d *xxhash.Digest, seed uint64, b []byte) uint64 {
	d.ResetWithSeed(seed)
	d.Write(b)
	return d.Sum64()
}

// Lookup returns the index of the backend that owns hash. The hash should
// be uniform over all 64 bits (xxhash of the flow tuple is); the slot is
// chosen by multiplying rather than dividing, which uses its high bits.
func (t *Table) Lookup(hash uint64) int {
	hi, _ := bits.Mul64(hash, t.size)
	return int(t.entries[hi])
}

// Size returns the number of slots.
func (t *Table) Size() int { return int(t.size) }

// Slot returns the backend index stored in slot i, for tests and
// diagnostics.
func (t *Table) Slot(i int) int { return int(t.entries[i]) }

// IsPrime reports whether n is prime, by trial division; table sizes are
// small enough for that to be instant.
func IsPrime(n uint64) bool {
	if n < 2 {
		return false
	}
	if n%2 == 0 {
		return n == 2
	}
	for d := uint64(3); d*d <= n; d += 2 {
		if n%d == 0 {
			return false
		}
	}
	return true
}
