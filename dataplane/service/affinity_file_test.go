package service

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestAffinityFileSurvivesReopen: what one generation remembered, the next
// finds; a file of another size starts empty and says why; a slot a
// crashed writer left odd is cleared.
func TestAffinityFileSurvivesReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "affinity.state")
	a, res, err := OpenAffinity(path, 1000)
	if err != nil || res.Adopted {
		t.Fatalf("first open: %+v, %v", res, err)
	}
	client, backend := packet.MustParseAddr("10.0.0.7"), packet.MustParseAddr("10.244.1.10")
	const now, timeout = 1000, 10800
	for i := range 200 {
		c := packet.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
		if !a.Remember(uint64(i+1), c, backend, 8080, now, timeout) {
			t.Fatal("Remember failed")
		}
	}
	a.Remember(7, client, backend, 8443, now, timeout)
	// A writer that died holding a slot.
	a.slots[3].seq.Add(1)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}

	b, res, err := OpenAffinity(path, 1000)
	if err != nil || !res.Adopted {
		t.Fatalf("reopen: %+v, %v", res, err)
	}
	defer b.Close()
	got, port, ok := b.Lookup(7, client, now+1)
	if !ok || got != backend || port != 8443 {
		t.Errorf("after reopen: %v:%d %v, want %v:8443", got, port, ok, backend)
	}
	if _, _, ok := b.Lookup(7, client, now+timeout+1); ok {
		t.Error("an expired entry came back")
	}
	for i := range b.slots {
		if b.slots[i].seq.Load()&1 != 0 {
			t.Fatalf("slot %d still held after reopen", i)
		}
	}
	if !b.Remember(9, client, backend, 1, now, timeout) {
		t.Error("cannot write after reopen")
	}

	c, res, err := OpenAffinity(path, 5000)
	if err != nil || res.Adopted || res.Reason == "" {
		t.Fatalf("reopen with another size: %+v, %v; want a fresh table and a reason", res, err)
	}
	if _, _, ok := c.Lookup(7, client, now+1); ok {
		t.Error("a fresh table remembers")
	}
	c.Close()
	if err := os.WriteFile(path, make([]byte, 64+8192*64), 0o600); err != nil {
		t.Fatal(err)
	}
	d, res, err := OpenAffinity(path, 5000)
	if err != nil || res.Adopted || res.Reason != "not an affinity state file" {
		t.Fatalf("garbage file: %+v, %v", res, err)
	}
	d.Close()
}
