package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// The version of the file format this package reads. A file names it in its
// first two fields, the way a KubeProxyConfiguration does.
const (
	APIVersion = "xdproxy.io/v1alpha1"
	Kind       = "XDProxyConfiguration"
)

// The types below are the file as written: strings where the typed Config
// holds parsed values, pointers where leaving a field out must differ from
// writing its zero value (an absent batchSize takes the default, an explicit
// 0 is an error). Their json tags are the file's field names. Nothing outside
// this package sees them: Parse turns them into a Config.

type fileV1alpha1 struct {
	APIVersion         string           `json:"apiVersion"`
	Kind               string           `json:"kind"`
	NodeName           string           `json:"nodeName"`
	NodeZone           string           `json:"nodeZone,omitempty"`
	Interfaces         []fileInterface  `json:"interfaces"`
	ExceptionInterface string           `json:"exceptionInterface,omitempty"`
	Services           fileServices     `json:"services"`
	ClusterCIDR        string           `json:"clusterCIDR,omitempty"`
	NodePortAddresses  []string         `json:"nodePortAddresses,omitempty"`
	Masquerade         fileMasquerade   `json:"masquerade"`
	Conntrack          fileConntrack    `json:"conntrack"`
	Scheduler          string           `json:"scheduler,omitempty"`
	MetricsAddress     string           `json:"metricsAddress,omitempty"`
	HealthzAddress     string           `json:"healthzAddress,omitempty"`
	AdminSocket        string           `json:"adminSocket,omitempty"`
	StateDir           string           `json:"stateDir,omitempty"`
	BPFFSDir           string           `json:"bpffsDir,omitempty"`
	LocalClients       fileLocalClients `json:"localClients"`
	BusyPoll           bool             `json:"busyPoll,omitempty"`
	BatchSize          *int             `json:"batchSize,omitempty"`
	XDPTables          fileXDPTables    `json:"xdpTables"`
	Benchmark          fileBenchmark    `json:"benchmark"`
}

// fileBenchmark is for benchmarking only: ioFloor forwards every frame
// untranslated.
type fileBenchmark struct {
	IOFloor     bool   `json:"ioFloor,omitempty"`
	IOFloorPeer string `json:"ioFloorPeer,omitempty"`
}

type fileLocalClients struct {
	// Enabled: nil means on.
	Enabled *bool  `json:"enabled,omitempty"`
	Cgroup  string `json:"cgroup,omitempty"`
}

type fileInterface struct {
	Name string `json:"name"`
	// Queues and CPUs: absent (nil) means every queue and every usable
	// CPU; an explicit empty list is an error.
	Queues             []int  `json:"queues"`
	CPUs               []int  `json:"cpus"`
	XDPMode            string `json:"xdpMode,omitempty"`
	BindMode           string `json:"bindMode,omitempty"`
	FrameSize          *int   `json:"frameSize,omitempty"`
	NumFrames          *int   `json:"numFrames,omitempty"`
	RxRingSize         *int   `json:"rxRingSize,omitempty"`
	TxRingSize         *int   `json:"txRingSize,omitempty"`
	FillRingSize       *int   `json:"fillRingSize,omitempty"`
	CompletionRingSize *int   `json:"completionRingSize,omitempty"`
}

type fileServices struct {
	File       string          `json:"file,omitempty"`
	Kubernetes *fileKubernetes `json:"kubernetes,omitempty"`
}

type fileKubernetes struct {
	Kubeconfig    string    `json:"kubeconfig,omitempty"`
	APIServer     string    `json:"apiServer,omitempty"`
	QPS           *float32  `json:"qps,omitempty"`
	Burst         *int      `json:"burst,omitempty"`
	MinSyncPeriod *duration `json:"minSyncPeriod,omitempty"`
	MaxSyncPeriod *duration `json:"maxSyncPeriod,omitempty"`
	ProxyName     string    `json:"proxyName,omitempty"`
}

type fileMasquerade struct {
	Address      string `json:"address,omitempty"`
	PortRange    string `json:"portRange,omitempty"`
	All          bool   `json:"all,omitempty"`
	ReservePorts bool   `json:"reservePorts,omitempty"`
}

type fileConntrack struct {
	MaxEntries         *int      `json:"maxEntries,omitempty"`
	TCPSynSent         *duration `json:"tcpSynSentTimeout,omitempty"`
	TCPSynRecv         *duration `json:"tcpSynRecvTimeout,omitempty"`
	TCPEstablished     *duration `json:"tcpEstablishedTimeout,omitempty"`
	TCPFinWait         *duration `json:"tcpFinWaitTimeout,omitempty"`
	TCPCloseWait       *duration `json:"tcpCloseWaitTimeout,omitempty"`
	TCPLastAck         *duration `json:"tcpLastAckTimeout,omitempty"`
	TCPTimeWait        *duration `json:"tcpTimeWaitTimeout,omitempty"`
	TCPClose           *duration `json:"tcpCloseTimeout,omitempty"`
	UDPUnreplied       *duration `json:"udpTimeout,omitempty"`
	UDPReplied         *duration `json:"udpStreamTimeout,omitempty"`
	ICMP               *duration `json:"icmpTimeout,omitempty"`
	FragmentTimeout    *duration `json:"fragmentTimeout,omitempty"`
	FragmentMaxEntries *int      `json:"fragmentMaxEntries,omitempty"`
	SYNGuard           *bool     `json:"synGuard,omitempty"`
}

type fileXDPTables struct {
	MaxFrontends *int `json:"maxFrontends,omitempty"`
	MaxAddresses *int `json:"maxAddresses,omitempty"`
}

// duration is a time.Duration written as a Go duration string ("1m30s") or
// a number of seconds.
type duration struct{ time.Duration }

// parseDuration is the one parser of duration values, used by both
// UnmarshalJSON and the decoding check.
func parseDuration(v any) (time.Duration, error) {
	switch v := v.(type) {
	case string:
		d, err := time.ParseDuration(v)
		if err != nil {
			return 0, fmt.Errorf("%q is not a duration; want one like 30s or 1m30s, or a number of seconds", v)
		}
		return d, nil
	case json.Number:
		secs, err := v.Float64()
		if err != nil || math.Abs(secs) > math.MaxInt64/float64(time.Second) {
			return 0, fmt.Errorf("%s is not a duration: out of range", v)
		}
		return time.Duration(secs * float64(time.Second)), nil
	}
	return 0, fmt.Errorf("%s is not a duration; want one like 30s or 1m30s, or a number of seconds", describe(v))
}

// UnmarshalJSON accepts "1m30s" or a number of seconds.
func (d *duration) UnmarshalJSON(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return err
	}
	x, err := parseDuration(v)
	if err != nil {
		return err
	}
	d.Duration = x
	return nil
}

// MarshalJSON writes the duration string.
func (d duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

var durationType = reflect.TypeFor[duration]()

// decode reads a file into f. It checks the version first, then every
// field's type and name against fileV1alpha1, so that an unknown or
// mistyped field is reported with its full path (services.fiel,
// interfaces[1].queues[0]) and all of them at once, which a JSON decoder's
// first-error-only message does not do.
func decode(b []byte, f *fileV1alpha1) error {
	j, err := yaml.YAMLToJSONStrict(b)
	if err != nil {
		return fmt.Errorf("decoding: %s", strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "))
	}
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return fmt.Errorf("decoding: %v", err)
	}
	if tree == nil {
		tree = map[string]any{} // an empty file: report what it lacks
	}
	top, ok := tree.(map[string]any)
	if !ok {
		return fmt.Errorf("decoding: the file is %s, want a mapping of fields", describe(tree))
	}
	var errs Errors
	checkVersion(top, &errs)
	if len(errs) > 0 {
		// Another version's fields are not this version's: say only that.
		return errs
	}
	checkTree(top, reflect.TypeFor[fileV1alpha1](), "", &errs)
	if len(errs) > 0 {
		return errs
	}
	if err := yaml.UnmarshalStrict(b, f); err != nil {
		// checkTree should have caught it; report it anyway.
		s := err.Error()
		for _, p := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: "} {
			s = strings.TrimPrefix(s, p)
		}
		return errors.New("decoding: " + s)
	}
	return nil
}

func checkVersion(top map[string]any, errs *Errors) {
	for _, m := range []struct{ field, want string }{{"apiVersion", APIVersion}, {"kind", Kind}} {
		switch v := top[m.field].(type) {
		case nil:
			errs.add(m.field, "required; want %s", m.want)
		case string:
			if v == "" {
				errs.add(m.field, "required; want %s", m.want)
			} else if v != m.want {
				errs.add(m.field, "%q is not supported; want %s", v, m.want)
			}
		default:
			errs.add(m.field, "%s is not supported; want %s", describe(v), m.want)
		}
	}
}

// checkTree walks a decoded JSON value along the Go type it will be
// decoded into and reports unknown fields and values of the wrong type.
// YAML null is the same as leaving the field out.
func checkTree(v any, t reflect.Type, path string, errs *Errors) {
	if v == nil {
		return
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == durationType {
		if _, err := parseDuration(v); err != nil {
			errs.add(path, "%v", err)
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			errs.add(path, "%s, want a mapping of fields", describe(v))
			return
		}
		fields := jsonFields(t)
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			sub := k
			if path != "" {
				sub = path + "." + k
			}
			f, ok := fields[k]
			if !ok {
				errs.add(sub, "unknown field")
				continue
			}
			checkTree(m[k], f.Type, sub, errs)
		}
	case reflect.Slice:
		l, ok := v.([]any)
		if !ok {
			errs.add(path, "%s, want a list", describe(v))
			return
		}
		for i, e := range l {
			checkTree(e, t.Elem(), fmt.Sprintf("%s[%d]", path, i), errs)
		}
	case reflect.String:
		// sigs.k8s.io/yaml turns a number or a boolean into the string a
		// string field asks for.
		switch v.(type) {
		case string, json.Number, bool:
		default:
			errs.add(path, "%s, want a string", describe(v))
		}
	case reflect.Int:
		n, ok := v.(json.Number)
		if !ok {
			errs.add(path, "%s, want an integer", describe(v))
		} else if _, err := strconv.ParseInt(n.String(), 10, strconv.IntSize); err != nil {
			errs.add(path, "%s, want an integer", n)
		}
	case reflect.Float32:
		n, ok := v.(json.Number)
		if !ok {
			errs.add(path, "%s, want a number", describe(v))
		} else if f, err := n.Float64(); err != nil || math.Abs(f) > math.MaxFloat32 {
			errs.add(path, "%s, want a number", n)
		}
	case reflect.Bool:
		if _, ok := v.(bool); !ok {
			errs.add(path, "%s, want true or false", describe(v))
		}
	default:
		panic(fmt.Sprintf("config: checkTree does not know %v", t))
	}
}

// jsonFields maps a struct's json field names to its fields.
func jsonFields(t reflect.Type) map[string]reflect.StructField {
	out := map[string]reflect.StructField{}
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			out[name] = f
		}
	}
	return out
}

// describe names a decoded JSON value for an error message.
func describe(v any) string {
	switch v := v.(type) {
	case string:
		return strconv.Quote(v)
	case json.Number:
		return v.String()
	case bool:
		return strconv.FormatBool(v)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%v", v)
}
