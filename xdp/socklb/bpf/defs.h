/*
 * The few kernel UAPI definitions the socket programs need, written out
 * here so that compiling them needs nothing but clang: no kernel or libbpf
 * headers. Values are those of include/uapi/linux/bpf.h and the socket
 * headers, which the kernel keeps stable. (xdp/bpf/bpf_defs.h is the XDP
 * program's; this package keeps its own so that neither constrains the
 * other.)
 */
#ifndef XDPROXY_SOCKLB_DEFS_H
#define XDPROXY_SOCKLB_DEFS_H

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;
typedef __u16 __be16;
typedef __u32 __be32;

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define bpf_htonl(x) ((__be32)__builtin_bswap32(x))
#else
#define bpf_htonl(x) ((__be32)(x))
#endif

#define SEC(name) __attribute__((section(name), used))
#define __always_inline inline __attribute__((always_inline))

/* BTF-style map definitions, the form cilium/ebpf reads. */
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name

/* Map types (enum bpf_map_type). */
#define BPF_MAP_TYPE_HASH 1
#define BPF_MAP_TYPE_PERCPU_ARRAY 6
#define BPF_MAP_TYPE_LRU_HASH 9

/* Map update flags. */
#define BPF_ANY 0

#define IPPROTO_TCP 6
#define IPPROTO_UDP 17

#define ECONNREFUSED 111

/*
 * The context of a cgroup sock_addr program (struct bpf_sock_addr). The
 * user_ fields are the address the caller passed to connect(2) or
 * sendmsg(2), or the one recvmsg(2) and getpeername(2) are about to
 * return; addresses and ports are in network byte order, the port in the
 * low 16 bits. The kernel allows 4-byte reads and writes of each.
 */
struct bpf_sock_addr {
	__u32 user_family;
	__u32 user_ip4;
	__u32 user_ip6[4];
	__u32 user_port;
	__u32 family;
	__u32 type;
	__u32 protocol;
	__u32 msg_src_ip4;
	__u32 msg_src_ip6[4];
	__u64 sk; /* struct bpf_sock *, unused here */
};

/* Helpers, by their number in enum bpf_func_id. */
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
				   __u64 flags) = (void *)2;
static __u32 (*bpf_get_prandom_u32)(void) = (void *)7;
static __u64 (*bpf_get_socket_cookie)(void *ctx) = (void *)46;
static __u64 (*bpf_get_netns_cookie)(void *ctx) = (void *)122;
static __u64 (*bpf_ktime_get_coarse_ns)(void) = (void *)160;
static int (*bpf_set_retval)(int retval) = (void *)187;

#endif
