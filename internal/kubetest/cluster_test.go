package kubetest

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

const manifest = `
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  type: ClusterIP
  ports:
  - name: http
    protocol: TCP
    port: 80
    targetPort: 8080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  protocol: TCP
  port: 8080
endpoints:
- addresses: ["198.18.0.10"]
  conditions: {ready: true}
- addresses: ["198.18.0.11"]
  conditions: {ready: false}
`

func TestApplyReadBackAndRestart(t *testing.T) {
	c := Start(t, Options{})
	ctx := context.Background()

	path := filepath.Join(t.TempDir(), "web.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := c.Kubectl("apply", "-f", path)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"service/web created", "endpointslice.discovery.k8s.io/web-1 created"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("kubectl apply said %q, want it to contain %q", out, want)
		}
	}

	svc, err := c.Client().CoreV1().Services("default").Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ip, err := netip.ParseAddr(svc.Spec.ClusterIP)
	if err != nil || !c.ServiceCIDR().Contains(ip) {
		t.Fatalf("ClusterIP %q is not in %v", svc.Spec.ClusterIP, c.ServiceCIDR())
	}
	if got := svc.Spec.Ports; len(got) != 1 || got[0].Port != 80 || got[0].TargetPort.IntValue() != 8080 || got[0].Protocol != corev1.ProtocolTCP {
		t.Errorf("Service ports = %+v, want 80/TCP -> 8080", got)
	}
	// kubectl and client-go must see the same object.
	jsonpathIP, err := c.Kubectl("get", "service", "web", "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		t.Fatal(err)
	}
	if string(jsonpathIP) != svc.Spec.ClusterIP {
		t.Errorf("kubectl sees ClusterIP %q, client-go %q", jsonpathIP, svc.Spec.ClusterIP)
	}
	slice := getSlice(t, c.Client(), "web-1")
	checkSlice(t, slice)

	// RBAC is on: neither an anonymous client nor a user without roles may
	// list Services.
	for name, cfg := range map[string]*rest.Config{
		"anonymous":    rest.AnonymousClientConfig(c.RESTConfig()),
		"unprivileged": c.UnprivilegedRESTConfig(),
	} {
		_, err = kubernetes.NewForConfigOrDie(cfg).CoreV1().Services("default").List(ctx, metav1.ListOptions{})
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s list of Services: err = %v, want Forbidden", name, err)
		}
	}

	restartStarted := time.Now()
	c.StopAPIServer()
	if _, err := c.Client().CoreV1().Services("default").Get(ctx, "web", metav1.GetOptions{}); err == nil {
		t.Fatal("Get succeeded while kube-apiserver was stopped")
	}
	c.StartAPIServer()
	t.Logf("kube-apiserver stop and restart took %v", time.Since(restartStarted).Round(time.Millisecond))

	// The same client keeps working and the objects come back from etcd.
	again, err := c.Client().CoreV1().Services("default").Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if again.UID != svc.UID || again.Spec.ClusterIP != svc.Spec.ClusterIP {
		t.Errorf("after restart: Service uid %s ClusterIP %s, want uid %s ClusterIP %s",
			again.UID, again.Spec.ClusterIP, svc.UID, svc.Spec.ClusterIP)
	}
	sliceAgain := getSlice(t, c.Client(), "web-1")
	if sliceAgain.UID != slice.UID {
		t.Errorf("after restart: EndpointSlice uid %s, want %s", sliceAgain.UID, slice.UID)
	}
	checkSlice(t, sliceAgain)
	if _, err := c.Kubectl("get", "endpointslice", "web-1"); err != nil {
		t.Errorf("kubectl after restart: %v", err)
	}
}

func getSlice(t *testing.T, client kubernetes.Interface, name string) *discoveryv1.EndpointSlice {
	t.Helper()
	slice, err := client.DiscoveryV1().EndpointSlices("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return slice
}

func checkSlice(t *testing.T, slice *discoveryv1.EndpointSlice) {
	t.Helper()
	if got := slice.Labels[discoveryv1.LabelServiceName]; got != "web" {
		t.Errorf("EndpointSlice service-name label = %q, want web", got)
	}
	var addrs []string
	var ready []bool
	for _, ep := range slice.Endpoints {
		addrs = append(addrs, ep.Addresses...)
		ready = append(ready, ep.Conditions.Ready != nil && *ep.Conditions.Ready)
	}
	if !slices.Equal(addrs, []string{"198.18.0.10", "198.18.0.11"}) || !slices.Equal(ready, []bool{true, false}) {
		t.Errorf("EndpointSlice endpoints %v ready %v, want [198.18.0.10 198.18.0.11] [true false]", addrs, ready)
	}
	if len(slice.Ports) != 1 || slice.Ports[0].Port == nil || *slice.Ports[0].Port != 8080 {
		t.Errorf("EndpointSlice ports = %+v, want one port 8080", slice.Ports)
	}
}

// An informer started before the restart must resume its watch afterwards and
// deliver objects created then: that is what xdproxy's control loop relies on.
func TestInformerSurvivesAPIServerRestart(t *testing.T) {
	c := Start(t, Options{})
	factory := informers.NewSharedInformerFactory(c.Client(), 0)
	sliceInformer := factory.Discovery().V1().EndpointSlices()
	informer := sliceInformer.Informer()
	stop := make(chan struct{})
	t.Cleanup(func() {
		close(stop)
		factory.Shutdown()
	})
	factory.Start(stop)
	if !cache.WaitForCacheSync(stop, informer.HasSynced) {
		t.Fatal("EndpointSlice informer did not sync")
	}

	c.StopAPIServer()
	c.StartAPIServer()
	restarted := time.Now()

	ready := true
	created := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:   "after-restart",
			Labels: map[string]string{discoveryv1.LabelServiceName: "web"},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{
			Addresses:  []string{"198.18.0.20"},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready},
		}},
	}
	if _, err := c.Client().DiscoveryV1().EndpointSlices("default").Create(context.Background(), created, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// client-go backs off before rewatching; allow for it.
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		_, err := sliceInformer.Lister().EndpointSlices("default").Get("after-restart")
		return err == nil, nil
	}); err != nil {
		t.Fatal("the informer did not see an EndpointSlice created after the API server restart")
	}
	t.Logf("the informer saw the new EndpointSlice %v after the restart", time.Since(restarted).Round(time.Millisecond))
}

// kube-apiserver turns anonymous access off under AlwaysAllow, so the check
// uses the unprivileged user.
func TestAlwaysAllowLetsUnprivilegedUserIn(t *testing.T) {
	c := Start(t, Options{Authorization: AlwaysAllow})
	user := kubernetes.NewForConfigOrDie(c.UnprivilegedRESTConfig())
	if _, err := user.CoreV1().Services("default").List(context.Background(), metav1.ListOptions{}); err != nil {
		t.Errorf("unprivileged list of Services under AlwaysAllow: %v", err)
	}
}

func TestMissingBinarySaysHowToBuild(t *testing.T) {
	t.Setenv(BinDirEnv, t.TempDir())
	_, err := Binary("kube-apiserver")
	if err == nil || !strings.Contains(err.Error(), "make kube-tools") {
		t.Fatalf("Binary of an empty directory: err = %v, want one that mentions make kube-tools", err)
	}
}

func TestRepoRootIsTheProjectModule(t *testing.T) {
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if got := modulePath(filepath.Join(root, "go.mod")); got != projectModule {
		t.Fatalf("repoRoot %s has module %q, want %q", root, got, projectModule)
	}
	if _, err := os.Stat(filepath.Join(root, "internal", "kubetest")); err != nil {
		t.Fatalf("repoRoot %s does not hold internal/kubetest: %v", root, err)
	}
}
