// Command kube-proxy is the upstream Kubernetes service proxy, built from the
// k8s.io/kubernetes module so that benchmarks compare xdproxy with the real one.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() {
	os.Exit(cli.Run(app.NewProxyCommand()))
}
