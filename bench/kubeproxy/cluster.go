package kubeproxy

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/xdproxy/xdproxy/control/kubetest"
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

// Cluster is a private etcd and kube-apiserver on 127.0.0.1.
type Cluster struct {
	dir       string
	creds     *credentials
	etcd, api *process
	server    string // https://127.0.0.1:port
	rest      *rest.Config
	client    kubernetes.Interface
}

// startTimeout bounds each process's start; kube-apiserver needs a few
// seconds on this machine.
const startTimeout = 90 * time.Second

// StartCluster starts etcd and kube-apiserver with their files in dir
// (which the caller removes) and returns once the API server is ready.
// serviceCIDR is --service-cluster-ip-range; both run on cpu (negative:
// anywhere). On error nothing is left running.
func StartCluster(dir string, bins Binaries, serviceCIDR netip.Prefix, cpu int) (_ *Cluster, err error) {
	c := &Cluster{dir: dir}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if c.creds, err = writeCredentials(dir); err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	c.etcd, err = startProcess("etcd", filepath.Join(dir, "etcd.log"), pinned(cpu, bins.Etcd,
		"--name=bench", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+client, "--advertise-client-urls="+client,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer, "--initial-cluster=bench="+peer,
		"--unsafe-no-fsync", "--log-level=warn")...)
	if err != nil {
		return nil, err
	}
	plain := &http.Client{Timeout: 2 * time.Second}
	if err := waitReady(c.etcd, func() error { return get(plain, client+"/health", "", `"health":"true"`) }); err != nil {
		return nil, err
	}
	c.server = "https://127.0.0.1:" + strconv.Itoa(ports[2])
	c.api, err = startProcess("kube-apiserver", filepath.Join(dir, "kube-apiserver.log"), pinned(cpu, bins.APIServer,
		"--etcd-servers="+client,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(ports[2]),
		"--tls-cert-file="+c.creds.cert, "--tls-private-key-file="+c.creds.key,
		"--cert-dir="+filepath.Join(dir, "apiserver-certs"),
		"--token-auth-file="+c.creds.tokenFile,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+c.creds.saPub, "--service-account-signing-key-file="+c.creds.saKey,
		"--service-cluster-ip-range="+serviceCIDR.String(),
		// It refuses a loopback advertise address otherwise.
		"--endpoint-reconciler-type=none",
		"--authorization-mode=RBAC",
		"--disable-admission-plugins=ServiceAccount",
		"--profiling=false",
		"--shutdown-watch-termination-grace-period=2s")...)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(c.creds.caPEM)
	secure := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	defer secure.CloseIdleConnections()
	if err := waitReady(c.api, func() error { return get(secure, c.server+"/readyz", c.creds.token, "ok") }); err != nil {
		return nil, err
	}
	c.rest = &rest.Config{Host: c.server, BearerToken: c.creds.token, TLSClientConfig: rest.TLSClientConfig{CAData: c.creds.caPEM}, QPS: -1}
	if c.client, err = kubernetes.NewForConfig(c.rest); err != nil {
		return nil, err
	}
	// The default namespace exists once the API server has created its
	// own Service.
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	for {
		svc, err := c.client.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		if err == nil && svc.Spec.ClusterIP != "" {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("kube-apiserver did not create the kubernetes Service: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Client is a clientset for the admin user, without client-side rate
// limits.
func (c *Cluster) Client() kubernetes.Interface { return c.client }

// Server is the API server's URL.
func (c *Cluster) Server() string { return c.server }

// WriteKubeconfig writes a kubeconfig for the admin user that points at
// server (the API server's URL, or a forwarder's with the same IP).
func (c *Cluster) WriteKubeconfig(path, server string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["bench"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: c.creds.caPEM}
	cfg.AuthInfos[adminUser] = &clientcmdapi.AuthInfo{Token: c.creds.token}
	cfg.Contexts["bench"] = &clientcmdapi.Context{Cluster: "bench", AuthInfo: adminUser}
	cfg.CurrentContext = "bench"
	return clientcmd.WriteToFile(*cfg, path)
}

// Logs is the end of both processes' logs, for error messages.
func (c *Cluster) Logs() string {
	var b strings.Builder
	for _, p := range []*process{c.etcd, c.api} {
		if p != nil {
			fmt.Fprintf(&b, "%s: %s\n", p.name, p.tail(2000))
		}
	}
	return b.String()
}

// Close stops the API server, then etcd.
func (c *Cluster) Close() {
	c.api.stop(15 * time.Second)
	c.etcd.stop(15 * time.Second)
}

func waitReady(p *process, ready func() error) error {
	deadline := time.Now().Add(startTimeout)
	for {
		err := ready()
		switch {
		case err == nil:
			return nil
		case p.exited():
			return fmt.Errorf("%s exited (%v): %s", p.name, p.err, p.tail(2000))
		case time.Now().After(deadline):
			return fmt.Errorf("%s not ready after %v: %v: %s", p.name, startTimeout, err, p.tail(2000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func get(c *http.Client, url, token, want string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// freePorts are n distinct ports free on 127.0.0.1 a moment ago.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
