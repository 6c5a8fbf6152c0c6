/*
 * The few kernel UAPI definitions the XDP program needs, written out here so
 * that compiling it needs nothing but clang: no kernel or libbpf headers, and
 * no architecture-specific include paths. Values are those of
 * include/uapi/linux/bpf.h, which the kernel keeps stable.
 */
#ifndef XDPROXY_BPF_DEFS_H
#define XDPROXY_BPF_DEFS_H

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;
typedef __u16 __be16;
typedef __u32 __be32;

/* Byte order: BPF programs see packet bytes as stored, so multi-byte header
 * fields are compared in network order. These fold to constants. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define bpf_htons(x) ((__be16)__builtin_bswap16(x))
#define bpf_ntohs(x) ((__u16)__builtin_bswap16(x))
#else
#define bpf_htons(x) ((__be16)(x))
#define bpf_ntohs(x) ((__u16)(x))
#endif

#define SEC(name) __attribute__((section(name), used))
#define __always_inline inline __attribute__((always_inline))

/* BTF-style map definitions, the form cilium/ebpf reads. */
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name

/* Map types (enum bpf_map_type). */
#define BPF_MAP_TYPE_HASH 1
#define BPF_MAP_TYPE_ARRAY 2
#define BPF_MAP_TYPE_PERCPU_ARRAY 6
#define BPF_MAP_TYPE_LRU_HASH 9
#define BPF_MAP_TYPE_XSKMAP 17

/* Map update flags. */
#define BPF_ANY 0

/* Map creation flags. */
#define BPF_F_MMAPABLE (1U << 10)

/* XDP verdicts (enum xdp_action). */
#define XDP_ABORTED 0
#define XDP_DROP 1
#define XDP_PASS 2
#define XDP_TX 3
#define XDP_REDIRECT 4

/* The context of an XDP program (struct xdp_md). */
struct xdp_md {
	__u32 data;
	__u32 data_end;
	__u32 data_meta;
	__u32 ingress_ifindex;
	__u32 rx_queue_index;
	__u32 egress_ifindex;
};

/* tc verdicts (TC_ACT_*). */
#define TC_ACT_OK 0
#define TC_ACT_REDIRECT 7

/* The context of a tc program (struct __sk_buff), up to the fields used. */
struct __sk_buff {
	__u32 len;
	__u32 pkt_type;
	__u32 mark;
	__u32 queue_mapping;
	__u32 protocol;
	__u32 vlan_present;
	__u32 vlan_tci;
	__u32 vlan_proto;
	__u32 priority;
	__u32 ingress_ifindex;
	__u32 ifindex;
	__u32 tc_index;
	__u32 cb[5];
	__u32 hash;
	__u32 tc_classid;
	__u32 data;
	__u32 data_end;
};

/* Helpers, by their number in enum bpf_func_id. */
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
				   __u64 flags) = (void *)2;
static long (*bpf_redirect_map)(void *map, __u64 key, __u64 flags) = (void *)51;
static long (*bpf_redirect)(__u32 ifindex, __u64 flags) = (void *)23;
static __u64 (*bpf_ktime_get_ns)(void) = (void *)5;

#endif
