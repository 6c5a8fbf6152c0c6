package changes

import (
	"sync"
	"time"
)

// Change is what happened to one object since the last Checkout.
type Change[V any] struct {
	// Previous is the value at the last Checkout (zero: absent then).
	Previous V
	// Current is the value now (zero: absent now, the object was deleted).
	Current V
}

// Tracker accumulates changes keyed by object.
type Tracker[K comparable, V any] struct {
	equal func(a, b V) bool

	mu       sync.Mutex
	items    map[K]*Change[V]
	triggers map[K][]time.Time
}

// New returns a Tracker that uses equal to decide whether a change ends
// where it began.
func New[K comparable, V any](equal func(a, b V) bool) *Tracker[K, V] {
	return &Tracker[K, V]{
		equal:    equal,
		items:    make(map[K]*Change[V]),
		triggers: make(map[K][]time.Time),
	}
}

// Update records that the object key went from previous to current
// (previous zero for an add, current zero for a delete). trigger, when not
// zero, is when the change was caused (an EndpointSlice's
// last-change-trigger-time); it is handed back by Checkout so the time to
// program the change can be measured.
//
// Update returns the number of objects with pending changes (kube-proxy's
// ServiceChangeTracker.Update answers that), and whether this update
// changed the object from the value last recorded for it, pending or, for
// the first update since Checkout, previous (kube-proxy's
// EndpointSliceUpdate answers that).
func (t *Tracker[K, V]) Update(key K, previous, current V, trigger time.Time) (pending int, changed bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := t.items[key]
	if !ok {
		c = &Change[V]{Previous: previous, Current: previous}
		t.items[key] = c
	}
	changed = !t.equal(c.Current, current)
	c.Current = current
	if t.equal(c.Previous, c.Current) {
		delete(t.items, key)
		delete(t.triggers, key)
	} else if !trigger.IsZero() {
		t.triggers[key] = append(t.triggers[key], trigger)
	}
	return len(t.items), changed
}

// Pending returns the number of objects with pending changes.
func (t *Tracker[K, V]) Pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.items)
}

// Checkout returns the pending changes and the trigger times recorded for
// them, and starts afresh: the caller applies the changes and the next
// Update's previous is what the caller now has.
func (t *Tracker[K, V]) Checkout() (map[K]Change[V], []time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.items) == 0 {
		return nil, nil
	}
	out := make(map[K]Change[V], len(t.items))
	for k, c := range t.items {
		out[k] = *c
	}
	var triggers []time.Time
	for _, ts := range t.triggers {
		triggers = append(triggers, ts...)
	}
	clear(t.items)
	clear(t.triggers)
	return out, triggers
}
