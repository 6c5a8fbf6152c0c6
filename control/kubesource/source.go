package kubesource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/xdproxy/xdproxy/control/changes"
	"github.com/xdproxy/xdproxy/control/health"
	"github.com/xdproxy/xdproxy/control/k8sconv"
	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/control/runner"
	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// Defaults, kube-proxy's where it has one.
const (
	DefaultQPS           = 5
	DefaultBurst         = 10
	DefaultMinSyncPeriod = time.Second
	DefaultMaxSyncPeriod = 30 * time.Second
	DefaultResyncPeriod  = 15 * time.Minute
)

// Config configures a Source.
type Config struct {
	// Kubeconfig is the path of a kubeconfig file; empty means the
	// in-cluster configuration (service account token and
	// KUBERNETES_SERVICE_HOST).
	Kubeconfig string
	// QPS and Burst limit requests to the API server; DefaultQPS and
	// DefaultBurst when zero.
	QPS   float32
	Burst int

	// NodeName is this node's name; endpoints with this nodeName are local
	// and the Node object of this name gives zone and addresses. Required.
	NodeName string
	// NodeZone is used when the Node object has no
	// topology.kubernetes.io/zone label (or does not exist).
	NodeZone string
	// NodeAddresses, when not nil, are the addresses NodePorts listen on,
	// instead of the Node object's InternalIP and ExternalIP addresses.
	NodeAddresses []packet.Addr
	// NodePortAddresses keeps only node addresses inside these prefixes;
	// empty keeps all.
	NodePortAddresses []netip.Prefix

	// ProxyName is the service-proxy-name label value we serve
	// (k8sconv.DefaultProxyName when empty).
	ProxyName string
	// DefaultScheduler applies to services without the
	// xdproxy.io/scheduler annotation (zero: service.Random).
	DefaultScheduler service.Scheduler

	// MinSyncPeriod and MaxSyncPeriod bound how often the model is rebuilt:
	// at most once per MinSyncPeriod, and at least once per MaxSyncPeriod
	// (a rebuild with no change publishes nothing).
	MinSyncPeriod, MaxSyncPeriod time.Duration
	// ResyncPeriod is the informers' resync period; DefaultResyncPeriod
	// when zero, negative disables it.
	ResyncPeriod time.Duration

	Logger  *slog.Logger     // slog.Default() when nil
	Metrics *metrics.Metrics // nil records nothing
	Clock   runner.Clock     // runner.RealClock when nil
	// Health hears about queued and published changes with kube-proxy's
	// rules (see Health); nil tells no one.
	Health Health
}

// Health is told what the /healthz rule needs, as kube-proxy's proxier
// tells its ProxyHealthServer: QueuedUpdate when an informer event leaves
// a change to publish (once the initial lists are in; the exact rules are
// in the package documentation), and Updated when Run starts and after
// every successful publish. A failed
// publish calls neither, so a change that cannot be published makes
// /healthz fail once it has waited the health timeout. *health.Proxy
// implements it.
type Health interface {
	QueuedUpdate()
	Updated()
}

// RESTConfig returns the client configuration for kubeconfig (in-cluster
// when empty) with qps and burst applied.
func RESTConfig(kubeconfig string, qps float32, burst int) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("kubesource: client configuration: %w", err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	if cfg.QPS == 0 {
		cfg.QPS = DefaultQPS
	}
	if cfg.Burst == 0 {
		cfg.Burst = DefaultBurst
	}
	cfg.UserAgent = "xdproxy"
	return cfg, nil
}

// Source watches the API server and publishes Models.
type Source struct {
	cfg     Config
	client  kubernetes.Interface
	publish func(*service.Model) error
	log     *slog.Logger
	clock   runner.Clock
	conv    *k8sconv.Converter
	runner  *runner.Runner

	services *changes.Tracker[types.NamespacedName, *k8sconv.Service]
	slices   *changes.Tracker[k8sconv.SliceKey, *k8sconv.Slice]

	nodeMu      sync.Mutex
	node        service.Node
	nodeChanged bool
	nodeState   health.NodeState

	started time.Time   // trigger times before this are the initial list, not changes
	synced  atomic.Bool // all informers have delivered their initial lists

	// Owned by the sync loop.
	builder   *k8sconv.Builder
	published bool
	// unpublished is the latest Model, built but refused by publish; it
	// is retried (with any later changes built in) when retry allows.
	unpublished *service.Model
	triggers    []time.Time // of the changes in unpublished
	retry       *runner.Retry
}

// ErrNoNodeName is returned when Config.NodeName is empty.
var ErrNoNodeName = errors.New("kubesource: NodeName is required")

// New returns a Source for the API server that cfg.Kubeconfig (or the
// in-cluster configuration) names. publish is called from one goroutine
// with each new Model; the Model must not be modified. When publish
// returns an error the Model stays pending and is tried again after a
// growing delay (1 s doubling to 30 s), by then with every later change
// built in; see the package documentation.
func New(cfg Config, publish func(*service.Model) error) (*Source, error) {
	rc, err := RESTConfig(cfg.Kubeconfig, cfg.QPS, cfg.Burst)
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubesource: client: %w", err)
	}
	return NewForClient(client, cfg, publish)
}

// NewForClient is New with a ready client (a fake one in tests).
func NewForClient(client kubernetes.Interface, cfg Config, publish func(*service.Model) error) (*Source, error) {
	if cfg.NodeName == "" {
		return nil, ErrNoNodeName
	}
	if cfg.MinSyncPeriod == 0 {
		cfg.MinSyncPeriod = DefaultMinSyncPeriod
	}
	if cfg.MinSyncPeriod < 0 {
		cfg.MinSyncPeriod = 0
	}
	if cfg.MaxSyncPeriod <= 0 {
		cfg.MaxSyncPeriod = DefaultMaxSyncPeriod
	}
	if cfg.ResyncPeriod == 0 {
		cfg.ResyncPeriod = DefaultResyncPeriod
	}
	if cfg.ResyncPeriod < 0 {
		cfg.ResyncPeriod = 0
	}
	s := &Source{
		cfg:      cfg,
		client:   client,
		publish:  publish,
		log:      cfg.Logger,
		clock:    cfg.Clock,
		services: changes.New[types.NamespacedName](equalValue[*k8sconv.Service]),
		slices:   changes.New[k8sconv.SliceKey](equalValue[*k8sconv.Slice]),
		builder:  k8sconv.NewBuilder(),
		retry:    runner.NewRetry(0, 0, 0),
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.clock == nil {
		s.clock = runner.RealClock{}
	}
	s.conv = k8sconv.NewConverter(k8sconv.Options{ProxyName: cfg.ProxyName, DefaultScheduler: cfg.DefaultScheduler,
		Logger: s.log, Metrics: cfg.Metrics})
	s.runner = runner.New(s.sync, cfg.MinSyncPeriod, cfg.MaxSyncPeriod, s.clock)
	s.node = s.nodeFrom(nil)
	return s, nil
}

// equalValue compares converted objects; nil is "absent".
func equalValue[V any](a, b V) bool { return reflect.DeepEqual(a, b) }

// Run starts the informers and the sync loop and blocks until ctx is done.
func (s *Source) Run(ctx context.Context) error {
	s.started = s.clock.Now()
	// kube-proxy's SyncLoop does the same, "in case Sync() never
	// succeeds": /healthz then shows when the proxy started.
	if s.cfg.Health != nil {
		s.cfg.Health.Updated()
	}
	// kube-proxy leaves headless services' slices to DNS; the API server
	// filters them out. The proxy-name label can't be filtered there (an
	// absent label and our name are both fine), so the converter does it.
	noHeadless, err := labels.NewRequirement(v1.IsHeadlessService, selection.DoesNotExist, nil)
	if err != nil {
		return err
	}
	selector := labels.NewSelector().Add(*noHeadless).String()
	factory := informers.NewSharedInformerFactoryWithOptions(s.client, s.cfg.ResyncPeriod,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }))
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(s.client, s.cfg.ResyncPeriod,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", s.cfg.NodeName).String()
		}))

	svcReg, err := factory.Core().V1().Services().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.onService(nil, asService(obj)) },
		UpdateFunc: func(old, cur any) { s.onService(asService(old), asService(cur)) },
		DeleteFunc: func(obj any) { s.onService(asService(obj), nil) },
	})
	if err != nil {
		return err
	}
	sliceReg, err := factory.Discovery().V1().EndpointSlices().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.onSlice(nil, asSlice(obj)) },
		UpdateFunc: func(old, cur any) { s.onSlice(asSlice(old), asSlice(cur)) },
		DeleteFunc: func(obj any) { s.onSlice(asSlice(obj), nil) },
	})
	if err != nil {
		return err
	}
	nodeReg, err := nodeFactory.Core().V1().Nodes().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.onNode(asNode(obj)) },
		UpdateFunc: func(_, cur any) { s.onNode(asNode(cur)) },
		DeleteFunc: func(obj any) {
			if n := asNode(obj); n != nil && n.Name == s.cfg.NodeName {
				s.setNode(nil)
			}
		},
	})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	factory.Start(ctx.Done())
	nodeFactory.Start(ctx.Done())
	var wg sync.WaitGroup
	wg.Go(func() { s.runner.Loop(ctx) })
	wg.Go(func() {
		// The registrations' HasSynced, unlike the informers', also wait
		// for our handlers to have seen every listed object.
		if !cache.WaitForCacheSync(ctx.Done(), svcReg.HasSynced, sliceReg.HasSynced, nodeReg.HasSynced) {
			return
		}
		s.log.Info("kubesource: informers synced", "services", s.services.Pending(), "endpointSlices", s.slices.Pending())
		s.synced.Store(true)
		s.runner.Run()
	})
	<-ctx.Done()
	factory.Shutdown()
	nodeFactory.Shutdown()
	wg.Wait()
	return nil
}

// Synced reports whether the initial lists have all been received.
func (s *Source) Synced() bool { return s.synced.Load() }

func (s *Source) onService(old, cur *v1.Service) {
	obj := cur
	if obj == nil {
		obj = old
	}
	if obj == nil {
		return
	}
	key := types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}
	pending, _ := s.services.Update(key, s.conv.Service(old), s.conv.Service(cur), time.Time{})
	if cur == nil {
		s.conv.Forget(metrics.KindService, key.Namespace, key.Name)
	}
	s.cfg.Metrics.ServiceEvent(pending)
	// kube-proxy's OnServiceUpdate syncs while any service change is
	// pending (ServiceChangeTracker.Update returns len(items) > 0).
	s.requestSync(pending > 0)
}

func (s *Source) onSlice(old, cur *discovery.EndpointSlice) {
	obj := cur
	if obj == nil {
		obj = old
	}
	if obj == nil {
		return
	}
	key := k8sconv.SliceKey{Namespace: obj.Namespace, Name: obj.Name}
	var trigger time.Time
	if cur != nil {
		// A deleted slice's annotation dates from its last update, not the
		// deletion; like kube-proxy, measure only updates.
		trigger = s.triggerTime(cur)
	}
	pending, changed := s.slices.Update(key, s.conv.EndpointSlice(old), s.conv.EndpointSlice(cur), trigger)
	if cur == nil {
		s.conv.Forget(metrics.KindEndpointSlice, key.Namespace, key.Name)
	}
	s.cfg.Metrics.EndpointEvent(pending)
	// kube-proxy's OnEndpointSliceUpdate syncs only when this event changed
	// the slice (EndpointsChangeTracker.EndpointSliceUpdate).
	s.requestSync(changed)
}

func (s *Source) triggerTime(es *discovery.EndpointSlice) time.Time {
	v, ok := es.Annotations[v1.EndpointsLastChangeTriggerTime]
	if !ok {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil || !t.After(s.started) {
		return time.Time{}
	}
	return t
}

func (s *Source) onNode(n *v1.Node) {
	if n == nil || n.Name != s.cfg.NodeName {
		return // the field selector already asks for ours only
	}
	s.setNode(n)
}

// ToBeDeletedTaint is the taint the cluster autoscaler puts on a node it is
// about to delete; kube-proxy's node eligibility looks for it.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// NodeState reports this node's Node as last seen: Known once it has been
// seen (false again after it is deleted), Deleting while it has a deletion
// timestamp or the ToBeDeletedByClusterAutoscaler taint (kube-proxy's
// NodeEligible rule). It is safe for concurrent use.
func (s *Source) NodeState() health.NodeState {
	s.nodeMu.Lock()
	defer s.nodeMu.Unlock()
	return s.nodeState
}

func nodeStateOf(n *v1.Node) health.NodeState {
	if n == nil {
		return health.NodeState{}
	}
	st := health.NodeState{Known: true, Deleting: !n.DeletionTimestamp.IsZero()}
	for _, t := range n.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			st.Deleting = true
		}
	}
	return st
}

func (s *Source) setNode(n *v1.Node) {
	node := s.nodeFrom(n)
	state := nodeStateOf(n)
	s.nodeMu.Lock()
	s.nodeState = state
	changed := !reflect.DeepEqual(node, s.node)
	if changed {
		s.node = node
		s.nodeChanged = true
	}
	s.nodeMu.Unlock()
	if changed {
		s.requestSync(true) // kube-proxy's OnTopologyChange syncs
	}
}

// nodeFrom builds the model's Node from the Node object (nil: unknown).
func (s *Source) nodeFrom(n *v1.Node) service.Node {
	node := service.Node{Name: s.cfg.NodeName, Zone: s.cfg.NodeZone}
	if n != nil {
		if z := n.Labels[v1.LabelTopologyZone]; z != "" {
			node.Zone = z
		}
	}
	candidates := s.cfg.NodeAddresses
	if candidates == nil && n != nil {
		for _, a := range n.Status.Addresses {
			if a.Type != v1.NodeInternalIP && a.Type != v1.NodeExternalIP {
				continue
			}
			ip, err := netip.ParseAddr(a.Address)
			if err != nil {
				s.log.Warn("kubesource: Node address ignored", "node", n.Name, "address", a.Address, "err", err)
				continue
			}
			candidates = append(candidates, packet.AddrFromNetip(ip.Unmap()))
		}
	}
	for _, a := range candidates {
		if len(s.cfg.NodePortAddresses) > 0 && !inPrefixes(a, s.cfg.NodePortAddresses) {
			continue
		}
		if !containsAddr(node.Addresses, a) {
			node.Addresses = append(node.Addresses, a)
		}
	}
	return node
}

func inPrefixes(a packet.Addr, ps []netip.Prefix) bool {
	ip := a.Netip()
	for _, p := range ps {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

func containsAddr(list []packet.Addr, a packet.Addr) bool {
	for _, b := range list {
		if a == b {
			return true
		}
	}
	return false
}

// requestSync asks for a sync when an event calls for one, as kube-proxy's
// event handlers do: `if tracker.Update(...) && isInitialized() { Sync() }`,
// where Sync tells the health server an update is queued.
func (s *Source) requestSync(needed bool) {
	if needed && s.synced.Load() {
		if s.cfg.Health != nil {
			s.cfg.Health.QueuedUpdate()
		}
		s.runner.Run()
	}
}

// sync runs on the runner's goroutine: it applies the pending changes to
// the builder and publishes the new Model. After a failed publish it waits
// for the retry's time, leaving new changes in the trackers; the retry
// then builds them into the Model it publishes.
func (s *Source) sync() {
	if !s.synced.Load() {
		return // a periodic run before the initial lists are in
	}
	start := s.clock.Now()
	if wait := s.retry.Wait(start); wait > 0 {
		s.runner.RetryAfter(wait) // this run was asked for by an event or the period
		return
	}
	svcChanges, _ := s.services.Checkout()
	sliceChanges, triggers := s.slices.Checkout()
	s.nodeMu.Lock()
	node, nodeChanged := s.node, s.nodeChanged
	s.nodeChanged = false
	s.nodeMu.Unlock()
	s.cfg.Metrics.SetPending(s.services.Pending(), s.slices.Pending())

	changed := len(svcChanges) > 0 || len(sliceChanges) > 0 || nodeChanged
	model := s.unpublished
	if changed || (model == nil && !s.published) {
		for key, c := range svcChanges {
			s.builder.SetService(key, c.Current)
		}
		for key, c := range sliceChanges {
			s.builder.SetSlice(key, c.Current)
		}
		model = s.builder.Model(node)
	}
	if model == nil {
		return // nothing changed since the last publish
	}
	s.triggers = append(s.triggers, triggers...)
	if err := s.publish(model); err != nil {
		s.unpublished = model
		s.cfg.Metrics.PublishFailed()
		delay, log := s.retry.Failed(s.clock.Now())
		if log {
			s.log.Error("kubesource: publishing the service model failed; the current one stays, retrying",
				"err", err, "failures", s.retry.Failures(), "retryIn", delay)
		}
		s.runner.RetryAfter(delay)
		return
	}
	end := s.clock.Now()
	s.unpublished = nil
	s.published = true
	s.cfg.Metrics.ObserveSync(start, end, s.triggers)
	s.triggers = nil
	if n := s.retry.Succeeded(); n > 0 {
		s.log.Info(fmt.Sprintf("kubesource: publishing recovered after %d failures", n), "failures", n)
	}
	if s.cfg.Health != nil {
		s.cfg.Health.Updated()
	}
	s.log.Debug("kubesource: published", "servicePorts", len(model.Ports), "serviceChanges", len(svcChanges),
		"sliceChanges", len(sliceChanges), "took", end.Sub(start))
}

// The informers hand over *T, or a tombstone when a delete was missed
// during a watch gap.

func asService(obj any) *v1.Service {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	svc, _ := obj.(*v1.Service)
	return svc
}

func asSlice(obj any) *discovery.EndpointSlice {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	es, _ := obj.(*discovery.EndpointSlice)
	return es
}

func asNode(obj any) *v1.Node {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	n, _ := obj.(*v1.Node)
	return n
}
