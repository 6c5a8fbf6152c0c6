package socklb

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// readState reads adopted tables back into a state. A set that is not
// whole (a crash halfway through a write cannot leave one, but the tables
// are only as good as the process that wrote them) gets a content no
// SetFrontends input has, so the next SetFrontends gives its frontends a
// new set; entries no set accounts for become orphans, which the next
// SetFrontends deletes.
func readState(frontends, backends, members *ebpf.Map) (*state, error) {
	s := newState()
	var fk bpfFrontendKey
	var fv bpfFrontend
	it := frontends.Iterate()
	for it.Next(&fk, &fv) {
		s.frontends[fk] = fv
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("frontends: %w", err)
	}

	counts := map[uint32]uint32{}
	broken := map[uint32]bool{}
	for _, e := range s.frontends {
		if e.Count == 0 {
			continue
		}
		if c, ok := counts[e.Set]; ok && c != e.Count {
			broken[e.Set] = true
			e.Count = max(c, e.Count)
		}
		counts[e.Set] = e.Count
	}
	for id, n := range counts {
		set := &backendSet{id: id}
		for i := range n {
			var ep bpfEndpoint
			if err := backends.Lookup(bpfBackendKey{Set: id, Index: i}, &ep); err != nil {
				if !errors.Is(err, ebpf.ErrKeyNotExist) {
					return nil, fmt.Errorf("backends: %w", err)
				}
				broken[id] = true
				continue
			}
			var idx uint32
			if err := members.Lookup(bpfMemberKey{Set: id, Ep: ep}, &idx); err != nil {
				if !errors.Is(err, ebpf.ErrKeyNotExist) {
					return nil, fmt.Errorf("members: %w", err)
				}
				broken[id] = true
			}
			set.backends = append(set.backends, ep)
		}
		set.content = setContent(set.backends)
		if broken[id] {
			set.content = fmt.Sprintf("broken set %d", id)
		}
		s.sets[id] = set
		s.byContent[set.content] = set
		s.entries += len(set.backends)
		s.nextSet = max(s.nextSet, id+1)
	}
	for _, e := range s.frontends {
		s.ref(e)
	}
	if s.nextSet == 0 {
		s.nextSet = 1
	}

	var bk bpfBackendKey
	var bv bpfEndpoint
	bit := backends.Iterate()
	for bit.Next(&bk, &bv) {
		if set := s.sets[bk.Set]; set == nil || int(bk.Index) >= len(set.backends) {
			s.orphanBackends = append(s.orphanBackends, bk)
		}
	}
	if err := bit.Err(); err != nil {
		return nil, fmt.Errorf("backends: %w", err)
	}
	var mk bpfMemberKey
	var mv uint32
	mit := members.Iterate()
	for mit.Next(&mk, &mv) {
		if set := s.sets[mk.Set]; set == nil || !containsEndpoint(set.backends, mk.Ep) {
			s.orphanMembers = append(s.orphanMembers, mk)
		}
	}
	if err := mit.Err(); err != nil {
		return nil, fmt.Errorf("members: %w", err)
	}
	return s, nil
}

func containsEndpoint(eps []bpfEndpoint, e bpfEndpoint) bool {
	for _, x := range eps {
		if x == e {
			return true
		}
	}
	return false
}
