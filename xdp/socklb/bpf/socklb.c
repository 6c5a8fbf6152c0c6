/*
 * socklb: service translation at the socket, for clients on the node.
 *
 * cgroup sock_addr programs, attached to a cgroup v2 (every hook below).
 * A client in that cgroup that connects or sends to a service frontend
 * (cluster IP, external or load-balancer IP, NodePort on a node address or
 * 127.0.0.1) is given a backend's address instead, before the kernel
 * routes anything: the socket talks to the backend directly and no packet
 * needs translating. Replies and getpeername(2) are given the frontend's
 * address back, so the client sees the address it asked for.
 *
 *   connect4/6    connect(2) of TCP and UDP sockets: rewrite the
 *                 destination, remember (socket, backend) -> frontend.
 *   sendmsg4/6    sendto(2)/sendmsg(2) with an address on a UDP socket
 *                 (unconnected UDP): the same, and the socket keeps its
 *                 backend for that frontend while the backend stays in
 *                 the frontend's set (a pin), as conntrack keeps a UDP
 *                 flow on one endpoint.
 *   recvmsg4/6    recvfrom(2)/recvmsg(2) on a UDP socket that asked for
 *                 the source: a datagram from a backend the socket was
 *                 given shows the frontend as its source.
 *   getpeername4/6  the same for getpeername(2), TCP and UDP.
 * A destination that is no frontend is left alone: every program returns
 * 1 without touching the context. There is no per-packet program.
 *
 * Dual-stack sockets: an AF_INET6 socket that connects to ::ffff:a.b.c.d
 * runs connect6 with the mapped address, which is also how frontends of
 * IPv4 services are keyed, so it matches; the backend is written back
 * mapped. Its unconnected sends to a mapped address go through sendmsg4
 * (the kernel hands them to the IPv4 code), its receives through recvmsg6.
 *
 * Maps; the Go loader sets every max_entries before loading.
 *   frontends  HASH, frontend_key (addr, port, proto) -> frontend: the
 *              service id, the backend set and its size, the affinity
 *              timeout and flags.
 *   backends   HASH, (set, index) -> endpoint, index < frontend.count.
 *   members    HASH, (set, endpoint) -> index: whether an endpoint is in
 *              a set, to check a remembered backend (affinity, pin)
 *              against the frontend's current set in one lookup.
 *              A backend set is immutable: Go writes a new set's
 *              backends and members first, then points frontends at it
 *              (one update per frontend), and deletes the old set only
 *              after an RCU grace period, when no program can still be
 *              reading it. So a program that found a frontend finds all
 *              of its set.
 *   affinity   LRU_HASH, (service id, client netns cookie) -> backend and
 *              expiry (coarse monotonic ns): ClientIP session affinity.
 *   reverse    LRU_HASH, (socket cookie, endpoint, kind) -> endpoint.
 *              REV_PEER: the backend a socket was given -> the frontend
 *              it asked for (recvmsg, getpeername). REV_PIN: the frontend
 *              an unconnected UDP socket sent to -> the backend it got.
 *   counters   PERCPU_ARRAY, one u64 per CNT_* below.
 *
 * Addresses are 16 bytes, IPv4 mapped (::ffff:a.b.c.d) as in
 * nat/packet.Addr; ports are in network byte order. Pad bytes of keys are
 * zero: the kernel hashes every byte.
 */
#include "defs.h"

/* ---- Map layouts; the Go side (the generated bpf_*.go) mirrors them. ---- */

struct endpoint {
	__u8 addr[16];
	__be16 port;
	__u8 pad[2];
} __attribute__((aligned(4)));

struct frontend_key {
	__u8 addr[16];
	__be16 port;
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;
} __attribute__((aligned(4)));

enum frontend_flag {
	FE_REJECT = 1,	  /* no backends: fail with ECONNREFUSED (else EPERM) */
	FE_NODE_ONLY = 2, /* only for sockets in the node's netns (127.0.0.1) */
};

struct frontend {
	__u64 service_id; /* keys affinity; shared by a service port's frontends */
	__u32 set;	  /* backends (set, 0..count-1) */
	__u32 count;	  /* 0: no endpoints */
	__u32 affinity_s; /* ClientIP affinity timeout in seconds; 0: none */
	__u8 flags;	  /* FE_* */
	__u8 pad[3];
};

struct backend_key {
	__u32 set;
	__u32 index;
};

struct member_key {
	__u32 set;
	struct endpoint ep;
};

struct affinity_key {
	__u64 service_id;
	__u64 netns; /* bpf_get_netns_cookie of the client's socket */
};

struct affinity {
	__u64 expires_ns; /* bpf_ktime_get_coarse_ns */
	struct endpoint backend;
	__u8 pad[4];
};

enum reverse_kind {
	REV_PEER = 1, /* ep is a backend; the value the frontend */
	REV_PIN = 2,  /* ep is a frontend; the value the backend */
};

struct reverse_key {
	__u64 cookie; /* bpf_get_socket_cookie: unique for the boot */
	struct endpoint ep;
	__u8 kind; /* REV_* */
	__u8 pad[3];
};

/* Each translate() call ends in exactly one of the first five. */
enum counter {
	CNT_TRANSLATED,	    /* destination rewritten to a backend */
	CNT_REJECTED,	    /* no backends, FE_REJECT: ECONNREFUSED */
	CNT_DROPPED,	    /* no backends, no FE_REJECT: EPERM */
	CNT_NOT_NODE,	    /* FE_NODE_ONLY frontend from another netns: untouched */
	CNT_NO_BACKEND,	    /* a set's backend missing: untouched (a bug) */
	CNT_AFFINITY_HIT,   /* of TRANSLATED: the affinity's backend */
	CNT_PIN_HIT,	    /* of TRANSLATED: an unconnected socket's pin */
	CNT_REVERSED,	    /* recvmsg/getpeername shown the frontend */
	CNT_REVERSE_FAILED, /* a reverse entry could not be written */
	CNT_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct frontend_key);
	__type(value, struct frontend);
} frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct backend_key);
	__type(value, struct endpoint);
} backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct member_key);
	__type(value, __u32);
} members SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__type(key, struct affinity_key);
	__type(value, struct affinity);
} affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__type(key, struct reverse_key);
	__type(value, struct endpoint);
} reverse SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, enum counter);
	__type(value, __u64);
} counters SEC(".maps");

/* The netns cookie of the node's network namespace, set by the loader:
 * FE_NODE_ONLY frontends (loopback NodePorts) apply only there, since a
 * pod's 127.0.0.1 is its own. */
volatile const __u64 node_netns = 0;

#define NSEC_PER_SEC 1000000000ULL

static __always_inline void count(enum counter c)
{
	__u32 k = c;
	__u64 *v = bpf_map_lookup_elem(&counters, &k);
	if (v)
		*v += 1;
}

static __always_inline __u32 addr_word(const struct endpoint *ep, int i)
{
	__u32 w;
	__builtin_memcpy(&w, &ep->addr[4 * i], 4);
	return w;
}

static __always_inline void set_addr_word(struct endpoint *ep, int i, __u32 w)
{
	__builtin_memcpy(&ep->addr[4 * i], &w, 4);
}

static __always_inline int is_v4_mapped(const struct endpoint *ep)
{
	return addr_word(ep, 0) == 0 && addr_word(ep, 1) == 0 &&
	       addr_word(ep, 2) == bpf_htonl(0xffff);
}

/* The address and port the context holds, as an endpoint. */
static __always_inline void ctx_endpoint(struct bpf_sock_addr *ctx, struct endpoint *ep, int v6)
{
	__builtin_memset(ep, 0, sizeof(*ep));
	if (v6) {
		set_addr_word(ep, 0, ctx->user_ip6[0]);
		set_addr_word(ep, 1, ctx->user_ip6[1]);
		set_addr_word(ep, 2, ctx->user_ip6[2]);
		set_addr_word(ep, 3, ctx->user_ip6[3]);
	} else {
		set_addr_word(ep, 2, bpf_htonl(0xffff));
		set_addr_word(ep, 3, ctx->user_ip4);
	}
	ep->port = (__be16)ctx->user_port;
}

/* Writes ep into the context; an IPv4 program can only take an IPv4
 * address (returns 0 otherwise). */
static __always_inline int set_ctx_endpoint(struct bpf_sock_addr *ctx, const struct endpoint *ep,
					    int v6)
{
	if (v6) {
		ctx->user_ip6[0] = addr_word(ep, 0);
		ctx->user_ip6[1] = addr_word(ep, 1);
		ctx->user_ip6[2] = addr_word(ep, 2);
		ctx->user_ip6[3] = addr_word(ep, 3);
	} else {
		if (!is_v4_mapped(ep))
			return 0;
		ctx->user_ip4 = addr_word(ep, 3);
	}
	ctx->user_port = ep->port;
	return 1;
}

/* Whether ep is in backend set `set`. */
static __always_inline int is_member(__u32 set, const struct endpoint *ep)
{
	struct member_key mk;
	__builtin_memset(&mk, 0, sizeof(mk));
	mk.set = set;
	__builtin_memcpy(mk.ep.addr, ep->addr, 16);
	mk.ep.port = ep->port;
	return bpf_map_lookup_elem(&members, &mk) != 0;
}

/* A uniformly random backend of fe's set. */
static __always_inline int pick(const struct frontend *fe, struct endpoint *be)
{
	struct backend_key bk = {.set = fe->set, .index = bpf_get_prandom_u32() % fe->count};
	struct endpoint *p = bpf_map_lookup_elem(&backends, &bk);
	if (!p)
		return 0;
	*be = *p;
	return 1;
}

static __always_inline void remember(struct reverse_key *rk, const struct endpoint *val)
{
	if (bpf_map_update_elem(&reverse, rk, val, BPF_ANY))
		count(CNT_REVERSE_FAILED);
}

/* connect and sendmsg: a frontend destination becomes a backend. */
static __always_inline int translate(struct bpf_sock_addr *ctx, int v6, int sendmsg)
{
	struct endpoint dst, be;
	ctx_endpoint(ctx, &dst, v6);

	struct frontend_key fk;
	__builtin_memset(&fk, 0, sizeof(fk));
	__builtin_memcpy(fk.addr, dst.addr, 16);
	fk.port = dst.port;
	fk.proto = ctx->protocol;
	struct frontend *p = bpf_map_lookup_elem(&frontends, &fk);
	if (!p)
		return 1;
	/* Copy at once: an update replaces the whole element (see Go's
	 * SetFrontends), so set and count belong together. */
	struct frontend fe = *p;

	__u64 netns = 0;
	if (fe.flags & FE_NODE_ONLY || fe.affinity_s) {
		netns = bpf_get_netns_cookie(ctx);
		if (fe.flags & FE_NODE_ONLY && netns != node_netns) {
			count(CNT_NOT_NODE);
			return 1;
		}
	}
	if (fe.count == 0) {
		if (fe.flags & FE_REJECT) {
			bpf_set_retval(-ECONNREFUSED);
			count(CNT_REJECTED);
		} else {
			count(CNT_DROPPED); /* the kernel's default: EPERM */
		}
		return 0;
	}

	struct reverse_key rk;
	__builtin_memset(&rk, 0, sizeof(rk));
	rk.cookie = bpf_get_socket_cookie(ctx);

	if (sendmsg) {
		/* An unconnected socket keeps the backend it got for this
		 * frontend while that backend is in the frontend's set. */
		rk.ep = dst;
		rk.kind = REV_PIN;
		struct endpoint *pin = bpf_map_lookup_elem(&reverse, &rk);
		if (pin) {
			be = *pin;
			if (is_member(fe.set, &be) && set_ctx_endpoint(ctx, &be, v6)) {
				/* The reverse entry may have been evicted
				 * on its own. */
				rk.ep = be;
				rk.kind = REV_PEER;
				if (!bpf_map_lookup_elem(&reverse, &rk))
					remember(&rk, &dst);
				count(CNT_TRANSLATED);
				count(CNT_PIN_HIT);
				return 1;
			}
		}
	}

	int hit = 0;
	if (fe.affinity_s) {
		struct affinity_key ak = {.service_id = fe.service_id, .netns = netns};
		__u64 now = bpf_ktime_get_coarse_ns();
		__u64 expires = now + (__u64)fe.affinity_s * NSEC_PER_SEC;
		struct affinity *a = bpf_map_lookup_elem(&affinity, &ak);
		if (a && now < a->expires_ns && is_member(fe.set, &a->backend)) {
			be = a->backend;
			a->expires_ns = expires; /* each use refreshes it */
			hit = 1;
		} else {
			if (!pick(&fe, &be)) {
				count(CNT_NO_BACKEND);
				return 1;
			}
			struct affinity na;
			__builtin_memset(&na, 0, sizeof(na));
			na.expires_ns = expires;
			na.backend = be;
			bpf_map_update_elem(&affinity, &ak, &na, BPF_ANY);
		}
	} else if (!pick(&fe, &be)) {
		count(CNT_NO_BACKEND);
		return 1;
	}

	if (!set_ctx_endpoint(ctx, &be, v6)) {
		/* An IPv6 backend for an IPv4 socket: Go never writes one. */
		count(CNT_NO_BACKEND);
		return 1;
	}
	rk.ep = be;
	rk.kind = REV_PEER;
	remember(&rk, &dst);
	if (sendmsg) {
		rk.ep = dst;
		rk.kind = REV_PIN;
		remember(&rk, &be);
	}
	count(CNT_TRANSLATED);
	if (hit)
		count(CNT_AFFINITY_HIT);
	return 1;
}

/* recvmsg and getpeername: a backend the socket was given shows as the
 * frontend it asked for. These hooks must return 1. */
static __always_inline int reverse_translate(struct bpf_sock_addr *ctx, int v6)
{
	struct reverse_key rk;
	__builtin_memset(&rk, 0, sizeof(rk));
	ctx_endpoint(ctx, &rk.ep, v6);
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.kind = REV_PEER;
	struct endpoint *fe = bpf_map_lookup_elem(&reverse, &rk);
	if (!fe)
		return 1;
	struct endpoint v = *fe;
	if (set_ctx_endpoint(ctx, &v, v6))
		count(CNT_REVERSED);
	return 1;
}

SEC("cgroup/connect4")
int socklb_conn4(struct bpf_sock_addr *ctx) { return translate(ctx, 0, 0); }

SEC("cgroup/connect6")
int socklb_conn6(struct bpf_sock_addr *ctx) { return translate(ctx, 1, 0); }

SEC("cgroup/sendmsg4")
int socklb_send4(struct bpf_sock_addr *ctx) { return translate(ctx, 0, 1); }

SEC("cgroup/sendmsg6")
int socklb_send6(struct bpf_sock_addr *ctx) { return translate(ctx, 1, 1); }

SEC("cgroup/recvmsg4")
int socklb_recv4(struct bpf_sock_addr *ctx) { return reverse_translate(ctx, 0); }

SEC("cgroup/recvmsg6")
int socklb_recv6(struct bpf_sock_addr *ctx) { return reverse_translate(ctx, 1); }

SEC("cgroup/getpeername4")
int socklb_peer4(struct bpf_sock_addr *ctx) { return reverse_translate(ctx, 0); }

SEC("cgroup/getpeername6")
int socklb_peer6(struct bpf_sock_addr *ctx) { return reverse_translate(ctx, 1); }

char _license[] SEC("license") = "GPL";
