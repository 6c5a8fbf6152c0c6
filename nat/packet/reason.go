package packet

// Reason says why a frame is not forwarded as it is: it is the verdict of
// parsing, and the dataplane reuses it for the verdicts of later stages, so
// that every frame that is not forwarded is counted under exactly one name.
type Reason uint8

// Reasons. OK means the frame parsed as a packet xdproxy may translate.
// Pass* reasons are frames that belong to the kernel; Drop* reasons are
// frames that no one should receive as they are.
const (
	OK Reason = iota

	PassNotIP         // not IPv4 or IPv6 (ARP, LLDP, ...)
	PassOtherProto    // IP, but not TCP, UDP, ICMP or ICMPv6
	PassICMPOther     // ICMP that is neither echo nor an error xdproxy translates
	PassIPv6ExtHeader // IPv6 with extension headers other than fragment
	PassNoService     // no frontend, backend or SNAT port matches
	PassFragment      // a fragment whose first fragment was not seen

	DropShortEthernet // shorter than an Ethernet header
	DropShortVLAN     // VLAN tag cut off
	DropDoubleVLAN    // more than one VLAN tag
	DropShortIP       // shorter than the fixed IP header
	DropBadIPVersion  // version nibble does not match the EtherType
	DropBadIPHeaderLen
	DropBadIPTotalLen // total length beyond the frame or below the header
	DropShortL4       // L4 header cut off
	DropBadTCPOffset  // TCP data offset below 5 or beyond the packet
	DropBadUDPLength
	DropShortICMPQuote // ICMP error too short to hold the quoted header
	DropBadChecksum    // an L4 checksum that is neither valid nor partial
	DropNoBackend      // service has no usable endpoint and no reply is due
	DropSourceRange    // source outside loadBalancerSourceRanges
	DropConntrackFull  // connection table full and nothing could be evicted
	DropNoSNATPort     // SNAT port range exhausted
	DropTTLExceeded    // TTL or hop limit would reach zero
	DropInvalidState   // packet does not fit the tracked connection
	DropNoRoute        // no route to the translated destination
	DropNeighbor       // next hop not resolved yet and no kernel path to hold the frame (resolution triggered)
	DropTxFull         // egress ring full
	DropTooBig         // translated frame does not fit the egress frame
	DropFlowTableFull  // the XDP program's flow table refused the flow's reply tuple
	DropNoKernelPath   // a frame for the kernel, but no exception link to hand it over
	DropOutOfWindow    // a TCP RST or FIN outside the receiver's window

	NumReasons
)

var reasonNames = [NumReasons]string{
	OK:                 "ok",
	PassNotIP:          "pass_not_ip",
	PassOtherProto:     "pass_other_proto",
	PassICMPOther:      "pass_icmp_other",
	PassIPv6ExtHeader:  "pass_ipv6_ext_header",
	PassNoService:      "pass_no_service",
	PassFragment:       "pass_fragment",
	DropShortEthernet:  "drop_short_ethernet",
	DropShortVLAN:      "drop_short_vlan",
	DropDoubleVLAN:     "drop_double_vlan",
	DropShortIP:        "drop_short_ip",
	DropBadIPVersion:   "drop_bad_ip_version",
	DropBadIPHeaderLen: "drop_bad_ip_header_len",
	DropBadIPTotalLen:  "drop_bad_ip_total_len",
	DropShortL4:        "drop_short_l4",
	DropBadTCPOffset:   "drop_bad_tcp_offset",
	DropBadUDPLength:   "drop_bad_udp_length",
	DropShortICMPQuote: "drop_short_icmp_quote",
	DropBadChecksum:    "drop_bad_checksum",
	DropNoBackend:      "drop_no_backend",
	DropSourceRange:    "drop_source_range",
	DropConntrackFull:  "drop_conntrack_full",
	DropNoSNATPort:     "drop_no_snat_port",
	DropTTLExceeded:    "drop_ttl_exceeded",
	DropInvalidState:   "drop_invalid_state",
	DropNoRoute:        "drop_no_route",
	DropNeighbor:       "drop_neighbor_unresolved",
	DropTxFull:         "drop_tx_full",
	DropTooBig:         "drop_too_big",
	DropFlowTableFull:  "drop_flow_table_full",
	DropNoKernelPath:   "drop_no_kernel_path",
	DropOutOfWindow:    "drop_out_of_window",
}

func (r Reason) String() string {
	if r < NumReasons {
		return reasonNames[r]
	}
	return "unknown"
}

// IsPass reports whether r hands the frame to the kernel.
func (r Reason) IsPass() bool { return r >= PassNotIP && r <= PassFragment }
