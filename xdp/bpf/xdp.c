/*
 * xdproxy_xdp: the XDP program in front of xdproxy's AF_XDP sockets.
 *
 * For every frame an interface receives it decides whether xdproxy owns it.
 * Owned frames are redirected into the AF_XDP socket of the receive queue
 * they arrived on; everything else (ARP, the node's own connections on any
 * port, pod traffic that is no service's, ICMP about any of those) goes on
 * into the kernel untouched. Taking a frame that is not ours would break
 * someone's connection, so ownership is exact: a frontend, or the exact
 * tuple of a reply xdproxy waits for. The program never rewrites.
 *
 * Maps. All but xsks are shared by the programs of every interface; the Go
 * loader sets every max_entries before loading.
 *   xsks       XSKMAP, rx queue index -> AF_XDP socket. One per interface,
 *              because every interface has its own queue 0.
 *   frontends  HASH, svc_key (dst addr, dst port, proto) of every frontend:
 *              cluster IPs, external and load-balancer IPs, NodePorts.
 *   flows      HASH, flow_key (src, dst, src port, dst port, proto) of
 *              every reply xdproxy expects, exactly as it arrives: the
 *              workers add the reply tuple of each connection they open,
 *              DNAT-only and masqueraded alike, before its first packet
 *              leaves, and remove it when the connection ends. A plain
 *              hash, not an LRU: the kernel never evicts a live flow's
 *              entry behind xdproxy's back; it is sized above the
 *              connection table, so it cannot fill while conntrack has room.
 *   reply_slots ARRAY, mmapable: the same reply tuples as flows, written
 *              by the workers straight into the map's memory with no
 *              system call (a hash map update costs the writer a syscall
 *              and the kernel hundreds of nanoseconds per entry). A
 *              set-associative table, REPLY_WAYS tuples per set; a tuple
 *              whose set is full goes into flows instead. Element 0 is
 *              the header: magic, the hash seed, the set mask.
 *   frags      LRU_HASH, frag_key (src, dst, IP id, proto) of the first
 *              fragment of every datagram this program redirected, so that
 *              its later fragments (no ports to match) follow it. Written
 *              here; entries age out by LRU.
 *   addrs      HASH, addr -> ADDR_* flags. ADDR_VIP: an address only
 *              services use (a cluster IP, never a node address), so a later
 *              fragment to it is ours even when its head was not seen.
 *   counters   PERCPU_ARRAY, one u64 per CNT_* below.
 *
 * Addresses are 16 bytes with IPv4 IPv4-mapped (::ffff:a.b.c.d), as in
 * nat/packet.Addr; ports are in network byte order. For ICMP echo the
 * identifier stands for both ports, because that is what NAT rewrites.
 *
 * Decision order; the first that applies decides:
 *   1. not IPv4/IPv6 after at most one VLAN tag         -> pass
 *   2. headers cut short or malformed                   -> pass (parse_failed)
 *   3. non-first fragment: (src, dst, id, proto) in frags,
 *      or dst flagged ADDR_VIP                          -> redirect
 *   4. ICMP error (v4 3/11/12, v6 1-4) about a packet xdproxy sent: the
 *      quoted packet reversed is a reply xdproxy waits for (xdproxy
 *      sent it toward a backend or from a SNAT port), or its source is a
 *      frontend (a reply xdproxy sent to a client)      -> redirect
 *   5. (dst, dst port, proto) in frontends              -> redirect
 *   6. (src, dst, src port, dst port, proto) in reply_slots or flows
 *                                                       -> redirect
 *   7. anything else                                    -> pass
 * A first fragment that rule 5 or 6 redirects is remembered in frags.
 * "redirect" is bpf_redirect_map(&xsks, rx queue, XDP_DROP): a frame that
 * is ours but finds no socket on its queue (xdproxy restarting) is dropped
 * and counted no_socket. Passing it would let the kernel, which has no
 * rules for it, answer with a reset and end the connection; dropping it
 * lets TCP retransmit once the socket is back.
 */
#include "bpf_defs.h"

#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8

#define IPPROTO_ICMP 1
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define IPPROTO_FRAGMENT 44
#define IPPROTO_ICMPV6 58

/* ---- Map layouts; the Go side (tables.go, the generated bpf_*.go) mirrors them. ---- */

struct svc_key {
	__u8 addr[16];
	__be16 port;
	__u8 proto;
	__u8 pad; /* always zero: hash keys compare every byte */
};

struct addr_key {
	__u8 addr[16];
};

/* One direction of a flow, exactly; for ICMP echo both ports are the id. */
struct flow_key {
	__u8 src[16];
	__u8 dst[16];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3]; /* always zero */
};

/* One set of reply_slots: REPLY_WAYS tuples, each with a word of its
 * state and tag (state | tag << 2) in the set's first cache line, so that
 * a frame that is not a reply (the node's own traffic) costs one line,
 * and a reply one more. Writers (Go, replyslots.go) claim an empty way
 * with a compare-and-swap to REPLY_BUSY, write the key, then store the
 * tag with REPLY_LIVE; a removal stores REPLY_EMPTY. A reader reads the
 * tag, the key, then the tag again; one that still meets a way emptied and
 * taken again in between may match a torn key: the frame then reaches a
 * worker that does not know its flow and hands it to the kernel, as it
 * does any frame that is not ours. In element 0, tag[0] is
 * REPLY_MAGIC, tag[1] the seed of the set hash and tag[2] the number of
 * sets less one (a power of two less one); set s is element 1 + s. */
struct reply_set {
	__u64 tag[4];
	__u64 key[4][5]; /* struct flow_key */
};

#define REPLY_WAYS 4
#define REPLY_EMPTY 0
#define REPLY_BUSY 1
#define REPLY_LIVE 2
#define REPLY_MAGIC 0x32594c5052445858ULL /* "XXDRPLY2" little-endian */
#define REPLY_TAG_SALT 0x9e3779b9u

/* A datagram's fragments: what a later fragment (no ports) has in common
 * with its first. The IPv4 id is 16 bits, IPv6's 32. */
struct frag_key {
	__u8 src[16];
	__u8 dst[16];
	__u32 id;
	__u8 proto;
	__u8 pad[3]; /* always zero */
};

enum addr_flag {
	ADDR_VIP = 2, /* 1 and 4 were the node and backend flags of old layouts */
};

/* Every frame lands in exactly one of the first four counters; the MATCH_
 * counters say which rule claimed the frames counted redirected or
 * no_socket. FRAG_TRACK_FAILED counts first fragments whose datagram could
 * not be remembered (their later fragments then reach the kernel). */
enum counter {
	CNT_REDIRECTED,
	CNT_PASSED,
	CNT_NO_SOCKET,
	CNT_PARSE_FAILED,
	CNT_MATCH_FRONTEND,
	CNT_MATCH_FLOW,
	CNT_MATCH_FRAGMENT,
	CNT_MATCH_ICMP_ERROR,
	CNT_FRAG_TRACK_FAILED,
	CNT_SYN_GUARD_DROPPED, /* first SYNs dropped while the SYN guard is on */
	CNT_EGRESS_SEEN,       /* packets the egress program looked at */
	CNT_EGRESS_REDIRECTED, /* ... and sent back to xdproxy */
	CNT_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct svc_key);
	__type(value, __u8);
} frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct flow_key);
	__type(value, __u8);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct reply_set);
} reply_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__type(key, struct frag_key);
	__type(value, __u8);
} frags SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct addr_key);
	__type(value, __u32);
} addrs SEC(".maps");

/* The SYN guard, on while a flood of new connections overruns the
 * connection table: the first SYN of every new (src, dst, ports) to a
 * frontend is dropped and remembered, and a retransmission of it, at least
 * min_retry and at most window ticks after the SYN before, is let in. A client's TCP
 * retransmits its SYN after a second; a flood of spoofed SYNs, each tuple
 * sent once, never gets past XDP and never loads the workers. A tick is
 * 2^24 ns (about 16.8 ms): SYN_TICK_SHIFT. */
struct syn_guard {
	__u32 on;
	__u32 min_retry; /* ticks */
	__u32 window;	 /* ticks, below SYN_TIME_MASK */
	__u32 seed;	 /* keys the slot hash: a flood cannot aim at a slot */
	__u32 set_mask;	 /* syn_seen's size less one (a power of two) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct syn_guard);
} syn_guard SEC(".maps");

/* syn_seen remembers first SYNs in an 8-way set-associative table: each
 * 32-bit entry holds a 20-bit tag of the tuple (never 0: 0 is an empty
 * way) and, in its low 12 bits, when its SYN came, in ticks modulo 4096
 * (68.7 s); a new tuple takes its set's oldest entry. A flood writes
 * entries at its rate, so the table is large (Go sizes it) and
 * associative: a client's entry must outlive the flood's next writes to
 * its set until the client retransmits, and eight small ways outlive
 * them far longer than four large ones in the same memory. A tag matches
 * another tuple's once in 2^19 per way: at 1 Mpps about 15 spoofed SYNs a
 * second get in. An LRU hash would be emptied by the flood in a fraction
 * of a second. */
#define SYN_WAYS 8
#define SYN_TICK_SHIFT 24
#define SYN_TIME_BITS 12
#define SYN_TIME_MASK ((1u << SYN_TIME_BITS) - 1)
struct syn_set {
	__u32 way[SYN_WAYS];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct syn_set);
} syn_seen SEC(".maps");

/* Where the egress program sends the replies it catches: the ifindex of
 * the exception link's kernel end, whose peer is xdproxy's. */
struct egress_config {
	__u32 redirect_ifindex;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct egress_config);
} egress_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, enum counter);
	__type(value, __u64);
} counters SEC(".maps");

/* ---- Wire headers, only the fields we read. ---- */

struct ethhdr {
	__u8 dst[6];
	__u8 src[6];
	__be16 proto;
};

struct vlanhdr {
	__be16 tci;
	__be16 proto;
};

struct iphdr {
	__u8 ver_ihl;
	__u8 tos;
	__be16 tot_len;
	__be16 id;
	__be16 frag_off; /* flags (3 bits) and offset in 8-byte units */
	__u8 ttl;
	__u8 protocol;
	__be16 check;
	__u8 saddr[4];
	__u8 daddr[4];
};

struct ipv6hdr {
	__u8 ver_tc;
	__u8 tc_flow[3];
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	__u8 saddr[16];
	__u8 daddr[16];
};

struct frag6hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off; /* offset in 8-byte units << 3, and the M flag */
	__be32 id;
};

struct ports {
	__be16 src;
	__be16 dst;
};

struct icmphdr {
	__u8 type;
	__u8 code;
	__be16 check;
	__be16 id; /* echo only */
	__be16 seq;
};

#define TCP_MIN_LEN 20
#define UDP_LEN 8

/* ---- Parsing ---- */

/* One direction of a flow: src and dst are ready-made lookup keys. */
struct flow {
	struct svc_key src;
	struct svc_key dst;
	__u8 echo_request; /* ICMP echo request: never a reply */
};

enum ip_result {
	IP_OK,
	IP_BAD,		 /* cut short or malformed */
	IP_LATER_FRAGMENT, /* no L4 header in this frame */
};

struct ip_info {
	__u8 proto;	 /* L4 protocol */
	__u8 fragmented; /* any fragment, first or later */
	__u8 family;	 /* 4 or 6 */
	__u32 frag_id;	 /* the IP identification, when fragmented */
};

static __always_inline void set_v4_mapped(__u8 *dst, const __u8 *v4)
{
	/* Bytes 0-9 are already zero: flows start zeroed. */
	dst[10] = 0xff;
	dst[11] = 0xff;
	dst[12] = v4[0];
	dst[13] = v4[1];
	dst[14] = v4[2];
	dst[15] = v4[3];
}

/* parse_ipv4 reads the IPv4 header at *pos, honouring IHL, and moves *pos
 * to the L4 header. */
static __always_inline int parse_ipv4(void **pos, void *end, struct flow *f,
				      struct ip_info *ip)
{
	struct iphdr *h = *pos;

	if ((void *)(h + 1) > end)
		return IP_BAD;
	if ((h->ver_ihl >> 4) != 4)
		return IP_BAD;
	__u32 hlen = (h->ver_ihl & 0x0f) * 4;
	if (hlen < sizeof(*h))
		return IP_BAD;
	if (*pos + hlen > end)
		return IP_BAD;

	set_v4_mapped(f->src.addr, h->saddr);
	set_v4_mapped(f->dst.addr, h->daddr);
	ip->proto = h->protocol;
	ip->family = 4;

	__u16 frag = bpf_ntohs(h->frag_off);
	ip->fragmented = (frag & 0x3fff) != 0; /* MF flag or an offset */
	ip->frag_id = bpf_ntohs(h->id);
	*pos += hlen;
	if (frag & 0x1fff)
		return IP_LATER_FRAGMENT;
	return IP_OK;
}

/* parse_ipv6 reads the fixed IPv6 header and, if allow_frag, a fragment
 * header after it, and moves *pos to the L4 header. Other extension headers
 * leave their number in ip->proto, which no rule matches: such frames pass,
 * as xdproxy's own parser would pass them. */
static __always_inline int parse_ipv6(void **pos, void *end, struct flow *f,
				      struct ip_info *ip, int allow_frag)
{
	struct ipv6hdr *h = *pos;

	if ((void *)(h + 1) > end)
		return IP_BAD;
	if ((h->ver_tc >> 4) != 6)
		return IP_BAD;

	__builtin_memcpy(f->src.addr, h->saddr, 16);
	__builtin_memcpy(f->dst.addr, h->daddr, 16);
	ip->proto = h->nexthdr;
	ip->family = 6;
	*pos = h + 1;

	if (!allow_frag || ip->proto != IPPROTO_FRAGMENT)
		return IP_OK;

	struct frag6hdr *fh = *pos;
	if ((void *)(fh + 1) > end)
		return IP_BAD;
	ip->proto = fh->nexthdr;
	ip->fragmented = 1;
	ip->frag_id = fh->id;
	*pos = fh + 1;
	if (bpf_ntohs(fh->frag_off) & 0xfff8)
		return IP_LATER_FRAGMENT;
	return IP_OK;
}

static __always_inline int is_icmp(const struct ip_info *ip)
{
	return (ip->family == 4 && ip->proto == IPPROTO_ICMP) ||
	       (ip->family == 6 && ip->proto == IPPROTO_ICMPV6);
}

static __always_inline int is_echo_request(const struct ip_info *ip, __u8 type)
{
	return type == (ip->family == 4 ? 8 : 128);
}

static __always_inline int is_echo(const struct ip_info *ip, __u8 type)
{
	return is_echo_request(ip, type) || type == (ip->family == 4 ? 0 : 129);
}

static __always_inline int is_error(const struct ip_info *ip, __u8 type)
{
	if (ip->family == 4)
		return type == 3 || type == 11 || type == 12;
	return type >= 1 && type <= 4;
}

enum l4_result {
	L4_OK,
	L4_BAD,	  /* header cut short */
	L4_OTHER, /* a protocol or ICMP type no rule is about */
	L4_ICMP_ERROR,
};

/* parse_l4 fills the ports of f from the L4 header at pos. For an ICMP
 * error it stops with *pos at the quoted IP header. */
static __always_inline int parse_l4(void **pos, void *end, struct flow *f,
				    const struct ip_info *ip)
{
	void *l4 = *pos;

	f->src.proto = ip->proto;
	f->dst.proto = ip->proto;

	if (ip->proto == IPPROTO_TCP || ip->proto == IPPROTO_UDP) {
		__u32 need = ip->proto == IPPROTO_TCP ? TCP_MIN_LEN : UDP_LEN;
		if (l4 + need > end)
			return L4_BAD;
		struct ports *p = l4;
		f->src.port = p->src;
		f->dst.port = p->dst;
		return L4_OK;
	}
	if (!is_icmp(ip))
		return L4_OTHER;

	struct icmphdr *ic = l4;
	if ((void *)(ic + 1) > end)
		return L4_BAD;
	if (is_echo(ip, ic->type)) {
		f->src.port = ic->id;
		f->dst.port = ic->id;
		f->echo_request = is_echo_request(ip, ic->type);
		return L4_OK;
	}
	/* An error in a fragment quotes too little to be sure of; xdproxy's
	 * parser passes those too. */
	if (is_error(ip, ic->type) && !ip->fragmented) {
		*pos = ic + 1;
		return L4_ICMP_ERROR;
	}
	return L4_OTHER;
}

/* ---- Rules ---- */

static __always_inline void count(enum counter idx)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &idx);

	if (c)
		*c += 1; /* per-CPU slot: no other CPU writes it */
}

static __always_inline int pass(enum counter counter)
{
	count(counter);
	return XDP_PASS;
}

static __always_inline int redirect(struct xdp_md *ctx, enum counter rule)
{
	count(rule);
	long verdict = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_DROP);
	count(verdict == XDP_REDIRECT ? CNT_REDIRECTED : CNT_NO_SOCKET);
	return verdict;
}

static __always_inline __u32 addr_flags(const __u8 *addr)
{
	/* addr is the start of a svc_key, whose first 16 bytes are an
	 * addr_key. */
	__u32 *v = bpf_map_lookup_elem(&addrs, addr);

	return v ? *v : 0;
}

static __always_inline int in_map(void *map, const struct svc_key *k)
{
	return bpf_map_lookup_elem(map, k) != 0;
}

static __always_inline __u32 mix32(__u32 h, __u32 w)
{
	h ^= w * 0xcc9e2d51;
	h = (h << 13) | (h >> 19);
	return h * 5 + 0xe6546b64;
}

static __always_inline __u32 fmix32(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	return h ^ (h >> 16);
}

/* in_reply_slots reports whether k is in reply_slots. */
static __always_inline int in_reply_slots(const struct flow_key *k)
{
	__u32 idx = 0;
	struct reply_set *hdr = bpf_map_lookup_elem(&reply_slots, &idx);

	if (!hdr || hdr->tag[0] != REPLY_MAGIC)
		return 0;
	const __u32 *kw = (const __u32 *)k;
	__u32 h = (__u32)hdr->tag[1];
#pragma unroll
	for (int i = 0; i < 10; i++)
		h = mix32(h, kw[i]);
	idx = 1 + (fmix32(h) & (__u32)hdr->tag[2]);
	struct reply_set *set = bpf_map_lookup_elem(&reply_slots, &idx);
	if (!set)
		return 0;
	__u64 want = (__u64)fmix32(h + REPLY_TAG_SALT) << 2 | REPLY_LIVE;
	const __u64 *kq = (const __u64 *)k;
#pragma unroll
	for (int way = 0; way < REPLY_WAYS; way++) {
		if (*(volatile __u64 *)&set->tag[way] != want)
			continue;
		/* The tag again after the key: a way emptied and taken
		 * by another tuple meanwhile is not this one. */
		if (set->key[way][0] == kq[0] && set->key[way][1] == kq[1] &&
		    set->key[way][2] == kq[2] && set->key[way][3] == kq[3] &&
		    set->key[way][4] == kq[4] &&
		    *(volatile __u64 *)&set->tag[way] == want)
			return 1;
	}
	return 0;
}

/* in_flows reports whether the packet from src to dst is exactly a reply
 * xdproxy waits for. */
static __always_inline int in_flows(const struct svc_key *src,
				    const struct svc_key *dst)
{
	struct flow_key k;

	__builtin_memset(&k, 0, sizeof(k));
	__builtin_memcpy(k.src, src->addr, 16);
	__builtin_memcpy(k.dst, dst->addr, 16);
	k.sport = src->port;
	k.dport = dst->port;
	k.proto = src->proto;
	return in_reply_slots(&k) || bpf_map_lookup_elem(&flows, &k) != 0;
}

/* syn_guarded reports whether the TCP segment at l4, to a frontend, is the
 * first SYN of its tuple while the SYN guard is on: it is to be dropped. */
static __always_inline int syn_guarded(void *l4, void *end, const struct flow *f)
{
	__u8 *tcp = l4;
	__u32 zero = 0;

	if ((void *)(tcp + 14) > end || (tcp[13] & 0x12) != 0x02)
		return 0; /* not a SYN without ACK */
	struct syn_guard *g = bpf_map_lookup_elem(&syn_guard, &zero);
	if (!g || !g->on)
		return 0;

	/* The set and the tag come from two hashes of the tuple: taken
	 * from one 32-bit hash, a set's tuples would have only 2^12 tags
	 * between them and a spoofed SYN would match one of the set's
	 * eight entries once in 512. */
	__u32 h = g->seed, t = ~g->seed, words[9];
	__builtin_memcpy(words, f->src.addr, 16);
	__builtin_memcpy(&words[4], f->dst.addr, 16);
	words[8] = ((__u32)f->src.port << 16) | f->dst.port;
#pragma unroll
	for (int i = 0; i < 9; i++) {
		h = mix32(h, words[i]);
		t = mix32(t, words[8 - i]);
	}
	__u32 set = fmix32(h) & g->set_mask;
	__u32 tag = (fmix32(t ^ h) | 1) << SYN_TIME_BITS;
	__u32 now = (__u32)(bpf_ktime_get_ns() >> SYN_TICK_SHIFT) & SYN_TIME_MASK;
	struct syn_set *seen = bpf_map_lookup_elem(&syn_seen, &set);
	if (!seen)
		return 1;
	int victim = 0;
	__u32 oldest = 0;
#pragma unroll
	for (int i = 0; i < SYN_WAYS; i++) {
		__u32 e = seen->way[i];
		__u32 age = (now - e) & SYN_TIME_MASK;
		if ((e & ~SYN_TIME_MASK) == tag) {
			if (age < g->min_retry)
				return 1; /* too soon for a retransmission */
			if (age <= g->window) {
				/* A retransmission: a real client. Its entry
				 * becomes its set's youngest, so that the next
				 * retransmission (if this one is lost further
				 * on) finds it too. */
				seen->way[i & (SYN_WAYS - 1)] = tag | now;
				return 0;
			}
			victim = i;   /* its own, too old: start again */
			break;
		}
		if (e == 0) {
			victim = i; /* an empty way: take it */
			oldest = SYN_TIME_MASK + 1;
		} else if (age > oldest) {
			oldest = age;
			victim = i;
		}
	}
	seen->way[victim & (SYN_WAYS - 1)] = tag | now;
	return 1;
}

static __always_inline void frag_key_of(struct frag_key *k,
					const struct flow *f,
					const struct ip_info *ip)
{
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->src, f->src.addr, 16);
	__builtin_memcpy(k->dst, f->dst.addr, 16);
	k->id = ip->frag_id;
	k->proto = ip->proto;
}

/* remember_fragments records a redirected first fragment so that the
 * rest of its datagram follows it. */
static __always_inline void remember_fragments(const struct flow *f,
					       const struct ip_info *ip)
{
	struct frag_key k;
	__u8 one = 1;

	if (!ip->fragmented)
		return;
	frag_key_of(&k, f, ip);
	if (bpf_map_update_elem(&frags, &k, &one, BPF_ANY) != 0)
		count(CNT_FRAG_TRACK_FAILED);
}

/* quote_is_ours parses the packet an ICMP error quotes, at pos, and reports
 * whether xdproxy sent it. Only eight bytes of its L4 header are
 * guaranteed to be quoted, enough for ports and an echo id. */
static __always_inline int quote_is_ours(void *pos, void *end, int family)
{
	struct flow in;
	struct ip_info ip = {};
	int r;

	__builtin_memset(&in, 0, sizeof(in));
	if (family == 4)
		r = parse_ipv4(&pos, end, &in, &ip);
	else
		r = parse_ipv6(&pos, end, &in, &ip, 0);
	if (r != IP_OK)
		return 0;

	in.src.proto = ip.proto;
	in.dst.proto = ip.proto;
	if (ip.proto == IPPROTO_TCP || ip.proto == IPPROTO_UDP) {
		struct ports *p = pos;
		if ((void *)(p + 1) > end)
			return 0;
		in.src.port = p->src;
		in.dst.port = p->dst;
	} else if (is_icmp(&ip)) {
		struct icmphdr *ic = pos;
		if ((void *)(ic + 1) > end || !is_echo(&ip, ic->type))
			return 0;
		in.src.port = ic->id;
		in.dst.port = ic->id;
	} else {
		return 0;
	}

	/* Sent toward a backend (its source a client, or a SNAT address and
	 * port): the packet reversed is a reply xdproxy waits for. */
	if (in_flows(&in.dst, &in.src))
		return 1;
	/* Sent to a client as a service's reply: from a frontend. */
	return in_map(&frontends, &in.src);
}

SEC("xdp")
int xdproxy_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ip_info ip = {};
	struct flow f;
	int r;

	__builtin_memset(&f, 0, sizeof(f));

	if ((void *)(eth + 1) > end)
		return pass(CNT_PARSE_FAILED);
	__be16 proto = eth->proto;
	void *pos = eth + 1;

	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD)) {
		struct vlanhdr *vh = pos;
		if ((void *)(vh + 1) > end)
			return pass(CNT_PARSE_FAILED);
		proto = vh->proto;
		pos = vh + 1;
	}

	if (proto == bpf_htons(ETH_P_IP))
		r = parse_ipv4(&pos, end, &f, &ip);
	else if (proto == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(&pos, end, &f, &ip, 1);
	else
		return pass(CNT_PASSED); /* ARP, LLDP, a second VLAN tag, ... */

	if (r == IP_BAD)
		return pass(CNT_PARSE_FAILED);
	if (r == IP_LATER_FRAGMENT) {
		struct frag_key k;

		frag_key_of(&k, &f, &ip);
		if (bpf_map_lookup_elem(&frags, &k) ||
		    (addr_flags(f.dst.addr) & ADDR_VIP))
			return redirect(ctx, CNT_MATCH_FRAGMENT);
		return pass(CNT_PASSED);
	}

	r = parse_l4(&pos, end, &f, &ip);
	if (r == L4_BAD)
		return pass(CNT_PARSE_FAILED);
	if (r == L4_OTHER)
		return pass(CNT_PASSED);
	if (r == L4_ICMP_ERROR) {
		if (quote_is_ours(pos, end, ip.family))
			return redirect(ctx, CNT_MATCH_ICMP_ERROR);
		return pass(CNT_PASSED);
	}

	if (in_map(&frontends, &f.dst)) {
		if (ip.proto == IPPROTO_TCP && syn_guarded(pos, end, &f)) {
			count(CNT_SYN_GUARD_DROPPED);
			return XDP_DROP;
		}
		remember_fragments(&f, &ip);
		return redirect(ctx, CNT_MATCH_FRONTEND);
	}
	/* The identifier of an echo request is the sender's choice: only an
	 * echo reply can be a reply xdproxy waits for. */
	if (!f.echo_request && in_flows(&f.src, &f.dst)) {
		remember_fragments(&f, &ip);
		return redirect(ctx, CNT_MATCH_FLOW);
	}
	return pass(CNT_PASSED);
}

/*
 * xdproxy_egress: a tc egress program on each served NIC. A backend that is
 * a pod on this node receives its DNATed frames through the kernel (the
 * exception link), so its replies leave through the kernel too; when the
 * client keeps its address (externalTrafficPolicy Local), the kernel routes
 * such a reply straight out of the NIC, untranslated. This program catches
 * exactly those replies, by the same flows table, and sends them to the
 * exception link, where xdproxy's socket on the other end receives them and
 * a worker translates them. Every other packet leaves untouched, after one
 * hash lookup. (Frames xdproxy itself transmits through AF_XDP do not pass
 * tc egress.)
 */
SEC("tc")
int xdproxy_egress(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct ip_info ip = {};
	struct flow f;
	int r;

	count(CNT_EGRESS_SEEN);
	__builtin_memset(&f, 0, sizeof(f));
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	void *pos = eth + 1;
	if (eth->proto == bpf_htons(ETH_P_IP))
		r = parse_ipv4(&pos, end, &f, &ip);
	else if (eth->proto == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(&pos, end, &f, &ip, 1);
	else
		return TC_ACT_OK;
	if (r != IP_OK)
		return TC_ACT_OK;
	if (parse_l4(&pos, end, &f, &ip) != L4_OK || f.echo_request)
		return TC_ACT_OK;
	if (!in_flows(&f.src, &f.dst))
		return TC_ACT_OK;

	__u32 zero = 0;
	struct egress_config *cfg = bpf_map_lookup_elem(&egress_config, &zero);
	if (!cfg || cfg->redirect_ifindex == 0)
		return TC_ACT_OK;
	count(CNT_EGRESS_REDIRECTED);
	return bpf_redirect(cfg->redirect_ifindex, 0);
}

char _license[] SEC("license") = "Dual MIT/GPL";
