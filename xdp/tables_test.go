package xdp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func TestPortIsStoredInNetworkOrder(t *testing.T) {
	k := Key{Port: 8080}.svcKey()
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], k.Port)
	if b != [2]byte{0x1f, 0x90} {
		t.Errorf("port 8080 stored as % x, want 1f 90", b)
	}
}

// dump lists a map's keys, readable and sorted.
func dump(t *testing.T, m *ebpf.Map) []string {
	t.Helper()
	var out []string
	it := m.Iterate()
	switch m.KeySize() {
	case 20:
		var k bpfSvcKey
		var v uint8
		for it.Next(&k, &v) {
			out = append(out, Key{Addr: k.Addr, Port: networkOrder16(k.Port), Proto: packet.Proto(k.Proto)}.String())
		}
	case 16:
		var k bpfAddrKey
		var v uint32
		for it.Next(&k, &v) {
			out = append(out, fmt.Sprintf("%v=%d", packet.Addr(k.Addr), v))
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

func keys(n, from int) []Key {
	var ks []Key
	for i := range n {
		ks = append(ks, Key{packet.AddrFrom4([4]byte{198, 18, 1, byte(from + i)}), 80, packet.ProtoTCP})
	}
	return ks
}

func strs(ks []Key) []string {
	var out []string
	for _, k := range ks {
		out = append(out, k.String())
	}
	sort.Strings(out)
	return out
}

func equal(a, b []string) bool { return fmt.Sprint(a) == fmt.Sprint(b) }

func TestSetTables(t *testing.T) {
	requireRoot(t)
	o, err := Load(Options{MaxFrontends: 4, MaxAddrs: 2, MaxFlows: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	vip := packet.MustParseAddr(vip4)
	vip2 := packet.MustParseAddr(vip6)

	steps := []struct {
		name      string
		frontends []Key
		vips      []packet.Addr
		wantAddrs []string
	}{
		{"first", keys(3, 1), []packet.Addr{vip}, []string{"198.18.1.10=2"}},
		{"grow and move", keys(3, 2), []packet.Addr{vip, vip2}, []string{"198.18.1.10=2", "2001:2::10=2"}},
		// Replacing all four entries of a full table does not fit
		// add-first: stale ones go first.
		{"replace a full table", keys(4, 10), []packet.Addr{vip2}, []string{"2001:2::10=2"}},
		{"duplicates", append(keys(2, 20), keys(2, 20)...), []packet.Addr{vip, vip}, []string{"198.18.1.10=2"}},
		{"empty", nil, nil, nil},
	}
	for _, s := range steps {
		if err := o.SetTables(s.frontends, s.vips); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		want := strs(s.frontends)
		if s.name == "duplicates" {
			want = strs(keys(2, 20))
		}
		if got := dump(t, o.frontends); !equal(got, want) {
			t.Errorf("%s: frontends %v, want %v", s.name, got, want)
		}
		if got := dump(t, o.addrs); !equal(got, s.wantAddrs) {
			t.Errorf("%s: addrs %v, want %v", s.name, got, s.wantAddrs)
		}
	}

	if err := o.SetTables(keys(5, 1), nil); !errors.Is(err, ErrTableFull) {
		t.Errorf("5 frontends in a table of 4: %v, want ErrTableFull", err)
	}
}

// TestSetTablesReadsBack checks the path after a failed sync: the maps are
// read back from the kernel instead of trusting the last state.
func TestSetTablesReadsBack(t *testing.T) {
	requireRoot(t)
	o, err := Load(Options{MaxFrontends: 8, MaxAddrs: 8, MaxFlows: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := o.SetTables(keys(3, 1), nil); err != nil {
		t.Fatal(err)
	}
	// Something wrote behind our back, and the state is forgotten as it
	// is after an error.
	stray := Key{packet.MustParseAddr(remote4), 1, packet.ProtoUDP}.svcKey()
	if err := o.frontends.Put(&stray, present); err != nil {
		t.Fatal(err)
	}
	o.state = nil
	if err := o.SetTables(keys(2, 2), nil); err != nil {
		t.Fatal(err)
	}
	if got := dump(t, o.frontends); !equal(got, strs(keys(2, 2))) {
		t.Errorf("frontends %v, want %v", got, strs(keys(2, 2)))
	}
}

// TestSetTablesKeepsLiveServices runs a frame of a service that every
// table version has while SetTables churns the others: the program must
// claim it every single time.
func TestSetTablesKeepsLiveServices(t *testing.T) {
	o, a := newTestInstance(t)
	live := Key{packet.MustParseAddr(vip4), 80, packet.ProtoTCP}
	frame := tcp4(t, client4, 12345, vip4, 80)

	var stop atomic.Bool
	var wg sync.WaitGroup
	var syncErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stop.Store(true)
		for i := range 300 {
			fe := append(keys(20, 1+i%2*30), live)
			if err := o.SetTables(fe, nil); err != nil {
				syncErr = err
				return
			}
		}
	}()
	runs := 0
	for !stop.Load() {
		// Without a socket a claimed frame is passed too; the counters
		// tell claimed from not.
		if _, err := a.inst.prog.Run(&ebpf.RunOptions{Data: frame, Repeat: 50}); err != nil {
			t.Fatal(err)
		}
		runs++
	}
	wg.Wait()
	if syncErr != nil {
		t.Fatal(syncErr)
	}
	c, err := o.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Passed != 0 || c.MatchFrontend == 0 {
		t.Errorf("%d runs of 50: counters %+v; want every frame matched", runs, c)
	}
}
