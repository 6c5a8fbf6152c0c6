package socklb

// The BPF object and its Go bindings (bpf_bpfel.go/.o, bpf_bpfeb.go/.o) are
// generated from bpf/socklb.c and committed, so that building xdproxy needs
// no clang. Regenerate after editing the C: `go generate ./xdp/socklb` with
// clang-14 and llvm-strip-14 installed (Debian: apt-get install clang-14
// llvm-14).
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-Wall -Werror" -type counter bpf bpf/socklb.c
