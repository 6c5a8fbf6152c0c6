package kubetest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// AuthorizationMode is kube-apiserver's --authorization-mode.
type AuthorizationMode string

const (
	// RBAC enforces roles; the test's user is in system:masters and may do anything.
	RBAC AuthorizationMode = "RBAC"
	// AlwaysAllow lets every authenticated or anonymous request through.
	AlwaysAllow AuthorizationMode = "AlwaysAllow"
)

// DefaultServiceCIDR is the Service range of a test cluster: inside the
// benchmarking range 198.18.0.0/15, apart from the test hosts in 198.18.0.0/16.
var DefaultServiceCIDR = netip.MustParsePrefix("198.19.0.0/16")

// Options configures Start. The zero value is a usable RBAC cluster.
type Options struct {
	// CommandPrefix is put before each control-plane command line, for
	// example "taskset -c 0" to keep it off a benchmark's forwarding CPU.
	CommandPrefix []string
	// Authorization defaults to RBAC.
	Authorization AuthorizationMode
	// ServiceCIDR is --service-cluster-ip-range; it defaults to DefaultServiceCIDR.
	ServiceCIDR netip.Prefix
	// APIServerArgs are appended to kube-apiserver's command line: a scalar
	// flag given here overrides the default, a list flag (such as
	// --disable-admission-plugins) adds to it.
	APIServerArgs []string
	// StartTimeout bounds how long each process may take to become ready;
	// it defaults to one minute.
	StartTimeout time.Duration
}

// Cluster is a running etcd and kube-apiserver owned by one test.
type Cluster struct {
	t     testing.TB
	dir   string
	opts  Options
	creds *credentials

	etcdBin, apiserverBin, kubectlBin string

	etcdClientPort, etcdPeerPort, apiserverPort int

	etcd, apiserver *Process

	kubeconfig string
	restConfig *rest.Config
	client     kubernetes.Interface
	closed     bool
}

// portAttempts bounds retries when another process takes a port between
// finding it free and the child binding it.
const portAttempts = 3

// Start starts etcd and kube-apiserver and returns once the API server is
// ready and has created the default namespace's kubernetes Service. It fails
// the test if the binaries are missing or the control plane does not come up.
// The cluster is closed when the test ends.
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	began := time.Now()
	c, err := newCluster(t, t.TempDir(), opts)
	// Registered after TempDir, so it runs before the directory is removed.
	t.Cleanup(c.Close)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	t.Logf("kubetest: control plane at %s ready in %v (dir %s)",
		c.restConfig.Host, time.Since(began).Round(time.Millisecond), c.dir)
	return c
}

// New is Start for programs that are not tests, such as the benchmark: the
// cluster keeps its files in dir, which the caller removes, and the caller
// must Close it, also when New fails (Close is safe on a partial cluster).
// StopAPIServer and StartAPIServer are for Start's clusters only.
func New(dir string, opts Options) (*Cluster, error) { return newCluster(nil, dir, opts) }

func newCluster(t testing.TB, dir string, opts Options) (*Cluster, error) {
	if opts.Authorization == "" {
		opts.Authorization = RBAC
	}
	if !opts.ServiceCIDR.IsValid() {
		opts.ServiceCIDR = DefaultServiceCIDR
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = time.Minute
	}
	c := &Cluster{t: t, opts: opts, dir: dir}
	for _, b := range []struct {
		path *string
		name string
	}{{&c.etcdBin, "etcd"}, {&c.apiserverBin, "kube-apiserver"}, {&c.kubectlBin, "kubectl"}} {
		path, err := Binary(b.name)
		if err != nil {
			if b.name == "kubectl" && t == nil {
				continue // only the tests' Kubectl needs it
			}
			return c, err
		}
		*b.path = path
	}
	creds, err := writeCredentials(c.dir, opts.ServiceCIDR)
	if err != nil {
		return c, fmt.Errorf("credentials: %w", err)
	}
	c.creds = creds
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(2)
		if err != nil {
			return c, err
		}
		c.etcdClientPort, c.etcdPeerPort = ports[0], ports[1]
		if err = c.startEtcd(); err == nil {
			break
		}
		if attempt == portAttempts || !c.etcd.portConflict() {
			return c, err
		}
	}
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(1)
		if err != nil {
			return c, err
		}
		c.apiserverPort = ports[0]
		if err = c.startAPIServer(); err == nil {
			break
		}
		if attempt == portAttempts || !c.apiserver.portConflict() {
			return c, err
		}
	}
	if err := c.writeKubeconfig(); err != nil {
		return c, err
	}
	if err := c.waitForKubernetesService(); err != nil {
		return c, fmt.Errorf("%v\n%s", err, c.apiserver.LogTail(dumpBytes))
	}
	return c, nil
}

// Kubeconfig returns the path of a kubeconfig for the cluster's admin user,
// with the default namespace as its context's namespace.
func (c *Cluster) Kubeconfig() string { return c.kubeconfig }

// RESTConfig returns a copy of the admin user's client configuration. Client
// side rate limiting is off: tests create objects in bulk.
func (c *Cluster) RESTConfig() *rest.Config { return rest.CopyConfig(c.restConfig) }

// UnprivilegedRESTConfig returns a client configuration for a user that
// belongs to no group: RBAC lets it do only what roles bound to the user
// "kubetest-user" (or to system:authenticated) allow.
func (c *Cluster) UnprivilegedRESTConfig() *rest.Config {
	cfg := rest.AnonymousClientConfig(c.restConfig)
	cfg.BearerToken = c.creds.userToken
	return cfg
}

// Client returns a clientset for the admin user.
func (c *Cluster) Client() kubernetes.Interface { return c.client }

// ServiceCIDR returns the range ClusterIPs are allocated from.
func (c *Cluster) ServiceCIDR() netip.Prefix { return c.opts.ServiceCIDR }

// Dir returns the directory holding the cluster's keys, etcd data and logs.
func (c *Cluster) Dir() string { return c.dir }

// kubectlTimeout keeps a hung kubectl from holding the test until its deadline.
const kubectlTimeout = 2 * time.Minute

// Kubectl runs kubectl against the cluster and returns its standard output.
// A failure's error includes kubectl's standard error.
func (c *Cluster) Kubectl(args ...string) ([]byte, error) {
	return c.KubectlWithInput(nil, args...)
}

// KubectlWithInput is Kubectl with stdin as kubectl's standard input, for
// commands such as `apply -f -`.
func (c *Cluster) KubectlWithInput(stdin []byte, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), kubectlTimeout)
	defer cancel()
	full := append([]string{"--kubeconfig=" + c.kubeconfig,
		"--cache-dir=" + filepath.Join(c.dir, "kubectl-cache")}, args...)
	cmd := exec.CommandContext(ctx, c.kubectlBin, full...)
	if stdin != nil {
		cmd.Stdin = strings.NewReader(string(stdin))
	}
	var stdout, stderr strings.Builder
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return []byte(stdout.String()), fmt.Errorf("kubectl %s: %w: %s",
			strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return []byte(stdout.String()), nil
}

// startProcess starts one control-plane process, behind CommandPrefix.
func (c *Cluster) startProcess(name, path string, args []string, logPath string) (*Process, error) {
	if len(c.opts.CommandPrefix) > 0 {
		args = append(append(c.opts.CommandPrefix[1:len(c.opts.CommandPrefix):len(c.opts.CommandPrefix)], path), args...)
		path = c.opts.CommandPrefix[0]
	}
	return StartProcess(name, path, args, logPath)
}

// Server is the API server's URL.
func (c *Cluster) Server() string { return c.apiserverURL() }

// WriteKubeconfig writes a kubeconfig for the admin user that points at
// server: the API server's URL, or that of a forwarder on the same IP
// address, which the serving certificate also fits.
func (c *Cluster) WriteKubeconfig(path, server string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: c.creds.caPEM}
	cfg.AuthInfos[adminUser] = &clientcmdapi.AuthInfo{Token: c.creds.token}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: adminUser, Namespace: "default"}
	cfg.CurrentContext = "kubetest"
	return clientcmd.WriteToFile(*cfg, path)
}

// stopGrace is how long a process gets to exit after SIGTERM.
const stopGrace = 15 * time.Second

// StopAPIServer shuts kube-apiserver down (SIGTERM, as a rolling update
// would) and leaves etcd running. Clients see connection errors until
// StartAPIServer.
func (c *Cluster) StopAPIServer() {
	c.t.Helper()
	if c.apiserver == nil || c.apiserver.Exited() {
		c.t.Fatalf("kubetest: StopAPIServer: kube-apiserver is not running")
	}
	c.apiserver.Stop(stopGrace)
}

// StartAPIServer starts kube-apiserver again on the same port, with the same
// credentials and etcd data, and waits until it is ready.
func (c *Cluster) StartAPIServer() {
	c.t.Helper()
	if c.apiserver != nil && !c.apiserver.Exited() {
		c.t.Fatalf("kubetest: StartAPIServer: kube-apiserver is already running")
	}
	if err := c.startAPIServer(); err != nil {
		c.t.Fatalf("kubetest: restart: %v", err)
	}
}

// dumpBytes is how much of each log a failed test prints.
const dumpBytes = 64 << 10

// Close stops both processes and, if the test failed, prints the end of
// their logs. Start registers it with t.Cleanup; calling it again is harmless.
func (c *Cluster) Close() {
	if c.closed {
		return
	}
	c.closed = true
	for _, p := range []*Process{c.apiserver, c.etcd} {
		if p != nil {
			p.Stop(stopGrace)
		}
	}
	if c.t != nil && c.t.Failed() {
		for _, p := range []*Process{c.apiserver, c.etcd} {
			if p != nil {
				c.t.Logf("kubetest: %s log:\n%s", p.name, p.LogTail(dumpBytes))
			}
		}
	}
}

func (c *Cluster) etcdURL(port int) string { return "http://127.0.0.1:" + strconv.Itoa(port) }

func (c *Cluster) startEtcd() error {
	client, peer := c.etcdURL(c.etcdClientPort), c.etcdURL(c.etcdPeerPort)
	args := []string{
		"--name=kubetest",
		"--data-dir=" + filepath.Join(c.dir, "etcd"),
		"--listen-client-urls=" + client,
		"--advertise-client-urls=" + client,
		"--listen-peer-urls=" + peer,
		"--initial-advertise-peer-urls=" + peer,
		"--initial-cluster=kubetest=" + peer,
		// The data lives only as long as the test; durability buys nothing.
		"--unsafe-no-fsync",
		"--log-level=warn",
	}
	p, err := c.startProcess("etcd", c.etcdBin, args, filepath.Join(c.dir, "etcd.log"))
	if err != nil {
		return err
	}
	c.etcd = p
	health := &http.Client{Timeout: 2 * time.Second}
	return c.waitReady(p, func() error {
		return checkOK(health, client+"/health", "", `"health":"true"`)
	})
}

func (c *Cluster) startAPIServer() error {
	args := []string{
		"--etcd-servers=" + c.etcdURL(c.etcdClientPort),
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(c.apiserverPort),
		"--tls-cert-file=" + c.creds.servingCert,
		"--tls-private-key-file=" + c.creds.servingKey,
		"--cert-dir=" + filepath.Join(c.dir, "apiserver-certs"),
		"--token-auth-file=" + c.creds.tokenAuthFile,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + c.creds.servicePub,
		"--service-account-signing-key-file=" + c.creds.serviceKey,
		"--service-cluster-ip-range=" + c.opts.ServiceCIDR.String(),
		// The endpoint reconciler refuses a loopback advertise address.
		"--endpoint-reconciler-type=none",
		"--authorization-mode=" + string(c.opts.Authorization),
		// Without a controller-manager no service accounts exist, and this
		// plugin would reject every Pod.
		"--disable-admission-plugins=ServiceAccount",
		"--profiling=false",
		// Open watches would otherwise hold a SIGTERMed server up to its 60 s
		// shutdown timeout; with a grace period it ends them and exits.
		"--shutdown-watch-termination-grace-period=2s",
	}
	args = append(args, c.opts.APIServerArgs...)
	p, err := c.startProcess("kube-apiserver", c.apiserverBin, args, filepath.Join(c.dir, "kube-apiserver.log"))
	if err != nil {
		return err
	}
	c.apiserver = p
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(c.creds.caPEM)
	readyz := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}},
	}
	defer readyz.CloseIdleConnections()
	return c.waitReady(p, func() error {
		return checkOK(readyz, c.apiserverURL()+"/readyz", c.creds.token, "ok")
	})
}

func (c *Cluster) apiserverURL() string {
	return "https://127.0.0.1:" + strconv.Itoa(c.apiserverPort)
}

// pollInterval is short: readiness is usually a matter of seconds.
const pollInterval = 50 * time.Millisecond

// waitReady polls ready until it succeeds, p exits or the start timeout
// passes. On failure it stops p and returns an error with the end of its log.
func (c *Cluster) waitReady(p *Process, ready func() error) error {
	var last error
	if wait.PollUntilContextTimeout(context.Background(), pollInterval, c.opts.StartTimeout, true, func(context.Context) (bool, error) {
		if last = ready(); last == nil {
			return true, nil
		}
		if p.Exited() {
			last = fmt.Errorf("%w (%v)", errExited, p.waitErr)
			return false, last
		}
		return false, nil
	}) == nil {
		return nil
	}
	p.Stop(stopGrace)
	return fmt.Errorf("%s did not become ready: %v\n%s", p.name, last, p.LogTail(dumpBytes))
}

// checkOK GETs url and wants status 200 with want in the body.
func checkOK(client *http.Client, url, token, want string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

func (c *Cluster) writeKubeconfig() error {
	c.kubeconfig = filepath.Join(c.dir, "kubeconfig")
	if err := c.WriteKubeconfig(c.kubeconfig, c.apiserverURL()); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	// Load it back, so that the clients and kubectl read the same file.
	restConfig, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	if err != nil {
		return fmt.Errorf("load kubeconfig: %w", err)
	}
	restConfig.QPS = -1 // negative: no client-side rate limit
	c.restConfig = restConfig
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	c.client = client
	return nil
}

// waitForKubernetesService waits until the API server has created the
// default namespace and its own Service, which also means the ClusterIP
// allocator works.
func (c *Cluster) waitForKubernetesService() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.StartTimeout)
	defer cancel()
	for {
		svc, err := c.client.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		if err == nil && svc.Spec.ClusterIP != "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the default/kubernetes Service did not appear: %v", err)
		case <-time.After(pollInterval):
		}
	}
}

// freePorts returns n distinct TCP ports that were free on 127.0.0.1 a
// moment ago. Holding all listeners open at once keeps them distinct.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// portConflict reports whether the process failed because its port was taken.
func (p *Process) portConflict() bool {
	return p != nil && strings.Contains(p.LogTail(dumpBytes), "address already in use")
}
