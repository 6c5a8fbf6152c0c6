package conntrack

import (
	"fmt"

	"github.com/xdproxy/xdproxy/nat/packet"
)

// PortRange is an inclusive range of SNAT source ports (or ICMP echo ids).
type PortRange struct{ First, Last uint16 }

// DefaultSNATPorts is Linux's default ip_local_port_range.
var DefaultSNATPorts = PortRange{First: 32768, Last: 60999}

// Size is the number of ports in r.
func (r PortRange) Size() int { return int(r.Last) - int(r.First) + 1 }

// Validate reports a range that is empty or includes port 0.
func (r PortRange) Validate() error {
	if r.First == 0 || r.First > r.Last {
		return fmt.Errorf("conntrack: bad SNAT port range %d-%d", r.First, r.Last)
	}
	return nil
}

const (
	snatFirstRound = 128 // ports tried from the first start, like netfilter
	snatLastRound  = 16
)

// InsertSNAT inserts a flow whose source is translated to translated.Src and
// a port from ports that it picks so that the reply tuple (backend ->
// SNAT address:port) is unique, which is what lets the reply find its flow.
// For ICMP echo the port is the echo identifier and both ports of the
// translated tuple get it. It returns the translated tuple it inserted.
//
// Ports are probed in order from a start derived from the hash of orig, so a
// retransmitted first packet tries the same port first. Uniqueness rests on
// Insert, which refuses a reply tuple that any flow already holds, so two
// workers picking the same port at once cannot both succeed. Like
// netfilter's nf_nat_l4proto_unique_tuple, it tries up to 128 ports, then
// rounds of 64, 32 and 16 from fresh starts, and gives up with NoSNATPort:
// a nearly full range may therefore fail while a few ports are still free.
func (t *Table) InsertSNAT(orig, translated packet.Tuple, flags Flags, serviceID uint32, ports PortRange, now int64) (Handle, packet.Tuple, InsertResult) {
	n := ports.Size()
	if ports.Validate() != nil {
		t.snatFails.Add(1)
		return Handle{}, translated, NoSNATPort
	}
	ko := packKey(&orig)
	off := hashKey(&ko, &t.seed)
	icmp := orig.Proto == packet.ProtoICMP || orig.Proto == packet.ProtoICMPv6
	tried := 0
	for round := min(n, snatFirstRound); round >= snatLastRound || round == n; round /= 2 {
		for i := range round {
			port := ports.First + uint16((off+uint64(i))%uint64(n))
			translated.SrcPort = port
			if icmp {
				translated.DstPort = port
			}
			tried++
			// A lock-free look first keeps a crowded range from taking
			// shard locks for ports that are visibly taken.
			if f, d, taken := t.Lookup(translated.Reverse(), now); taken {
				if d == Reply && f.Rewrite == orig.Reverse() {
					// The flow itself, inserted before: say so
					// rather than give it a second port.
					t.snatTries.Add(uint64(tried - 1))
					return Handle{}, translated, OrigExists
				}
				continue
			}
			h, res := t.Insert(orig, translated, flags|SNAT, serviceID, now)
			if res != ReplyExists {
				t.snatTries.Add(uint64(tried - 1))
				return h, translated, res
			}
		}
		if round == n {
			break // every port was tried
		}
		off = off*0x9e3779b97f4a7c15 + 0x632be59bd9b4e019
	}
	t.snatTries.Add(uint64(tried - 1))
	t.snatFails.Add(1)
	return Handle{}, translated, NoSNATPort
}
