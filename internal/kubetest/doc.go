// Package kubetest starts a real Kubernetes control plane for tests: an etcd
// and a kube-apiserver listening on free ports of 127.0.0.1, with their
// certificates, keys, data and logs in the test's temporary directory.
//
// The programs are the upstream ones, built from Go modules by
// internal/kubetools (make kube-tools) into build/kube/bin at the repository
// root, or found in the directory named by $XDPROXY_KUBE_BIN. A test that asks
// for a cluster fails, rather than skips, when they are missing.
//
// The cluster authenticates one user in system:masters with a bearer token
// and authorizes with RBAC (or AlwaysAllow). No controller-manager, scheduler
// or kubelet runs: Services get ClusterIPs from the API server itself, but
// nothing creates EndpointSlices, Pods or service-account tokens; tests write
// the objects they need.
//
// A Cluster belongs to the test that started it. Its methods call t.Fatal and
// must run on that test's goroutine, except Client, RESTConfig, Kubeconfig and
// Kubectl, which any goroutine may use. The processes run in their own process
// groups and are killed when the test ends, when it fails, and (through the
// parent-death signal) when the test binary dies.
package kubetest
