package kubeproxy

import (
	"context"
	"fmt"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
)

// applyWorkers is how many creates run at once: enough to keep the API
// server busy, few enough for two cores.
const applyWorkers = 8

// Apply creates the namespace and, for every service of set, the Service
// with its cluster IP and an EndpointSlice with set's endpoints, ready and
// on node: what kube-proxy would see in a cluster.
func Apply(ctx context.Context, cs kubernetes.Interface, set kernelrules.ServiceSet, node string) error {
	if err := set.Validate(); err != nil {
		return err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: set.NS()}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("namespace %s: %w", set.NS(), err)
	}
	proto := corev1.Protocol(strings.ToUpper(string(set.Proto)))
	jobs := make(chan int)
	errc := make(chan error, applyWorkers)
	var wg sync.WaitGroup
	for range applyWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				if err := applyOne(ctx, cs, set, i, proto, node); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	var err error
feed:
	for i := range set.Count {
		select {
		case jobs <- i:
		case err = <-errc:
			break feed
		}
	}
	close(jobs)
	wg.Wait()
	if err == nil {
		select {
		case err = <-errc:
		default:
		}
	}
	return err
}

func applyOne(ctx context.Context, cs kubernetes.Interface, set kernelrules.ServiceSet, i int, proto corev1.Protocol, node string) error {
	name, ns := set.Name(i), set.NS()
	epPort := int32(set.Endpoints[0].Port())
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.ServiceSpec{
			Type: corev1.ServiceTypeClusterIP, ClusterIP: set.VIP(i).String(),
			Ports: []corev1.ServicePort{{Name: "p", Protocol: proto, Port: int32(set.Port(i)), TargetPort: intstr.FromInt32(epPort)}},
		},
	}
	if _, err := cs.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("service %s/%s: %w", ns, name, err)
	}
	yes, no := true, false
	portName := "p"
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name + "-1", Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Protocol: &proto, Port: &epPort}},
	}
	for _, ep := range set.Endpoints {
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{ep.Addr().String()},
			Conditions: discoveryv1.EndpointConditions{Ready: &yes, Serving: &yes, Terminating: &no},
			NodeName:   &node,
		})
	}
	if _, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("endpointslice %s/%s: %w", ns, slice.Name, err)
	}
	return nil
}

// createNode registers the node kube-proxy runs as, with addr as its
// internal IP.
func createNode(ctx context.Context, cs kubernetes.Interface, name, addr string) error {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}},
		Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}}},
	}
	n, err := cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("node %s: %w", name, err)
	}
	// Create ignores the status; the addresses go in through the
	// subresource.
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}}
	if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("node %s status: %w", name, err)
	}
	return nil
}
