// Package kubetools is a separate Go module that builds the real Kubernetes
// control-plane programs xdproxy is tested against: kube-apiserver, etcd,
// kubectl and kube-proxy. It has its own go.mod so that the project's module
// does not inherit the dependency tree of k8s.io/kubernetes.
//
// Build with ./build.sh OUTDIR (make kube-tools); internal/kubetest finds the
// binaries in build/kube/bin or in $XDPROXY_KUBE_BIN.
package kubetools
