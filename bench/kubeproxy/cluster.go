package kubeproxy

import (
	"cmp"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/xdproxy/xdproxy/internal/kubetest"
)

// Binaries are the programs the baseline runs.
type Binaries struct {
	Etcd, APIServer, KubeProxy string
}

// FindBinaries looks them up where `make kube-tools` puts them (or in
// $XDPROXY_KUBE_BIN); the error says how to build what is missing.
func FindBinaries() (Binaries, error) {
	var b Binaries
	var missing []string
	var first error
	for _, x := range []struct {
		path *string
		name string
	}{{&b.Etcd, "etcd"}, {&b.APIServer, "kube-apiserver"}, {&b.KubeProxy, "kube-proxy"}} {
		p, err := kubetest.Binary(x.name)
		if err != nil {
			missing = append(missing, x.name)
			first = cmp.Or(first, err)
		}
		*x.path = p
	}
	if first != nil {
		// One line: it ends up in the report's notes.
		return b, fmt.Errorf("%s missing (%w)", strings.Join(missing, ", "), first)
	}
	return b, nil
}

// startTimeout bounds each process's start; kube-apiserver needs a few
// seconds on this machine.
const startTimeout = 90 * time.Second

// StartCluster starts etcd and kube-apiserver (internal/kubetest's control
// plane) with their files in dir, which the caller removes; both run on cpu
// (negative: anywhere). On error nothing is left running.
func StartCluster(dir string, serviceCIDR netip.Prefix, cpu int) (*kubetest.Cluster, error) {
	c, err := kubetest.New(dir, kubetest.Options{ServiceCIDR: serviceCIDR, CommandPrefix: pinned(cpu), StartTimeout: startTimeout})
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
