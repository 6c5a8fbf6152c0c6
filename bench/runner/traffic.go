package runner

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/xdproxy/xdproxy/bench/pktgen"
	"github.com/xdproxy/xdproxy/bench/report"
)

// Traffic is one traffic pattern of the packet-rate tests.
type Traffic struct {
	// New makes every packet open a new flow: the generator walks through
	// NewFlowSpace flows without repeating one, continuing across trials.
	New bool
	// Flows is the number of long flows (sent over and over, established
	// by a warm-up); NewFlowSpace when New.
	Flows int
}

// NewFlowSpace is the flow space of the new-flow traffic: every source
// port of NewFlowSources consecutive source addresses from
// topo.FlowSource, all inside the pod CIDR (so no path masquerades). At
// 200 kpps it lasts over a minute, longer than one variant's trials.
const (
	NewFlowSources = 200
	NewFlowSpace   = NewFlowSources * pktgen.SourcePorts
)

// Name is report.TrafficLong or report.TrafficNew.
func (t Traffic) Name() string {
	if t.New {
		return report.TrafficNew
	}
	return report.TrafficLong
}

func (t Traffic) String() string { return report.TrafficLabel(t.Name(), t.Flows) }

// ParseTraffic reads a comma-separated list of traffic patterns: a number
// of long flows, or "new" for a new flow per packet ("1000,new").
func ParseTraffic(s string) ([]Traffic, error) {
	var out []Traffic
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "new" {
			out = append(out, Traffic{New: true, Flows: NewFlowSpace})
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > NewFlowSpace {
			return nil, fmt.Errorf("traffic %q: want a number of long flows (1-%d) or new", f, NewFlowSpace)
		}
		out = append(out, Traffic{Flows: n})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no traffic in %q", s)
	}
	return out, nil
}
