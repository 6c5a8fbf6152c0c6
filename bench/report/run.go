package report

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/xdproxy/xdproxy/bench/search"
)

// Path names; the limit is the sink's XDP_DROP on the node's receiving
// interface, fed straight by the generator.
const (
	PathLimit    = "xdp-drop-limit"
	PathKernel   = "kernel-no-rules"
	PathIPTables = "kernel-iptables"
	PathNFTables = "kernel-nftables"
	// PathXDProxy is the xdproxy binary in its default mode: workers
	// sleep in poll() when their rings are empty.
	PathXDProxy = "xdproxy"
	// PathBusyPoll is the binary with busyPoll: true (workers spin).
	PathBusyPoll = "xdproxy-busypoll"
	// PathIOFloor is the binary with benchmark.ioFloor: the same sockets
	// and worker loop forwarding every frame untranslated (MAC rewrite
	// only): the I/O cost under xdproxy's own.
	PathIOFloor = "xdproxy-io-floor"
	// The real kube-proxy binary against a real API server, in its two
	// modes: the truest baseline, measured at up to 1,000 services.
	PathKubeProxyIPTables = "kube-proxy-iptables"
	PathKubeProxyNFTables = "kube-proxy-nftables"
)

// Paths lists every path in the order reports show them.
var Paths = []string{PathLimit, PathKernel, PathIPTables, PathNFTables, PathKubeProxyIPTables, PathKubeProxyNFTables,
	PathIOFloor, PathXDProxy, PathBusyPoll}

// PathLabel is a path's name for a reader.
func PathLabel(path string) string {
	switch path {
	case PathLimit:
		return "XDP_DROP on n0 (receive limit)"
	case PathKernel:
		return "kernel, no rules"
	case PathIPTables:
		return "kube-proxy iptables rule shape"
	case PathNFTables:
		return "kube-proxy nftables rule shape"
	case PathKubeProxyIPTables:
		return "real kube-proxy, iptables mode"
	case PathKubeProxyNFTables:
		return "real kube-proxy, nftables mode"
	case PathXDProxy:
		return "xdproxy (poll mode)"
	case PathBusyPoll:
		return "xdproxy (busy poll)"
	case PathIOFloor:
		return "xdproxy I/O floor (no translation)"
	}
	return path
}

// IsKubeProxy says whether path runs the real kube-proxy.
func IsKubeProxy(path string) bool {
	return path == PathKubeProxyIPTables || path == PathKubeProxyNFTables
}

// Traffic patterns of the packet-rate tests.
const (
	// TrafficLong: a fixed set of flows (Packet.Flows), sent over and
	// over; a warm-up establishes them first.
	TrafficLong = "long"
	// TrafficNew: every packet opens a new flow (Packet.Flows is the size
	// of the flow space the sender walks through without repeating).
	TrafficNew = "new"
)

// TrafficLabel names a traffic pattern for a reader.
func TrafficLabel(traffic string, flows int) string {
	if traffic == TrafficNew {
		return "new flow per packet"
	}
	return fmt.Sprintf("%d long flows", flows)
}

// Packet is the result of one packet-rate variant.
type Packet struct {
	// Feed is how frames reached the node (bench/feed: "nic" or "pod").
	Feed     string `json:"feed"`
	Path     string `json:"path"`
	Services int    `json:"services"`
	// Traffic is TrafficLong or TrafficNew; Flows the number of long
	// flows, or the flow space of TrafficNew.
	Traffic string `json:"traffic"`
	Flows   int    `json:"flows"`
	// ZeroLoss is the RFC 2544 zero-loss (<= tolerance) throughput in
	// pps; AtGenLimit says the generator's ceiling was reached without
	// loss, so the path's own limit is higher.
	ZeroLoss   float64 `json:"zeroLossPps"`
	AtGenLimit bool    `json:"atGeneratorLimit"`
	// CostNs is the median forwarding cost per delivered packet, from the
	// run time of the threads that do the forwarding (NAPI kthreads
	// pinned to the forwarding CPU, xdproxy's process); CPUNs is the same
	// from /proc/stat busy time of the forwarding CPU (includes anything
	// else that ran there). CostRate is the offered rate of those runs.
	CostNs   float64   `json:"costNsPerPacket"`
	CostRuns []float64 `json:"costRunsNs"`
	CPUNs    float64   `json:"cpuNsPerPacket"`
	CostRate float64   `json:"costRatePps"`
	CostLoss float64   `json:"costRunLoss"`
	// FeedLoss is the median share of the cost runs' frames that never
	// reached the node's receiving interface (lost in the generator's
	// namespace, not by the path under test), -1 when unknown.
	FeedLoss float64 `json:"feedLoss"`
	// OtherWork is the median share of the cost runs during which other
	// work (not the path's threads) kept the forwarding CPU busy: on a
	// shared machine, the measure of how disturbed the figures are.
	OtherWork float64 `json:"otherWork"`
	// Setup is the time to program the path (rules loaded, or xdproxy
	// started and its table published).
	Setup time.Duration  `json:"setupNs"`
	Curve []search.Point `json:"curve"`
	Note  string         `json:"note,omitempty"`
}

// Label names the row's traffic for a reader.
func (p Packet) Label() string { return TrafficLabel(p.Traffic, p.Flows) }

// Capacity is the packet rate one forwarding core could carry at the
// measured cost (1/cost), 0 when no cost was measured.
func (p Packet) Capacity() float64 {
	if p.CostNs <= 0 {
		return 0
	}
	return 1e9 / p.CostNs
}

// TCP is the result of one connection-rate variant.
type TCP struct {
	Path        string        `json:"path"`
	Services    int           `json:"services"`
	Concurrency int           `json:"concurrency"`
	CPS         float64       `json:"cps"`
	Connections uint64        `json:"connections"`
	Errors      uint64        `json:"errors"`
	P50         time.Duration `json:"p50Ns"`
	P90         time.Duration `json:"p90Ns"`
	P99         time.Duration `json:"p99Ns"`
	// CostUs is the forwarding cost per connection (microseconds of the
	// forwarding threads per completed connection).
	CostUs    float64  `json:"costUsPerConnection"`
	Histogram []uint64 `json:"histogram"`
	Bucket    time.Duration
	Note      string `json:"note,omitempty"`
	// RoundsCPS holds the connections per second of every round that
	// completed, in the order they ran; Errors counts all of theirs; the
	// rest of the result is the median round's.
	RoundsCPS []float64 `json:"roundsCps,omitempty"`
}

// MedianTCP returns the round with the median connections per second
// (the lower of the middle two for an even count), with every round's
// rate in RoundsCPS and the errors of all rounds: a round with many
// errors is usually a slow one, which the median would otherwise hide.
// rounds must not be empty.
func MedianTCP(rounds []TCP) TCP {
	sorted := slices.Clone(rounds)
	slices.SortStableFunc(sorted, func(a, b TCP) int { return cmp.Compare(a.CPS, b.CPS) })
	m := sorted[(len(sorted)-1)/2]
	m.RoundsCPS, m.Errors = nil, 0
	for _, t := range rounds {
		m.RoundsCPS = append(m.RoundsCPS, t.CPS)
		m.Errors += t.Errors
	}
	return m
}

// Generator is a measured ceiling of the traffic generator.
type Generator struct {
	Feed string  `json:"feed"`
	Mode string  `json:"mode"`
	Pps  float64 `json:"pps"`
	Into string  `json:"into"`
}

// Run is everything one benchmark run measured.
type Run struct {
	Started  time.Time     `json:"started"`
	Duration time.Duration `json:"durationNs"`
	Command  string        `json:"command"`
	Quick    bool          `json:"quick"`
	// Machine.
	Kernel    string  `json:"kernel"`
	CPUs      int     `json:"cpus"`
	LoadAvg   string  `json:"loadAvg"`
	IPTables  string  `json:"iptablesVersion"`
	NFT       string  `json:"nftVersion"`
	GenCPU    int     `json:"genCpu"`
	FwdCPU    int     `json:"forwardCpu"`
	FrameSize int     `json:"frameSize"`
	Trial     string  `json:"trial"`
	Tolerance float64 `json:"lossTolerance"`
	XDProxy   string  `json:"xdproxyRunner"`
	Clients   string  `json:"clients"`
	// Feeds describe the feeds the packet rows used, by name.
	Feeds []Feed `json:"feeds"`
	// TCPFeed says how the TCP test's traffic reaches the node.
	TCPFeed string `json:"tcpFeed,omitempty"`
	// TCPRounds is how many rounds of the TCP test each path ran.
	TCPRounds int `json:"tcpRounds,omitempty"`
	// Scheduling says which priorities the benchmark's threads ran at.
	Scheduling string `json:"scheduling,omitempty"`
	// KubeProxy describes the real kube-proxy paths (empty when none ran).
	KubeProxy string `json:"kubeProxy,omitempty"`

	Generators []Generator `json:"generators"`
	Packet     []Packet    `json:"packet"`
	TCP        []TCP       `json:"tcp"`
	// Profiles are CPU profiles of the xdproxy binary taken under
	// traffic.
	Profiles []Profile `json:"profiles,omitempty"`
	Notes    []string  `json:"notes,omitempty"`
}

// Feed names a feed and says what it is and which CPU does what.
type Feed struct {
	Name        string `json:"name"`
	Description string `json:"description"`
}

// Profile is a CPU profile of the running xdproxy binary (its admin
// socket's /debug/pprof/profile), taken while a trial ran.
type Profile struct {
	// File is the profile's name in the results directory.
	File string `json:"file"`
	// Of says what ran: feed, path, services, traffic and rate.
	Of string `json:"of"`
	// Top is "go tool pprof -top" of it.
	Top string `json:"top,omitempty"`
}

// Find returns the packet result for feed, path, services and traffic.
func (r *Run) Find(feed, path string, services int, traffic string) (Packet, bool) {
	for _, p := range r.Packet {
		if p.Feed == feed && p.Path == path && p.Services == services && p.Traffic == traffic {
			return p, true
		}
	}
	return Packet{}, false
}

// FeedNames are the feeds of the packet rows, in the order of r.Feeds
// (then of the rows).
func (r *Run) FeedNames() []string {
	var out []string
	add := func(f string) {
		for _, o := range out {
			if o == f {
				return
			}
		}
		out = append(out, f)
	}
	for _, f := range r.Feeds {
		add(f.Name)
	}
	for _, p := range r.Packet {
		add(p.Feed)
	}
	return out
}

// FindTCP returns the TCP result for path and services.
func (r *Run) FindTCP(path string, services int) (TCP, bool) {
	for _, t := range r.TCP {
		if t.Path == path && t.Services == services {
			return t, true
		}
	}
	return TCP{}, false
}
