package dataplane

import (
	"encoding/binary"
	"math/bits"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// The worker's per-packet fast path. A batch is worked through twice:
//
//  1. Worker.prepareBatch runs steps over the whole batch, each before the
//     next. prepare reads every frame's tuple straight from its headers
//     (untagged IPv4 TCP and UDP without options or fragmentation, the
//     common case), hashes it once and looks in the flow cache;
//     prefetchFirst prefetches what the second pass will read: the
//     conntrack entry of a cached flow, or the table's index slot.
//     prefetchLookups then reads each of those slots, arrived meanwhile,
//     and prefetches the entry it points to. A frame whose slot is empty
//     opens a new flow: predictNewFlow makes its backend choice ahead,
//     and prefetchInserts prefetches what the insert will touch (the
//     entry it will fill, the reply tuple's index slot). The cache misses
//     of the whole batch overlap.
//  2. process translates each frame. A frame whose flow the cache holds
//     (and conntrack confirms, Revalidate) takes fastV4: a few length
//     checks, the state update, and a rewrite whose checksum changes were
//     worked out when the flow entered the cache, one update per checksum,
//     TTL included. Everything else (other protocols, options, VLANs,
//     fragments, ICMP errors, a TTL about to expire, a checksum left
//     partial by offload, new flows) takes the general path: packet.Parse,
//     nat.DecrementTTL, nat.CompleteIfPartial, nat.Rewrite. Both write the
//     same bytes (TestFastPathMatchesGeneral).

// prepared is what prepare found out about one frame of the batch.
type prepared struct {
	key  conntrack.Key
	hash uint64
	// quick says key and hash are the frame's (it is untagged IPv4 TCP or
	// UDP, no options, not a fragment); else the rest means nothing.
	quick bool
	// way is the flow cache way that held key at prepare, -1 none; set
	// is the set; puts the cache's put count then. A frame before this
	// one may have changed the set since (puts tells).
	way  int8
	set  uint32
	puts uint64
	// fresh says the table has no flow for key (the index slot its
	// lookup starts at is empty), so the frame opens one unless an
	// earlier frame of the batch did. drawn says predictNewFlow drew rnd,
	// the random number the flow's backend choice uses; replyKnown that
	// it worked out replyHash, the hash of the new flow's reply tuple.
	fresh, drawn, replyKnown bool
	rnd, replyHash           uint64
	// For a fresh frame: orig is its tuple, svcHash the hash of its
	// frontend key, fe its frontend (nil: none) and be predictNewFlow's
	// backend (nil: no choice made); newFlow takes fe and be instead of
	// looking again. They are cleared at the end of the batch
	// (forgetPredictions), so that no old service table stays reachable
	// from here.
	orig    packet.Tuple
	svcHash uint64
	fe      *service.Frontend
	be      *service.Backend
}

// quickKey reads into k the tuple of an untagged IPv4 TCP or UDP frame
// without IP options that is not a fragment. Whenever it reports true and
// packet.Parse accepts the frame, Parse finds the same tuple.
func quickKey(frame []byte, k *conntrack.Key) bool {
	if len(frame) < packet.EthernetLen+packet.IPv4MinLen+4 || frame[12] != 0x08 || frame[13] != 0x00 || frame[14] != 0x45 {
		return false
	}
	proto := packet.Proto(frame[23])
	if proto != packet.ProtoTCP && proto != packet.ProtoUDP || frame[20]&0x3f != 0 || frame[21] != 0 {
		return false
	}
	k.SetV4([4]byte(frame[26:30]), [4]byte(frame[30:34]),
		binary.BigEndian.Uint16(frame[34:36]), binary.BigEndian.Uint16(frame[36:38]), proto)
	return true
}

// prepare is the first step of the first pass, for frame, the i-th of the
// batch: its tuple, hash and place in the flow cache. It prefetches
// nothing: prefetchFirst does, for the whole batch at once.
func (p *Processor) prepare(i int, frame []byte) {
	pre := &p.pre[i]
	pre.way = -1
	pre.fresh, pre.drawn, pre.replyKnown = false, false, false
	pre.quick = quickKey(frame, &pre.key)
	if !pre.quick {
		return
	}
	pre.hash = p.cfg.Conntrack.Hash(&pre.key)
	if p.cacheOff {
		return
	}
	pre.set, pre.way = p.cache.lookup(&pre.key, pre.hash)
	pre.puts = p.cache.puts
}

// The prefetching steps below are short loops over the batch on their
// own. Issued from within the longer steps, the prefetches overlapped only
// a few at a time: the profile charged a fifth of a new flow's time to the
// prefetch instructions themselves, as if each held its place in the
// core's reorder window until its page walk ended. In short loops dozens
// fit in the window (BenchmarkWorkerNewFlow, when this was written: 640-655
// ns against 821-857 ns per flow).

// prefetchFirst prefetches, for each of the batch's n frames, the
// conntrack entry of a flow the cache holds, or else the index slot its
// lookup starts at.
func (p *Processor) prefetchFirst(n int) {
	ct := p.cfg.Conntrack
	for i := range n {
		pre := &p.pre[i]
		switch {
		case !pre.quick:
		case pre.way >= 0:
			ct.PrefetchFlow(p.cache.sets[pre.set][pre.way].handle)
		default:
			ct.PrefetchSlot(pre.hash)
		}
	}
}

// prefetchLookups reads, for each frame whose flow the cache did not hold,
// the index slot prefetchFirst asked for, arrived meanwhile, and
// prefetches the entry it points to. It reports whether any frame is
// fresh: its slot was empty, so the table has no flow for it.
func (p *Processor) prefetchLookups(n int) (fresh bool) {
	ct := p.cfg.Conntrack
	for i := range n {
		if pre := &p.pre[i]; pre.quick && pre.way < 0 {
			pre.fresh = !ct.PrefetchLookup(pre.hash)
			fresh = fresh || pre.fresh
		}
	}
	return fresh
}

// The steps for fresh frames (Worker.prepareBatch) take the service
// lookup one cache miss at a time over the batch (see service.Table's
// PrefetchLookup): lookService hashes the frame's frontend key and
// prefetches its index slot, locateFrontend finds the frontend and
// prefetches it, prefetchSelect prefetches what the backend choice reads
// of it, and predictNewFlow decides.

// lookService unpacks the tuple of each fresh frame of the batch (n
// frames) from the key prepare read, and prefetches the service index slot
// of its destination.
func (p *Processor) lookService(n int) {
	for i := range n {
		if pre := &p.pre[i]; pre.fresh {
			pre.orig = pre.key.Tuple()
			o := &pre.orig
			pre.svcHash = p.table.PrefetchLookup(o.Proto, &o.Dst, o.DstPort)
		}
	}
}

// locateFrontend finds the frontends of the batch's fresh frames (n
// frames) and prefetches them.
func (p *Processor) locateFrontend(n int) {
	for i := range n {
		if pre := &p.pre[i]; pre.fresh {
			o := &pre.orig
			if pre.fe = p.table.LookupHashed(pre.svcHash, o.Proto, &o.Dst, o.DstPort); pre.fe != nil {
				p.predicted = true
			}
		}
	}
}

// prefetchSelect prefetches what the backend choice reads of each fresh
// frame's frontend.
func (p *Processor) prefetchSelect(n int) {
	for i := range n {
		if pre := &p.pre[i]; pre.fresh && pre.fe != nil {
			pre.fe.PrefetchSelect()
		}
	}
}

// predictNewFlow makes, for a fresh frame (the i-th of the batch), the
// backend choice newFlow will make, and works out the hash of the reply
// tuple Insert will look for. That tuple's index slot is a random access
// into the table's index, the one miss of a new flow the steps before
// cannot foresee: the reply tuple depends on the backend. The random
// number the choice draws is kept for newFlow (pre.rnd), so the choice
// here is the one newFlow makes; choices that change state (round robin,
// session affinity) and masqueraded flows (their source port is allocated
// by the insert) are not predicted.
func (p *Processor) predictNewFlow(i int) {
	pre := &p.pre[i]
	pre.rnd, pre.drawn = p.rand(), true
	fe := pre.fe
	if fe == nil || fe.Port.Scheduler == service.RoundRobin || fe.Port.AffinityTimeout > 0 {
		return
	}
	o := &pre.orig
	be := fe.Select(flowHash(o), pre.rnd, p.table.IsLocalOrigin(o.Src))
	if be == nil {
		return
	}
	pre.be = be
	if !be.Addr.Is4() || service.NeedsMasquerade(fe, o.Src, be) {
		return
	}
	var reply conntrack.Key
	reply.SetV4([4]byte(be.Addr[12:]), [4]byte(o.Src[12:]), be.Port, o.SrcPort, o.Proto)
	pre.replyHash, pre.replyKnown = p.cfg.Conntrack.Hash(&reply), true
}

// forgetPredictions drops the first n frames' predicted frontends and
// backends at the end of a batch.
func (p *Processor) forgetPredictions(n int) {
	if !p.predicted {
		return
	}
	for i := range n {
		p.pre[i].fe, p.pre[i].be = nil, nil
	}
	p.predicted = false
}

// prefetchInserts prefetches, for each fresh frame to a service, what its
// insert will touch: the entry it will fill and the index slot of its
// reply tuple.
func (p *Processor) prefetchInserts(n int) {
	ct := p.cfg.Conntrack
	// Fresh frames of the batch into the same shard take its next free
	// entries one after another: each prefetches its own.
	var ahead [conntrack.MaxShards]uint16
	for i := range n {
		if pre := &p.pre[i]; pre.fresh && pre.fe != nil {
			sh := ct.ShardIndex(pre.hash)
			ct.PrefetchInsert(pre.hash, int(ahead[sh]))
			ahead[sh]++
			if pre.replyKnown {
				ct.PrefetchSlot(pre.replyHash)
			}
		}
	}
}

// fastV4 translates a frame whose flow the cache holds in slot s (the
// caller revalidated it), or reports false to leave the frame, untouched,
// to the general path. See the comment at the top of the file. opening
// says the frame is the one that created the flow, so a SYN is the
// connection's own and not a new one on an old tuple.
func (p *Processor) fastV4(frame []byte, s *flowSlot, now int64, opening bool) (Verdict, bool) {
	if !s.fast {
		return Verdict{}, false
	}
	const l3, l4 = packet.EthernetLen, packet.EthernetLen + packet.IPv4MinLen
	end := l3 + int(binary.BigEndian.Uint16(frame[l3+2:l3+4]))
	ttl := frame[l3+8]
	if end > len(frame) || end < l4 || ttl <= 1 {
		return Verdict{}, false
	}
	seg := frame[l4:end]
	proto := packet.Proto(frame[l3+9])
	csumOff, doff := 6, 0
	if proto == packet.ProtoTCP {
		if len(seg) < packet.TCPMinLen {
			return Verdict{}, false
		}
		if doff = int(seg[12]>>4) * 4; doff < packet.TCPMinLen || doff > len(seg) {
			return Verdict{}, false
		}
		csumOff = 16
	} else if len(seg) < packet.UDPLen || int(binary.BigEndian.Uint16(seg[4:6])) < packet.UDPLen ||
		int(binary.BigEndian.Uint16(seg[4:6])) > len(seg) {
		return Verdict{}, false
	}
	csum := binary.BigEndian.Uint16(seg[csumOff:])
	if csum == nat.Fold(uint64(s.pseudo)+uint64(len(seg))) {
		return Verdict{}, false // a checksum left partial by offload: nat.CompleteIfPartial
	}
	ct := p.cfg.Conntrack
	if proto == packet.ProtoTCP {
		var tcp conntrack.TCPSegment
		if flags := seg[13]; flags&packet.TCPSyn == 0 {
			tcp.ReadNoOptions(seg, doff)
		} else {
			if !opening && flags&packet.TCPAck == 0 {
				return Verdict{}, false // may open a new connection on an old tuple: established decides
			}
			tcp, _ = conntrack.ParseTCPSegment(seg) // with the window scale option
		}
		if _, res := ct.UpdateTCP(s.handle, s.dir, &tcp, now); res == conntrack.UpdateOutOfWindow {
			return Verdict{Action: Drop, Reason: packet.DropOutOfWindow}, true
		}
	} else {
		ct.Update(s.handle, s.dir, 0, now)
	}
	// TTL and addresses in one update of the header checksum: the TTL
	// shares its 16-bit word with the protocol.
	w := uint16(ttl)<<8 | uint16(proto)
	ip := uint64(s.ipDelta) + uint64(^w) + uint64(w-0x100)
	frame[l3+8] = ttl - 1
	binary.BigEndian.PutUint16(frame[l3+10:], ^nat.Fold(uint64(^binary.BigEndian.Uint16(frame[l3+10:]))+ip))
	rw := &s.rewrite
	copy(frame[l3+12:l3+16], rw.Src[12:])
	copy(frame[l3+16:l3+20], rw.Dst[12:])
	binary.BigEndian.PutUint16(seg[0:], rw.SrcPort)
	binary.BigEndian.PutUint16(seg[2:], rw.DstPort)
	if s.l4Delta != 0 && (proto == packet.ProtoTCP || csum != 0) { // a zero UDP checksum means none
		c := ^nat.Fold(uint64(^csum) + uint64(s.l4Delta))
		if c == 0 && proto == packet.ProtoUDP {
			c = 0xffff
		}
		binary.BigEndian.PutUint16(seg[csumOff:], c)
	}
	return p.forward(&rw.Dst, len(frame)), true
}

// fastDeltas works out, for a flow whose packets arrive with the tuple
// packed in k and leave with tuple to, what fastV4 needs: the change to the
// IPv4 header checksum from the addresses, the change to the TCP or UDP
// checksum from the addresses and ports, and the pseudo-header sum of the
// arriving tuple without its length (to recognise a partial checksum).
// Only words that change count, as in nat.Rewrite. ok is false unless both
// tuples are IPv4 TCP or UDP.
func fastDeltas(k *conntrack.Key, to *packet.Tuple) (ip, l4, pseudo uint16, ok bool) {
	const v4Mapped = 0xffff << 16 // the low word of a v4-mapped address's second half
	proto := packet.Proto(k[4] >> 8)
	if k[0] != 0 || k[2] != 0 || uint32(k[1]) != v4Mapped || uint32(k[3]) != v4Mapped || !to.Src.Is4() || !to.Dst.Is4() ||
		proto != packet.ProtoTCP && proto != packet.ProtoUDP {
		return 0, 0, 0, false
	}
	// The key holds the address bytes in little-endian words.
	src, dst := bits.ReverseBytes32(uint32(k[1]>>32)), bits.ReverseBytes32(uint32(k[3]>>32))
	sport, dport := uint16(k[4]>>48), uint16(k[4]>>32)
	nsrc, ndst := binary.BigEndian.Uint32(to.Src[12:]), binary.BigEndian.Uint32(to.Dst[12:])
	var addrs, ports uint64
	if src != nsrc {
		addrs += uint64(^src) + uint64(nsrc)
	}
	if dst != ndst {
		addrs += uint64(^dst) + uint64(ndst)
	}
	if sport != to.SrcPort {
		ports += uint64(^sport) + uint64(to.SrcPort)
	}
	if dport != to.DstPort {
		ports += uint64(^dport) + uint64(to.DstPort)
	}
	return nat.Fold(addrs), nat.Fold(addrs + ports), nat.Fold(uint64(src) + uint64(dst) + uint64(proto)), true
}
