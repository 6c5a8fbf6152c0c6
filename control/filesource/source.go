package filesource

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/xdproxy/xdproxy/control/k8sconv"
	"github.com/xdproxy/xdproxy/control/metrics"
	"github.com/xdproxy/xdproxy/control/runner"
	"github.com/xdproxy/xdproxy/dataplane/service"
)

// DefaultPollInterval is how often the file is checked for changes.
const DefaultPollInterval = time.Second

// Config configures a Source.
type Config struct {
	// Path is the services file.
	Path string
	// Node is this node; the file does not describe it.
	Node service.Node
	// ProxyName is the service-proxy-name label value we serve
	// (k8sconv.DefaultProxyName when empty).
	ProxyName string
	// DefaultScheduler applies to services without the
	// xdproxy.io/scheduler annotation (zero: service.Random).
	DefaultScheduler service.Scheduler
	// PollInterval is how often the file is checked (DefaultPollInterval
	// when zero). A change is applied once the file has stayed the same
	// for one interval, so a half-written file is not loaded.
	PollInterval time.Duration
	Logger       *slog.Logger     // slog.Default() when nil
	Metrics      *metrics.Metrics // nil records nothing
	// Clock times the polls and the retries of a failed publish
	// (runner.RealClock when nil).
	Clock runner.Clock
	// Health hears about queued and published changes with kube-proxy's
	// rules (see Health); nil tells no one.
	Health Health
}

// Health is told what the /healthz rule needs, as kube-proxy's proxier
// tells its ProxyHealthServer: Updated when Run starts and after every
// successful publish, QueuedUpdate when a changed file yields a new Model
// (not for the first load, which is kube-proxy's initial sync). A failed
// publish calls neither, so a change that cannot be published makes
// /healthz fail once it has waited the health timeout. *health.Proxy
// implements it.
type Health interface {
	QueuedUpdate()
	Updated()
}

// Source publishes the Model described by a file, and a new one whenever
// the file changes.
type Source struct {
	cfg     Config
	publish func(*service.Model) error
	log     *slog.Logger
	clock   runner.Clock

	// Owned by the goroutine that polls.
	published bool
	loaded    bool           // a Model has been built (published or not)
	pending   *service.Model // the latest Model, not published: the last try failed
	retry     *runner.Retry
	read      bool              // applied is set
	recheck   bool              // applied is too recent to trust; hash again
	applied   fileStamp         // the file as last read (used or not)
	candidate fileStamp         // a change seen, waiting to settle
	sum       [sha256.Size]byte // of the content last processed (published or rejected)
	processed bool
	lastErr   string
}

// fileStamp identifies one version of the file. The inode catches an
// editor that writes a new file and renames it over the old one.
type fileStamp struct {
	dev, ino uint64
	size     int64
	mtime    int64
	ctime    int64
}

// ErrNoPath is returned when Config.Path is empty.
var ErrNoPath = errors.New("filesource: Path is required")

// New returns a Source for cfg. publish is called from the goroutine that
// runs Run; the Model must not be modified. When publish returns an error
// the Model stays pending and is tried again after a growing delay (1 s
// doubling to 30 s); a file changed meanwhile replaces it and waits for
// the same retry.
func New(cfg Config, publish func(*service.Model) error) (*Source, error) {
	if cfg.Path == "" {
		return nil, ErrNoPath
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	s := &Source{cfg: cfg, publish: publish, log: cfg.Logger, clock: cfg.Clock, retry: runner.NewRetry(0, 0, 0)}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.clock == nil {
		s.clock = runner.RealClock{}
	}
	return s, nil
}

// Run loads the file, then polls it until ctx is done. A file that is
// missing or unreadable at start is waited for; one that becomes
// unreadable later leaves the last Model in force. A Model that publish
// refused is retried on its own timer, between polls.
func (s *Source) Run(ctx context.Context) error {
	// kube-proxy's SyncLoop does the same, "in case Sync() never
	// succeeds": /healthz then shows when the proxy started.
	if s.cfg.Health != nil {
		s.cfg.Health.Updated()
	}
	s.poll()
	poll := s.clock.NewTimer(s.cfg.PollInterval)
	defer poll.Stop()
	retry := s.clock.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		if wait, ok := s.retryIn(); ok {
			retry.Reset(max(wait, 0))
		} else {
			retry.Stop()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-poll.C():
			s.poll()
			poll.Reset(s.cfg.PollInterval)
		case <-retry.C():
			s.retryPublish()
		}
	}
}

// retryIn reports whether a refused Model waits, and how long until its
// retry is due.
func (s *Source) retryIn() (time.Duration, bool) {
	if s.pending == nil {
		return 0, false
	}
	return s.retry.Wait(s.clock.Now()), true
}

// retryPublish tries the pending Model again if its time has come.
func (s *Source) retryPublish() {
	if s.pending != nil && s.retry.Wait(s.clock.Now()) <= 0 {
		s.tryPublish(s.clock.Now())
	}
}

// offer makes model, built from a changed file, the one to publish: at
// once, or, while backing off after a failure, at the retry's time.
func (s *Source) offer(model *service.Model, start time.Time) {
	if s.loaded && s.cfg.Health != nil {
		s.cfg.Health.QueuedUpdate()
	}
	s.loaded = true
	s.pending = model
	if s.retry.Wait(s.clock.Now()) > 0 {
		return // joins the retry
	}
	s.tryPublish(start)
}

// tryPublish publishes the pending Model; a sync that began at start.
func (s *Source) tryPublish(start time.Time) {
	model := s.pending
	if err := s.publish(model); err != nil {
		s.cfg.Metrics.PublishFailed()
		delay, log := s.retry.Failed(s.clock.Now())
		if log {
			s.log.Error("filesource: publishing the service model failed; the current one stays, retrying",
				"file", s.cfg.Path, "err", err, "failures", s.retry.Failures(), "retryIn", delay)
		}
		return
	}
	s.pending = nil
	s.published = true
	s.cfg.Metrics.ObserveSync(start, s.clock.Now(), nil)
	if n := s.retry.Succeeded(); n > 0 {
		s.log.Info(fmt.Sprintf("filesource: publishing recovered after %d failures", n), "file", s.cfg.Path, "failures", n)
	}
	if s.cfg.Health != nil {
		s.cfg.Health.Updated()
	}
	s.log.Info("filesource: loaded", "file", s.cfg.Path, "servicePorts", len(model.Ports))
}

func stamp(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	st := fileStamp{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.dev, st.ino = uint64(sys.Dev), sys.Ino
		st.ctime = sys.Ctim.Nano()
	}
	return st, nil
}

// poll checks the file once and publishes a new Model if it changed.
func (s *Source) poll() {
	st, err := stamp(s.cfg.Path)
	if err != nil {
		s.readFailed(err)
		return
	}
	if s.read && st == s.applied && !s.recheck {
		return
	}
	if s.published && st != s.candidate {
		// Wait one interval: an editor or a copy may still be writing.
		// (Until something is published there is nothing to protect.)
		s.candidate = st
		return
	}
	data, err := os.ReadFile(s.cfg.Path)
	if err != nil {
		s.readFailed(err)
		return
	}
	if st2, err := stamp(s.cfg.Path); err != nil || st2 != st {
		s.candidate = st2 // changed while we read; try again next time
		return
	}
	s.lastErr = ""
	s.applied, s.candidate, s.read = st, st, true
	// File times are coarse (a clock tick): a write of the same size
	// within the same tick would leave the stamp as it is. Until the stamp
	// is safely in the past, compare contents again on the next poll.
	s.recheck = time.Since(time.Unix(0, st.mtime)) < time.Second
	sum := sha256.Sum256(data)
	if s.processed && sum == s.sum {
		return // touched, or read again; not changed
	}
	s.sum, s.processed = sum, true
	start := s.clock.Now()
	model, ok := s.build(data)
	if !ok {
		return
	}
	s.offer(model, start)
}

// readFailed logs a read error once until the file reads again. The
// published Model stays: a missing or unreadable file is no reason to stop
// forwarding.
func (s *Source) readFailed(err error) {
	if msg := err.Error(); msg != s.lastErr {
		s.lastErr = msg
		s.log.Warn("filesource: cannot read the services file; keeping the current model", "file", s.cfg.Path, "err", err)
	}
}

// build parses data and builds its Model. It returns false when no
// document was usable although some were present: a file broken as a
// whole (a bad merge, the wrong file) should not wipe every service.
func (s *Source) build(data []byte) (*service.Model, bool) {
	objs, problems := Parse(data)
	for _, p := range problems {
		s.log.Warn("filesource: document skipped", "file", s.cfg.Path, "document", p.Document, "item", p.Item,
			"line", p.Line, "err", p.Err)
	}
	if len(objs.Services) == 0 && len(objs.EndpointSlices) == 0 && len(problems) > 0 {
		s.log.Error("filesource: no usable document; keeping the current model", "file", s.cfg.Path)
		return nil, false
	}
	// A fresh converter per load: problems are logged again for each
	// version of the file, which is when someone is looking.
	conv := k8sconv.NewConverter(k8sconv.Options{ProxyName: s.cfg.ProxyName, DefaultScheduler: s.cfg.DefaultScheduler,
		Logger: s.log, Metrics: s.cfg.Metrics})
	b := k8sconv.NewBuilder()
	seenServices := make(map[types.NamespacedName]bool)
	for _, svc := range objs.Services {
		key := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
		if seenServices[key] {
			s.log.Warn("filesource: Service given twice; the later one wins", "file", s.cfg.Path, "service", key.String())
		}
		seenServices[key] = true
		b.SetService(key, conv.Service(svc))
	}
	seenSlices := make(map[k8sconv.SliceKey]bool)
	for _, es := range objs.EndpointSlices {
		key := k8sconv.SliceKey{Namespace: es.Namespace, Name: es.Name}
		if seenSlices[key] {
			s.log.Warn("filesource: EndpointSlice given twice; the later one wins", "file", s.cfg.Path,
				"endpointSlice", key.Namespace+"/"+key.Name)
		}
		seenSlices[key] = true
		b.SetSlice(key, conv.EndpointSlice(es))
	}
	return b.Model(s.cfg.Node), true
}
