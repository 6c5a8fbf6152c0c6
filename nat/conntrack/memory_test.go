package conntrack

import (
	"runtime"
	"testing"
)

// TestMemoryPerEntry allocates a table for a million flows and reports what
// it costs per flow, index included. The budget is 200 bytes.
func TestMemoryPerEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 160 MiB")
	}
	const n = 1 << 20
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tb, err := New(Config{Capacity: n})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / float64(tb.Capacity())
	t.Logf("capacity %d, %d shards: heap %.1f MiB, %.1f bytes per entry (entry %d, index %d slots per shard)",
		tb.Capacity(), len(tb.shards), float64(after.HeapAlloc-before.HeapAlloc)/(1<<20), perEntry,
		entrySize, len(tb.shards[0].index.Load().slots))
	if perEntry > 200 {
		t.Errorf("%.1f bytes per entry, budget 200", perEntry)
	}
	runtime.KeepAlive(tb)
}
