package dataplane

import (
	"math/bits"
	"time"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// ProcessorConfig holds what a Processor shares with the other workers.
type ProcessorConfig struct {
	Services  *service.Current
	Conntrack *conntrack.Table
	Affinity  *service.Affinity
	// SNATPorts is the source-port range of masqueraded flows.
	SNATPorts conntrack.PortRange
	// SNATSource returns the address to masquerade a flow to backend as
	// (the node's address on the way there). Called once per new
	// masqueraded flow, never per packet of an established one.
	SNATSource func(backend packet.Addr) (packet.Addr, bool)
	// SweepBudget is the most conntrack slots a worker checks for expiry
	// per batch (Housekeep); how many are due depends on the time since
	// the last sweep, not on the number of batches. Default 256.
	SweepBudget int
	// RejectsPerSecond limits the TCP resets and ICMP unreachables one
	// worker generates for services without endpoints, so that a flood
	// cannot turn the node into a reflector. 0 means 1000.
	RejectsPerSecond int
	// Seed starts the worker's random source (Random scheduler).
	Seed uint64
}

// Processor translates frames. It belongs to one worker: it keeps that
// worker's random source, scratch packet and counters, and reads the
// service table the worker loaded for the current batch. Everything it
// shares with other workers (conntrack, affinity, the table itself) is
// safe for concurrent use.
type Processor struct {
	cfg   ProcessorConfig
	table *service.Table
	pkt   packet.Packet
	rng   uint64
	cache flowCache
	// cacheOff bypasses the flow cache and the fast path (tests compare
	// the two paths with it).
	cacheOff bool
	// pre is the first pass's findings for each frame of the batch
	// (prepare, fastpath.go); predicted says some hold a prediction.
	pre       [maxBatch]prepared
	predicted bool

	// CacheHits and CacheMisses count established packets whose flow the
	// flow cache had (and was still valid) or not; read by its worker.
	CacheHits, CacheMisses uint64

	rejectTokens int
	rejectRefill int64

	// nextHop is where the frame of the last Forward or Reply verdict
	// goes (Destination).
	nextHop packet.Addr

	// NewFlows counts flows this processor created; read by its worker.
	NewFlows uint64
	// NewReplies are the reply tuples of the flows created in this batch,
	// and NewHandles their conntrack handles, in the same order. The XDP
	// program recognises replies only by their exact tuple (a backend's
	// reply to a client looks like direct traffic from the backend, a
	// reply to a SNAT port like the node's own traffic), so the worker
	// hands these to the XDP flow map before it transmits the batch.
	NewReplies []packet.Tuple
	NewHandles []conntrack.Handle
}

// NewProcessor makes the processor of one worker.
func NewProcessor(cfg ProcessorConfig) *Processor {
	if cfg.SweepBudget == 0 {
		cfg.SweepBudget = 256
	}
	if cfg.RejectsPerSecond == 0 {
		cfg.RejectsPerSecond = 1000
	}
	return &Processor{cfg: cfg, rng: cfg.Seed | 1,
		NewReplies: make([]packet.Tuple, 0, maxBatch), NewHandles: make([]conntrack.Handle, 0, maxBatch)}
}

// maxBatch bounds a worker's batch, so that NewReplies (at most one per
// frame) never overflows.
const maxBatch = 1024

// BeginBatch loads the current service table for the frames that follow.
// The table is not reloaded per packet: a batch sees one table.
func (p *Processor) BeginBatch(now int64) { p.table = p.cfg.Services.Load() }

// Housekeep runs bounded background work between batches: expiring
// connection-tracking entries, at the pace conntrack.Table.SweepDue sets
// (the whole table once per sweep interval, shared by all workers), at
// most SweepBudget entries per call.
func (p *Processor) Housekeep(now int64) { p.cfg.Conntrack.SweepDue(now, p.cfg.SweepBudget) }

// HousekeepIdle is Housekeep for a worker whose ring is empty: it may
// inspect idleSweepFactor times as many entries, so that sweeping keeps
// some pace when batches are rare.
func (p *Processor) HousekeepIdle(now int64) {
	p.cfg.Conntrack.SweepDue(now, p.cfg.SweepBudget*idleSweepFactor)
}

// HousekeepIdleFor is HousekeepIdle after an idle sleep of up to wait: the
// budget grows with the sleep (a worker that sleeps 2 s sweeps ten times
// what one that sleeps 200 ms does), so the sweep keeps its pace.
func (p *Processor) HousekeepIdleFor(now int64, wait time.Duration) {
	p.cfg.Conntrack.SweepDue(now, p.cfg.SweepBudget*idleSweepFactor*max(1, int(wait/(200*time.Millisecond))))
}

// idleSweepFactor: an idle worker turns every IdleWait (200 ms) and may
// then sweep 16 x 256 entries, at most about 0.1% of a CPU while flows
// are tracked (none without).
const idleSweepFactor = 16

// Process translates one frame in place and says what to do with it. now is
// a monotonic time in nanoseconds. frame's capacity may exceed its length:
// a generated reply may use it. Process does not allocate, lock or make
// system calls.
func (p *Processor) Process(frame []byte, now int64) Verdict { return p.process(frame, now, nil) }

// process is Process; pre, when not nil, is what prepare found for frame
// (the worker's batches): its tuple, hashed once, and where the flow cache
// holds it. An established IPv4 TCP or UDP flow then takes fastV4, from
// the flow cache or, on a miss, from conntrack through the cache.
func (p *Processor) process(frame []byte, now int64, pre *prepared) Verdict {
	ct := p.cfg.Conntrack
	known := false // the table was asked for pre.key and has no flow
	if pre != nil && pre.quick && !p.cacheOff {
		var s *flowSlot
		if pre.puts == p.cache.puts {
			// The cache is as prepare saw it.
			if pre.way >= 0 {
				s = &p.cache.sets[pre.set][pre.way]
			}
		} else {
			// An earlier frame of the batch cached a flow (maybe this
			// one, maybe one in its place).
			s = p.cache.find(&pre.key, pre.hash)
		}
		if s != nil && !ct.Revalidate(s.handle, s.stamp, now) {
			p.cache.drop(s) // gone or replaced: ask the table
			s = nil
		}
		var flow conntrack.Flow
		if s != nil {
			p.CacheHits++
		} else if dir, ok := ct.LookupKey(&pre.key, pre.hash, now, &flow); ok {
			p.CacheMisses++
			s = p.cache.put(&pre.key, pre.hash, flow.Handle, flow.Stamp(), &flow.Rewrite, dir)
		} else {
			known = true
		}
		if s != nil {
			if v, ok := p.fastV4(frame, s, now, false); ok {
				return v
			}
		}
	}
	pk := &p.pkt
	if r := packet.Parse(frame, pk); r != packet.OK {
		return notForwarded(r)
	}
	switch {
	case pk.IsLaterFragment():
		return p.laterFragment(frame, now)
	case pk.IsICMPError:
		return p.icmpError(frame, now)
	}
	if known {
		return p.newFlow(frame, now, pre)
	}
	var k conntrack.Key
	var h uint64
	if pre != nil && pre.quick {
		k, h = pre.key, pre.hash // quickKey's tuple is Parse's
	} else {
		tu := pk.Tuple()
		k = conntrack.MakeKey(&tu)
		h = ct.Hash(&k)
	}
	if !p.cacheOff {
		if s := p.cache.find(&k, h); s != nil {
			if ct.Revalidate(s.handle, s.stamp, now) {
				if pre == nil || !pre.quick {
					p.CacheHits++ // not counted above
				}
				return p.established(frame, s.handle, &s.rewrite, s.dir, now)
			}
			p.cache.drop(s)
		}
	}
	var flow conntrack.Flow
	if dir, ok := ct.LookupKey(&k, h, now, &flow); ok {
		p.CacheMisses++
		if !p.cacheOff {
			p.cache.put(&k, h, flow.Handle, flow.Stamp(), &flow.Rewrite, dir)
		}
		return p.established(frame, flow.Handle, &flow.Rewrite, dir, now)
	}
	return p.newFlow(frame, now, pre)
}

// Destination is the address to route the frame of the last Forward or
// Reply verdict to: the translated destination address for Forward, the
// original source for Reply.
func (p *Processor) Destination() packet.Addr { return p.nextHop }

// forward is a Forward verdict for a frame of n bytes sent on to dst.
func (p *Processor) forward(dst *packet.Addr, n int) Verdict {
	p.nextHop = *dst
	return Verdict{Action: Forward, Len: n}
}

// CompletePartial completes a TCP or UDP checksum that checksum offload
// left partial (nat.CompleteIfPartial) in a frame the worker hands to the
// kernel's stack as it came (a pass verdict): the stack checks the
// checksums of frames from the exception link and would drop it. Other
// frames are left alone.
func (p *Processor) CompletePartial(frame []byte) {
	pk := &p.pkt
	if packet.Parse(frame, pk) == packet.OK {
		nat.CompleteIfPartial(frame, pk)
	}
}

func notForwarded(r packet.Reason) Verdict {
	if r.IsPass() {
		return Verdict{Action: Pass, Reason: r}
	}
	return Verdict{Action: Drop, Reason: r}
}

// established translates a packet of a tracked flow h, found in
// direction dir with rw the tuple to rewrite it to: one rewrite, one state
// update.
func (p *Processor) established(frame []byte, h conntrack.Handle, rw *packet.Tuple, dir conntrack.Direction, now int64) Verdict {
	pk := &p.pkt
	if pk.Proto == packet.ProtoTCP && pk.TCPFlags&(packet.TCPSyn|packet.TCPAck) == packet.TCPSyn &&
		dir == conntrack.Original && p.cfg.Conntrack.Closed(h) {
		// The client opens a new connection on the tuple of one that
		// ended: as netfilter does, forget the old one and translate
		// afresh, so that the new connection gets a backend the service
		// has now (and a cached copy of the flow fails Revalidate).
		p.cfg.Conntrack.Delete(h)
		return p.newFlow(frame, now, nil)
	}
	if !nat.DecrementTTL(frame, pk) {
		return Verdict{Action: Drop, Reason: packet.DropTTLExceeded}
	}
	nat.CompleteIfPartial(frame, pk)
	tcpFlags := pk.TCPFlags
	first := pk.IsFirstFragment()
	var fk conntrack.FragmentKey
	if first {
		fk = conntrack.FragmentKeyOf(pk)
	}
	if pk.Proto == packet.ProtoTCP && !first && !pk.Fragmented {
		// Window tracking: a reset or FIN outside the receiver's window is
		// not the peer's (a blind attack) and must not close the flow.
		if seg, ok := conntrack.ParseTCPSegment(frame[pk.L4:pk.End]); ok {
			if _, res := p.cfg.Conntrack.UpdateTCP(h, dir, &seg, now); res == conntrack.UpdateOutOfWindow {
				return Verdict{Action: Drop, Reason: packet.DropOutOfWindow}
			}
		}
		if !nat.Rewrite(frame, pk, *rw) {
			return Verdict{Action: Drop, Reason: packet.DropInvalidState}
		}
		return p.forward(&rw.Dst, len(frame))
	}
	if !nat.Rewrite(frame, pk, *rw) {
		return Verdict{Action: Drop, Reason: packet.DropInvalidState}
	}
	p.cfg.Conntrack.Update(h, dir, tcpFlags, now)
	if first {
		p.cfg.Conntrack.RememberFragment(fk, rw.Src, rw.Dst, now)
	}
	return p.forward(&rw.Dst, len(frame))
}

// newFlow handles the first packet of a flow: find the frontend, choose a
// backend, allocate a SNAT port when masquerading, track and translate.
func (p *Processor) newFlow(frame []byte, now int64, pre *prepared) Verdict {
	pk := &p.pkt
	tbl := p.table
	if tbl == nil {
		return Verdict{Action: Pass, Reason: packet.PassNoService}
	}
	var fe *service.Frontend
	if pre != nil && pre.fresh && pre.fe != nil {
		fe = pre.fe // locateFrontend found it: the same table, the same tuple
	} else {
		fe = tbl.Lookup(pk.Proto, pk.Dst, pk.DstPort)
	}
	if fe == nil {
		// Not a service: a reply of a flow we no longer track, or traffic
		// that raced a table change. The kernel decides.
		return Verdict{Action: Pass, Reason: packet.PassNoService}
	}
	if !fe.AllowsSource(pk.Src) {
		return Verdict{Action: Drop, Reason: packet.DropSourceRange}
	}
	if pk.Proto == packet.ProtoTCP && pk.TCPFlags&packet.TCPRst != 0 {
		// A reset opens nothing; answering or tracking it would only
		// help an attacker.
		return Verdict{Action: Drop, Reason: packet.DropInvalidState}
	}
	localOrigin := tbl.IsLocalOrigin(pk.Src)
	switch fe.Verdict(localOrigin) {
	case service.Reject:
		return p.reject(frame, now)
	case service.Drop:
		return Verdict{Action: Drop, Reason: packet.DropNoBackend}
	}
	orig := pk.Tuple()
	hash := flowHash(&orig)
	var rnd uint64
	if pre != nil && pre.drawn {
		rnd = pre.rnd // predictNewFlow chose with it
	} else {
		rnd = p.rand()
	}
	var be *service.Backend
	if pre != nil && pre.fresh && pre.be != nil {
		be = pre.be // predictNewFlow's choice, with the same tuple and rnd
	} else if fe.Port.AffinityTimeout > 0 && p.cfg.Affinity != nil {
		be = fe.SelectWithAffinity(p.cfg.Affinity, pk.Src, hash, rnd, localOrigin, uint32(now/1e9))
	} else {
		be = fe.Select(hash, rnd, localOrigin)
	}
	if be == nil {
		return Verdict{Action: Drop, Reason: packet.DropNoBackend}
	}
	translated := orig
	translated.Dst, translated.DstPort = be.Addr, be.Port
	flags := conntrack.DNAT
	var h conntrack.Handle
	var res conntrack.InsertResult
	id := uint32(fe.Port.ID)
	if service.NeedsMasquerade(fe, pk.Src, be) {
		src, ok := p.snatSource(be.Addr)
		if !ok {
			return Verdict{Action: Drop, Reason: packet.DropNoSNATPort}
		}
		translated.Src = src
		flags |= conntrack.SNAT
		h, translated, res = p.cfg.Conntrack.InsertSNAT(orig, translated, flags, id, p.cfg.SNATPorts, now)
	} else {
		h, res = p.cfg.Conntrack.Insert(orig, translated, flags, id, now)
	}
	switch res {
	case conntrack.Inserted:
	case conntrack.OrigExists:
		// Another worker tracked this flow a moment ago (its first
		// packets came in on two queues): use its translation.
		flow, dir, ok := p.cfg.Conntrack.Lookup(orig, now)
		if !ok {
			return Verdict{Action: Drop, Reason: packet.DropInvalidState}
		}
		return p.established(frame, flow.Handle, &flow.Rewrite, dir, now)
	default:
		return Verdict{Action: Drop, Reason: res.Reason()}
	}
	p.NewFlows++
	if len(p.NewReplies) < cap(p.NewReplies) {
		p.NewReplies = append(p.NewReplies, translated.Reverse())
		p.NewHandles = append(p.NewHandles, h)
	}
	if pre != nil && pre.quick && !p.cacheOff {
		// Cache the flow at once: the connection's next packets (the
		// handshake's, a request's) find it, and this one takes the
		// fast path too.
		if stamp, ok := p.cfg.Conntrack.Stamp(h); ok {
			sl := p.cache.put(&pre.key, pre.hash, h, stamp, &translated, conntrack.Original)
			if v, ok := p.fastV4(frame, sl, now, true); ok {
				return v
			}
		}
	}
	return p.established(frame, h, &translated, conntrack.Original, now)
}

func (p *Processor) snatSource(backend packet.Addr) (packet.Addr, bool) {
	if p.cfg.SNATSource == nil {
		return packet.Addr{}, false
	}
	return p.cfg.SNATSource(backend)
}

// reject answers a packet to a service without endpoints the way
// kube-proxy's REJECT rule does: TCP reset for TCP, ICMP port unreachable
// otherwise.
func (p *Processor) reject(frame []byte, now int64) Verdict {
	pk := &p.pkt
	if !p.takeRejectToken(now) {
		return Verdict{Action: Drop, Reason: packet.DropNoBackend}
	}
	client := pk.Src
	var n int
	var ok bool
	if pk.Proto == packet.ProtoTCP {
		n, ok = nat.BuildTCPReset(frame, pk)
	} else {
		code := uint8(packet.ICMPv4CodePortUnr)
		if pk.Family == 6 {
			code = 4 // ICMPv6 port unreachable
		}
		n, ok = nat.BuildICMPUnreachable(frame[:cap(frame)], len(frame), pk, code)
	}
	if !ok {
		return Verdict{Action: Drop, Reason: packet.DropNoBackend}
	}
	p.nextHop = client
	return Verdict{Action: Reply, Reason: packet.DropNoBackend, Len: n}
}

func (p *Processor) takeRejectToken(now int64) bool {
	if now-p.rejectRefill >= 1e9 || p.rejectRefill == 0 {
		p.rejectRefill = now
		p.rejectTokens = p.cfg.RejectsPerSecond
	}
	if p.rejectTokens == 0 {
		return false
	}
	p.rejectTokens--
	return true
}

// icmpError translates an ICMP error about a tracked flow: the quoted
// packet is one we sent, so its reverse is a tuple of the flow, and the
// error continues in that direction with the quote restored to what the
// receiver originally sent.
func (p *Processor) icmpError(frame []byte, now int64) Verdict {
	pk := &p.pkt
	quoted := pk.InnerTuple()
	flow, _, ok := p.cfg.Conntrack.Lookup(quoted.Reverse(), now)
	if !ok {
		return Verdict{Action: Pass, Reason: packet.PassNoService}
	}
	rw := flow.Rewrite
	outerSrc := pk.Src
	if pk.Src == quoted.Dst {
		// The far end itself reports the error: it must appear to come
		// from the address the receiver talked to.
		outerSrc = rw.Src
	}
	inner := rw.Reverse()
	if !nat.DecrementTTL(frame, pk) {
		return Verdict{Action: Drop, Reason: packet.DropTTLExceeded}
	}
	if !nat.TranslateICMPError(frame, pk, outerSrc, rw.Dst, inner.Src, inner.Dst, inner.SrcPort, inner.DstPort) {
		return Verdict{Action: Drop, Reason: packet.DropShortICMPQuote}
	}
	return p.forward(&rw.Dst, len(frame))
}

// laterFragment gives a fragment without L4 header the translation its
// first fragment got.
func (p *Processor) laterFragment(frame []byte, now int64) Verdict {
	pk := &p.pkt
	src, dst, ok := p.cfg.Conntrack.LookupFragment(conntrack.FragmentKeyOf(pk), now)
	if !ok {
		return Verdict{Action: Pass, Reason: packet.PassFragment}
	}
	if !nat.DecrementTTL(frame, pk) {
		return Verdict{Action: Drop, Reason: packet.DropTTLExceeded}
	}
	if !nat.Rewrite(frame, pk, packet.Tuple{Src: src, Dst: dst}) {
		return Verdict{Action: Drop, Reason: packet.DropInvalidState}
	}
	return p.forward(&dst, len(frame))
}

// rand is xorshift64*: a worker-local random source, one per Processor,
// so workers never contend on a shared generator.
func (p *Processor) rand() uint64 {
	x := p.rng
	x ^= x >> 12
	x ^= x << 25
	x ^= x >> 27
	p.rng = x
	return x * 2685821657736338717
}

// flowHash mixes a tuple into 64 bits for Maglev. It must be the same on
// every worker and across restarts, so that a flow keeps its backend.
func flowHash(t *packet.Tuple) uint64 {
	const m = 0x9e3779b97f4a7c15
	a := le64(t.Src[8:]) ^ bits.RotateLeft64(le64(t.Src[:8]), 17)
	b := le64(t.Dst[8:]) ^ bits.RotateLeft64(le64(t.Dst[:8]), 29)
	c := uint64(t.SrcPort)<<32 | uint64(t.DstPort)<<16 | uint64(t.Proto)
	h := (a ^ m) * 0xbf58476d1ce4e5b9
	h = (h ^ b ^ h>>31) * 0x94d049bb133111eb
	h = (h ^ c ^ h>>29) * m
	return h ^ h>>32
}

func le64(b []byte) uint64 {
	_ = b[7]
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}
