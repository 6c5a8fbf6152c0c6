package conntrack

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sys/unix"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// clockAt returns a Config.Clock that reads *now.
func clockAt(now *int64) func() int64 { return func() int64 { return *now } }

// wantFlow is what a restored flow must look like.
type wantFlow struct {
	orig, tr packet.Tuple
	flags    Flags
	svc      uint32
	state    State
	assured  bool
	expired  bool // its deadline passed before the table was opened again
}

// fillForRestore inserts flows of every kind into tb at time base and
// returns what each must be after a restore at base+40s.
func fillForRestore(t *testing.T, tb *Table, base int64, ports PortRange) []wantFlow {
	t.Helper()
	var flows []wantFlow
	add := func(w wantFlow) { flows = append(flows, w) }
	v6c, v6f, v6b := packet.MustParseAddr("2001:db8::1"), packet.MustParseAddr("2001:db8::100"), packet.MustParseAddr("2001:db8:1::5")
	for i := range 3000 {
		cl := packet.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		switch i % 6 {
		case 0: // DNAT TCP, full handshake: assured, ESTABLISHED
			o, tr := tup(cl, 40000, frontend, 80, packet.ProtoTCP), tup(cl, 40000, backend, 8080, packet.ProtoTCP)
			h := mustInsert(t, tb, o, tr, DNAT, uint32(i), base)
			for _, s := range handshake {
				tb.UpdateTCP(h, s.dir, &s.TCPSegment, base)
			}
			add(wantFlow{o, tr, DNAT, uint32(i), TCPEstablished, true, false})
		case 1: // DNAT UDP, never answered: expired by base+30s
			o, tr := tup(cl, 5353, frontend, 53, packet.ProtoUDP), tup(cl, 5353, backend2, 53, packet.ProtoUDP)
			mustInsert(t, tb, o, tr, DNAT, uint32(i), base)
			add(wantFlow{o, tr, DNAT, uint32(i), UDPUnreplied, false, true})
		case 2: // SNAT TCP with a port from the range, SYN_SENT (120 s)
			o := tup(cl, 40001, frontend, 443, packet.ProtoTCP)
			h, tr, res := tb.InsertSNAT(o, tup(snatAddr, 0, backend, 8443, packet.ProtoTCP), DNAT, uint32(i), ports, base)
			if res != Inserted {
				t.Fatalf("snat %d: %v", i, res)
			}
			tb.Update(h, Original, syn, base)
			add(wantFlow{o, tr, DNAT | SNAT, uint32(i), TCPSynSent, false, false})
		case 3: // SNAT UDP stream: assured, 120 s from base+3s
			o := tup(cl, 6000, frontend, 53, packet.ProtoUDP)
			h, tr, res := tb.InsertSNAT(o, tup(snatAddr, 0, backend, 53, packet.ProtoUDP), DNAT, uint32(i), ports, base)
			if res != Inserted {
				t.Fatalf("snat %d: %v", i, res)
			}
			tb.Update(h, Reply, 0, base+sec)
			tb.Update(h, Original, 0, base+3*sec)
			add(wantFlow{o, tr, DNAT | SNAT, uint32(i), UDPReplied, true, false})
		case 4: // ICMP echo with SNAT: the id is the port; expired (30 s)
			o := tup(cl, uint16(i), frontend, uint16(i), packet.ProtoICMP)
			_, tr, res := tb.InsertSNAT(o, tup(snatAddr, 0, backend, 0, packet.ProtoICMP), DNAT, uint32(i), ports, base)
			if res != Inserted {
				t.Fatalf("icmp %d: %v", i, res)
			}
			add(wantFlow{o, tr, DNAT | SNAT, uint32(i), ICMPEcho, false, true})
		case 5: // IPv6 DNAT, FIN_WAIT after a handshake: assured
			c6 := v6c
			c6[15] = byte(i)
			c6[14] = byte(i >> 8)
			o, tr := tup(c6, 1234, v6f, 443, packet.ProtoTCP), tup(c6, 1234, v6b, 8443, packet.ProtoTCP)
			h := mustInsert(t, tb, o, tr, DNAT, uint32(i), base)
			for _, s := range append(handshake, pk(Original, finack, 1001, 6001, 502, 0)) {
				tb.UpdateTCP(h, s.dir, &s.TCPSegment, base)
			}
			add(wantFlow{o, tr, DNAT, uint32(i), TCPFinWait, true, false})
		}
	}
	return flows
}

func TestStateFileRestore(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "conntrack.state") // the directory is created
	now := int64(1000 * sec)
	ports := PortRange{First: 20000, Last: 29999}
	cfg := Config{Capacity: 8192, StatePath: path, Clock: clockAt(&now)}
	tb := newTable(t, cfg)
	if ri := tb.Restored(); ri.Restored || ri.Existed || ri.Path != path || ri.Reason == "" {
		t.Errorf("first open: %+v", ri)
	}
	flows := fillForRestore(t, tb, now, ports)
	before := tb.Stats()
	snatPorts := map[packet.Tuple]bool{} // restored reply tuples of SNAT flows
	for _, f := range flows {
		if f.flags&SNAT != 0 && !f.expired {
			snatPorts[f.tr.Reverse()] = true
		}
	}
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tb.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}

	now += 40 * sec
	var mu sync.Mutex
	removed := map[packet.Tuple]packet.Tuple{}
	cfg.OnRemove = func(o, r packet.Tuple) {
		mu.Lock()
		removed[o] = r
		mu.Unlock()
	}
	cfg.Seed = 7 // ignored: the file's seed is kept
	tb = newTable(t, cfg)
	defer tb.Close()
	ri := tb.Restored()
	live, expired, assured := 0, 0, 0
	for _, f := range flows {
		if f.expired {
			expired++
		} else {
			live++
			if f.assured {
				assured++
			}
		}
	}
	if !ri.Restored || !ri.Existed || ri.Reason != "" || ri.Flows != live || ri.Expired != expired || ri.Torn != 0 || ri.Invalid != 0 {
		t.Fatalf("restore: %+v (%s), want %d flows, %d expired", ri, ri, live, expired)
	}
	if tb.rawSeed == 7 {
		t.Error("the configured seed replaced the file's")
	}
	for _, f := range flows {
		if f.expired {
			if _, _, ok := tb.Lookup(f.orig, now); ok {
				t.Errorf("expired flow %v restored", f.orig)
			}
			if r, ok := removed[f.orig]; !ok || r != f.tr.Reverse() {
				t.Errorf("OnRemove for expired %v: %v %v", f.orig, r, ok)
			}
			continue
		}
		fl, d, ok := tb.Lookup(f.orig, now)
		if !ok || d != Original || fl.Rewrite != f.tr || fl.Flags != f.flags || fl.ServiceID != f.svc || fl.State != f.state {
			t.Fatalf("restored %v: %+v %v %v, want %+v", f.orig, fl, d, ok, f)
		}
		fr, d, ok := tb.Lookup(f.tr.Reverse(), now)
		if !ok || d != Reply || fr.Rewrite != f.orig.Reverse() || fr.Handle != fl.Handle {
			t.Fatalf("restored reply of %v: %+v %v %v", f.orig, fr, d, ok)
		}
		if fi := flowInfo(t, tb, f.orig); fi.Assured != f.assured {
			t.Fatalf("%v: assured %v, want %v", f.orig, fi.Assured, f.assured)
		}
	}
	if len(removed) != expired {
		t.Errorf("OnRemove called for %d flows, want %d", len(removed), expired)
	}
	st := tb.Stats()
	if st.Live != uint64(live) || st.Assured != uint64(assured) || st.ByState[TCPEstablished] != before.ByState[TCPEstablished] ||
		st.ByState[UDPUnreplied] != 0 || st.ByState[ICMPEcho] != 0 || st.Inserts != 0 {
		t.Errorf("stats after restore %+v\nbefore %+v", st, before)
	}

	// The restored flows go on: handles work, and the SNAT ports they hold
	// are not given out again.
	for _, f := range flows[:60] {
		if f.expired {
			continue
		}
		fl, d := mustLookup(t, tb, f.tr.Reverse(), now)
		if _, ok := tb.Update(fl.Handle, d, ack, now); !ok {
			t.Fatalf("update of restored %v failed", f.orig)
		}
		if f.flags&SNAT != 0 {
			if _, _, res := tb.InsertSNAT(f.orig, tup(snatAddr, 0, f.tr.Dst, f.tr.DstPort, f.orig.Proto), DNAT, f.svc, ports, now); res != OrigExists {
				t.Errorf("InsertSNAT of restored %v: %v", f.orig, res)
			}
		}
	}
	for i := range 2000 {
		o := tup(packet.AddrFrom4([4]byte{198, 51, byte(i >> 8), byte(i)}), 40001, frontend, 443, packet.ProtoTCP)
		_, tr, res := tb.InsertSNAT(o, tup(snatAddr, 0, backend, 8443, packet.ProtoTCP), DNAT, 1, ports, now)
		if res != Inserted {
			t.Fatalf("new SNAT flow %d: %v", i, res)
		}
		if snatPorts[tr.Reverse()] {
			t.Fatalf("new flow %v got the restored reply tuple %v", o, tr.Reverse())
		}
		snatPorts[tr.Reverse()] = true
	}
	// The expired flows' entries are free again: fill the table.
	n := 0
	for i := 0; tb.Stats().Live < uint64(tb.Capacity()) && i < 10000; i++ {
		o := tup(packet.AddrFrom4([4]byte{198, 52, byte(i >> 8), byte(i)}), 1, frontend, 80, packet.ProtoTCP)
		if _, res := tb.Insert(o, tup(o.Src, 1, backend, 80, packet.ProtoTCP), DNAT, 1, now); res == Inserted {
			n++
		}
	}
	if st := tb.Stats(); st.Live < uint64(tb.Capacity())*9/10 {
		t.Errorf("after restore the table fills to %d of %d", st.Live, tb.Capacity())
	}
}

func TestStateFileRestoreRules(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ct.state")
	now := int64(100 * sec)
	cfg := Config{Capacity: 64, StatePath: path, Clock: clockAt(&now)}
	tb := newTable(t, cfg)
	flow := func(i int) (packet.Tuple, packet.Tuple) {
		return tup(client, uint16(1000+i), frontend, 80, packet.ProtoTCP), tup(client, uint16(1000+i), backend, 80, packet.ProtoTCP)
	}
	var hs []Handle
	for i := range 8 {
		o, tr := flow(i)
		h := mustInsert(t, tb, o, tr, DNAT, uint32(i), now)
		for _, s := range handshake {
			tb.UpdateTCP(h, s.dir, &s.TCPSegment, now)
		}
		hs = append(hs, h)
	}
	e := func(i int) *entry { return &tb.entries[hs[i].idx-1] }
	// 1: caught mid-write.
	e(1).seq.Add(1)
	// 2: generation of the timer does not match the sequence.
	e(2).timer.Store(e(2).timer.Load() ^ 1<<genShift)
	// 3: a key word that packKey cannot produce.
	e(3).orig[4].Store(e(3).orig[4].Load() | 0x10000)
	// 4: a copy of flow 5's keys: the second one found is dropped.
	for w := range keyWords {
		e(4).orig[w].Store(e(5).orig[w].Load())
		e(4).reply[w].Store(e(5).reply[w].Load())
	}
	// 6: window words of another lifetime.
	e(6).win[Reply].Store(winTag(hs[6].gen+1) | winSeen | 1234)
	tb.Close()

	// Shorter timeouts now: the restored deadlines are brought back.
	cfg.Timeouts = Timeouts{TCPEstablished: time.Minute}
	tb = newTable(t, cfg)
	defer tb.Close()
	ri := tb.Restored()
	if !ri.Restored || ri.Torn != 1 || ri.Invalid != 3 || ri.Flows != 4 {
		t.Fatalf("restore %+v", ri)
	}
	for _, i := range []int{0, 6, 7} {
		o, _ := flow(i)
		fi := flowInfo(t, tb, o)
		if fi.Expires != time.Duration(now)+time.Minute {
			t.Errorf("flow %d expires at %v, want now+1m", i, fi.Expires)
		}
		// Each side's sequence is learnt afresh: an RST far from the
		// old window is accepted, the scale is kept.
		w := &tb.entries[fi.Handle.idx-1].win
		if o, r := w[Original].Load(), w[Reply].Load(); o&winSeen != 0 || r&winSeen != 0 ||
			(i != 6 && (window(o, r) != 502<<7)) {
			t.Errorf("flow %d window words %#x %#x", i, o, r)
		}
	}
	o0, _ := flow(0)
	f0, _ := mustLookup(t, tb, o0, now)
	if st, res := tb.UpdateTCP(f0.Handle, Reply, &TCPSegment{Flags: rst, Seq: 0x12345678}, now); res != UpdateOK || st != TCPClose {
		t.Errorf("RST after restore: %v %v", st, res)
	}
	// The freed entries are reused and the table still works.
	for i := 8; i < 60; i++ {
		o, tr := flow(i)
		mustInsert(t, tb, o, tr, DNAT, uint32(i), now)
	}
	if st := tb.Stats(); st.Live != 4+52 {
		t.Errorf("live %d", st.Live)
	}
}

// stateFileFor writes a state file for cfg holding one flow and returns its
// bytes.
func stateFileFor(t *testing.T, cfg Config) []byte {
	t.Helper()
	tb := newTable(t, cfg)
	mustInsert(t, tb, tup(client, 1, frontend, 80, packet.ProtoTCP), tup(client, 1, backend, 80, packet.ProtoTCP), DNAT, 1, cfg.Clock())
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(cfg.StatePath)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// resum fixes the header checksum after a test edits the header.
func resum(b []byte) {
	binary.LittleEndian.PutUint64(b[hdrChecksum:], xxhash.Sum64(b[:hdrChecksum]))
}

func TestStateFileIncompatible(t *testing.T) {
	now := int64(10 * sec)
	le := binary.LittleEndian
	cases := []struct {
		name   string
		edit   func(b []byte) []byte
		cfg    func(c *Config)
		reason string
	}{
		{"other capacity", nil, func(c *Config) { c.Capacity = 128 }, "capacity 64 in 1 shards, this table has 128 in 1"},
		{"other shard count", nil, func(c *Config) { c.shards = 4 }, "capacity 64 in 1 shards, this table has 64 in 4"},
		{"other version", func(b []byte) []byte { le.PutUint32(b[hdrVersion:], stateVersion+1); resum(b); return b }, nil, "layout version 2"},
		{"other layout", func(b []byte) []byte { le.PutUint64(b[hdrLayout:], layoutHash^1); resum(b); return b }, nil, "entry layout differs"},
		{"other entry size", func(b []byte) []byte { le.PutUint32(b[hdrEntrySize:], 64); resum(b); return b }, nil, "entry layout differs"},
		{"bad magic", func(b []byte) []byte { b[0] = 'Y'; return b }, nil, "bad magic"},
		{"corrupt header", func(b []byte) []byte { b[hdrSeed] ^= 1; return b }, nil, "checksum mismatch"},
		{"truncated", func(b []byte) []byte { return b[:len(b)-entrySize] }, nil, "truncated"},
		{"extended", func(b []byte) []byte { return append(b, make([]byte, 4096)...) }, nil, "want"},
		{"shorter than the header", func(b []byte) []byte { return b[:100] }, nil, "shorter than its header"},
		{"empty", func(b []byte) []byte { return b[:0] }, nil, "no state file yet"},
		{"garbage", func(b []byte) []byte { return []byte(strings.Repeat("garbage!", 1000)) }, nil, "bad magic"},
		{"another boot", func(b []byte) []byte { b[hdrBootID] ^= 0xff; resum(b); return b }, nil, "reboot"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := Config{Capacity: 64, StatePath: filepath.Join(t.TempDir(), "ct.state"), Clock: clockAt(&now)}
			b := stateFileFor(t, cfg)
			if c.name == "another boot" && bootID() == ([16]byte{}) {
				t.Skip("no boot id on this system")
			}
			if c.edit != nil {
				if err := os.WriteFile(cfg.StatePath, c.edit(b), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if c.cfg != nil {
				c.cfg(&cfg)
			}
			tb := newTable(t, cfg)
			ri := tb.Restored()
			if ri.Restored || ri.Flows != 0 || !strings.Contains(ri.Reason, c.reason) || ri.Existed != (c.name != "empty") {
				t.Errorf("got %+v, want reason %q", ri, c.reason)
			}
			if !strings.Contains(ri.String(), "started empty") {
				t.Errorf("String: %s", ri)
			}
			if st := tb.Stats(); st.Live != 0 {
				t.Errorf("live %d", st.Live)
			}
			// The file was made afresh for this table: the next
			// process adopts it.
			mustInsert(t, tb, tup(client, 2, frontend, 80, packet.ProtoTCP), tup(client, 2, backend, 80, packet.ProtoTCP), DNAT, 2, now)
			tb.Close()
			tb = newTable(t, cfg)
			defer tb.Close()
			if ri := tb.Restored(); !ri.Restored || ri.Flows != 1 {
				t.Errorf("reopened: %+v", ri)
			}
		})
	}
}

func TestStateFileInUseAndRemove(t *testing.T) {
	now := int64(sec)
	path := filepath.Join(t.TempDir(), "ct.state")
	cfg := Config{Capacity: 64, StatePath: path, Clock: clockAt(&now)}
	tb := newTable(t, cfg)
	if _, err := New(cfg); !errors.Is(err, ErrStateInUse) {
		t.Errorf("second table on the same file: %v", err)
	}
	tb.Close()
	tb2 := newTable(t, cfg)
	tb2.Close()
	if err := RemoveState(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file still there: %v", err)
	}
	if err := RemoveState(path); err != nil {
		t.Errorf("removing a missing file: %v", err)
	}
	// A path that cannot be created is an error, not a silent fallback.
	if _, err := New(Config{Capacity: 64, StatePath: "/proc/no/such/ct.state"}); err == nil {
		t.Error("New with an impossible state path succeeded")
	}
}

func TestNoStateFile(t *testing.T) {
	tb := newTable(t, Config{Capacity: 64})
	if ri := tb.Restored(); ri != (RestoreInfo{}) || ri.String() != "no state file" {
		t.Errorf("%+v", ri)
	}
	if err := tb.Close(); err != nil {
		t.Error(err)
	}
	mustInsert(t, tb, tup(client, 1, frontend, 80, packet.ProtoTCP), tup(client, 1, backend, 80, packet.ProtoTCP), DNAT, 1, 0)
}

func TestMonotonicNow(t *testing.T) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	if d := MonotonicNow() - ts.Nano(); d < 0 || d > int64(50*time.Millisecond) {
		t.Errorf("MonotonicNow is %v off CLOCK_MONOTONIC", time.Duration(d))
	}
	if a := testing.AllocsPerRun(100, func() { MonotonicNow() }); a != 0 {
		t.Errorf("%v allocs", a)
	}
}
