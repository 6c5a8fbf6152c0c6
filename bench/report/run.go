package report

import (
	"time"

	"github.com/xdproxy/xdproxy/bench/search"
)

// Path names; the limit is the sink's XDP_DROP with the generator straight
// into it.
const (
	PathLimit    = "xdp-drop-limit"
	PathKernel   = "kernel-no-rules"
	PathIPTables = "kernel-iptables"
	PathNFTables = "kernel-nftables"
	PathXDProxy  = "xdproxy"
	// The real kube-proxy binary against a real API server, in its two
	// modes: the truest baseline, measured at up to 1,000 services.
	PathKubeProxyIPTables = "kube-proxy-iptables"
	PathKubeProxyNFTables = "kube-proxy-nftables"
)

// IsKubeProxy says whether path runs the real kube-proxy.
func IsKubeProxy(path string) bool {
	return path == PathKubeProxyIPTables || path == PathKubeProxyNFTables
}

// Packet is the result of one packet-rate variant.
type Packet struct {
	Path     string `json:"path"`
	Services int    `json:"services"`
	Flows    int    `json:"flows"`
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
	// Setup is the time to program the path (rules loaded, or xdproxy
	// started and its table published).
	Setup time.Duration  `json:"setupNs"`
	Curve []search.Point `json:"curve"`
	Note  string         `json:"note,omitempty"`
}

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
}

// Generator is a measured ceiling of the traffic generator.
type Generator struct {
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
	// KubeProxy describes the real kube-proxy paths (empty when none ran).
	KubeProxy string `json:"kubeProxy,omitempty"`

	Generators []Generator `json:"generators"`
	Packet     []Packet    `json:"packet"`
	TCP        []TCP       `json:"tcp"`
	// Profile is the file name (in the results directory) of a CPU
	// profile of xdproxy, with ProfileTop its hottest functions.
	Profile    string   `json:"profile,omitempty"`
	ProfileTop string   `json:"profileTop,omitempty"`
	Notes      []string `json:"notes,omitempty"`
}

// Find returns the packet result for path, services and flows.
func (r *Run) Find(path string, services, flows int) (Packet, bool) {
	for _, p := range r.Packet {
		if p.Path == path && p.Services == services && p.Flows == flows {
			return p, true
		}
	}
	return Packet{}, false
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
