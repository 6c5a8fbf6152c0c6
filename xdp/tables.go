package xdp

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// Key is what a frontend or backend entry matches: address, port and
// protocol. For ICMP echo, Port is the echo identifier.
type Key struct {
	Addr  packet.Addr
	Port  uint16
	Proto packet.Proto
}

func (k Key) String() string { return fmt.Sprintf("%v %v:%d", k.Proto, k.Addr, k.Port) }

// Flags say what an address in the address table is to xdproxy. The values
// are those of enum addr_flag in bpf/xdp.c.
type Flags uint32

// FlagVIP marks an address that only services use (a cluster, external or
// load-balancer IP that is no node address): every frame to it is
// xdproxy's, so a later fragment to it is redirected even when the program
// did not see the datagram's first fragment.
const FlagVIP Flags = 2

// ErrTableFull is returned by SetTables when a table holds more entries
// than Options allowed.
var ErrTableFull = errors.New("xdp: table full")

// present is the value of frontends and flows entries: the key is all the
// program looks at.
const present uint8 = 1

// svcKey converts k to the map key layout: the port in network byte order
// and the pad byte zero, since the kernel hashes every byte.
func (k Key) svcKey() bpfSvcKey {
	return bpfSvcKey{Addr: k.Addr, Port: networkOrder16(k.Port), Proto: uint8(k.Proto)}
}

// networkOrder16 returns the uint16 whose in-memory bytes are v in big
// endian, which is how the program sees ports in packets.
func networkOrder16(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// tableState is what the maps hold. Objects owns the maps, so after a
// successful write the state equals the kernel's contents; after a failed
// one it is read back from the kernel before the next sync.
type tableState struct {
	frontends map[bpfSvcKey]struct{}
	addrs     map[bpfAddrKey]uint32
}

// SetTables makes the maps hold exactly the given frontends and VIP
// addresses (addresses whose every frame is a service's; see FlagVIP). It
// writes only the difference to what the maps hold, and adds new entries
// before it deletes stale ones, so a frame of a service present in both the
// old and the new tables is never passed to the kernel in between. Only
// when a table could not hold old and new entries together are its stale
// entries deleted first. Duplicate keys are allowed. On error the maps may
// hold a mix of old and new entries; calling SetTables again repairs them.
func (o *Objects) SetTables(frontends []Key, vips []packet.Addr) error {
	want := tableState{
		frontends: keySet(frontends),
		addrs:     make(map[bpfAddrKey]uint32, len(vips)),
	}
	for _, a := range vips {
		want.addrs[bpfAddrKey{Addr: a}] = uint32(FlagVIP)
	}
	if err := checkSize("frontends", len(want.frontends), o.opts.MaxFrontends); err != nil {
		return err
	}
	if err := checkSize("addrs", len(want.addrs), o.opts.MaxAddrs); err != nil {
		return err
	}

	o.mu.Lock()
	defer o.mu.Unlock()
	if o.state == nil {
		st, err := o.readTables()
		if err != nil {
			return err
		}
		o.state = st
	}
	have := o.state
	// Until every write has succeeded the kernel's contents are unknown.
	o.state = nil

	fe := diffSet(have.frontends, want.frontends, o.opts.MaxFrontends)
	ad := diffAddrs(have.addrs, want.addrs, o.opts.MaxAddrs)

	// Tables that cannot hold old and new together shed stale entries
	// first.
	if err := deleteEarly(o.frontends, fe); err != nil {
		return fmt.Errorf("xdp: frontends: %w", err)
	}
	if err := deleteEarly(o.addrs, ad); err != nil {
		return fmt.Errorf("xdp: addrs: %w", err)
	}
	// Addresses before the frontends that lead to them.
	if err := put(o.addrs, ad.put, ad.putValues); err != nil {
		return fmt.Errorf("xdp: addrs: %w", err)
	}
	if err := put(o.frontends, fe.put, presentValues(len(fe.put))); err != nil {
		return fmt.Errorf("xdp: frontends: %w", err)
	}
	if err := deleteLate(o.frontends, fe); err != nil {
		return fmt.Errorf("xdp: frontends: %w", err)
	}
	if err := deleteLate(o.addrs, ad); err != nil {
		return fmt.Errorf("xdp: addrs: %w", err)
	}
	o.state = &want
	return nil
}

func keySet(keys []Key) map[bpfSvcKey]struct{} {
	s := make(map[bpfSvcKey]struct{}, len(keys))
	for _, k := range keys {
		s[k.svcKey()] = struct{}{}
	}
	return s
}

func checkSize(table string, n, limit int) error {
	if n > limit {
		return fmt.Errorf("%w: %s needs %d entries, room for %d (see Options)", ErrTableFull, table, n, limit)
	}
	return nil
}

// diff is the change of one table: keys to write, and stale keys to
// delete either before (early) or after (late) the writes.
type diff[K comparable] struct {
	put       []K
	putValues []uint32 // addrs only
	stale     []K
	early     bool
}

func diffSet(have, want map[bpfSvcKey]struct{}, limit int) diff[bpfSvcKey] {
	var d diff[bpfSvcKey]
	for k := range want {
		if _, ok := have[k]; !ok {
			d.put = append(d.put, k)
		}
	}
	for k := range have {
		if _, ok := want[k]; !ok {
			d.stale = append(d.stale, k)
		}
	}
	d.early = len(have)+len(d.put) > limit
	return d
}

func diffAddrs(have, want map[bpfAddrKey]uint32, limit int) diff[bpfAddrKey] {
	var d diff[bpfAddrKey]
	added := 0
	for k, v := range want {
		old, ok := have[k]
		if !ok {
			added++
		}
		if !ok || old != v {
			d.put = append(d.put, k)
			d.putValues = append(d.putValues, v)
		}
	}
	for k := range have {
		if _, ok := want[k]; !ok {
			d.stale = append(d.stale, k)
		}
	}
	d.early = len(have)+added > limit
	return d
}

func presentValues(n int) []uint8 {
	v := make([]uint8, n)
	for i := range v {
		v[i] = present
	}
	return v
}

func deleteEarly[K comparable](m *ebpf.Map, d diff[K]) error {
	if !d.early {
		return nil
	}
	return del(m, d.stale)
}

func deleteLate[K comparable](m *ebpf.Map, d diff[K]) error {
	if d.early {
		return nil
	}
	return del(m, d.stale)
}

// put writes keys and values in one batch where the kernel supports it.
func put[K comparable, V any](m *ebpf.Map, keys []K, values []V) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := m.BatchUpdate(keys, values, nil)
	if !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	for i := range keys {
		if err := m.Put(&keys[i], &values[i]); err != nil {
			return err
		}
	}
	return nil
}

// del deletes keys in one batch where the kernel supports it. Keys the map
// does not hold are skipped.
func del[K comparable](m *ebpf.Map, keys []K) error {
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		if errors.Is(err, ebpf.ErrKeyNotExist) && n < len(keys) {
			// The kernel stops at the first missing key, keys[n].
			keys = keys[n+1:]
			continue
		}
		if !errors.Is(err, ebpf.ErrNotSupported) {
			return err
		}
		break
	}
	for i := range keys {
		if err := m.Delete(&keys[i]); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// readTables reads the maps' contents back from the kernel.
func (o *Objects) readTables() (*tableState, error) {
	st := &tableState{
		frontends: map[bpfSvcKey]struct{}{},
		addrs:     map[bpfAddrKey]uint32{},
	}
	var k bpfSvcKey
	var v uint8
	it := o.frontends.Iterate()
	for it.Next(&k, &v) {
		st.frontends[k] = struct{}{}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("xdp: reading frontends: %w", err)
	}
	var ak bpfAddrKey
	var flags uint32
	it = o.addrs.Iterate()
	for it.Next(&ak, &flags) {
		st.addrs[ak] = flags
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("xdp: reading addrs: %w", err)
	}
	return st, nil
}
