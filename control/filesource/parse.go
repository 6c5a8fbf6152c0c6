package filesource

import (
	"bytes"
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// Objects are the usable objects of a file, in file order.
type Objects struct {
	Services       []*v1.Service
	EndpointSlices []*discovery.EndpointSlice
	// Ignored counts documents of other kinds (a Deployment in the same
	// manifest), which are not errors.
	Ignored int
}

// Problem is one document (or List item) that was skipped, or a warning
// about one that was used.
type Problem struct {
	Document int // 1-based position in the file
	Item     int // 1-based position in a kind: List; 0 when not in one
	Line     int // line on which the document starts
	Err      error
}

func (p Problem) Error() string {
	if p.Item > 0 {
		return fmt.Sprintf("document %d (line %d) item %d: %v", p.Document, p.Line, p.Item, p.Err)
	}
	return fmt.Sprintf("document %d (line %d): %v", p.Document, p.Line, p.Err)
}

// decoder reads v1 and discovery.k8s.io/v1 objects from YAML or JSON, and
// rejects unknown and duplicate fields as kubectl apply does by default
// (--validate=strict).
var decoder = func() runtime.Decoder {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{v1.AddToScheme, discovery.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
}()

// Parse reads a kubectl-style file: YAML documents separated by "---"
// lines (or one JSON object), each a Service, an EndpointSlice or a
// kind: List of them. A document that cannot be used is reported and
// skipped; the others are returned. Objects without a namespace get
// "default", as kubectl would give them.
func Parse(data []byte) (Objects, []Problem) {
	var objs Objects
	var problems []Problem
	for i, doc := range splitDocuments(data) {
		report := func(item int, err error) {
			problems = append(problems, Problem{Document: i + 1, Item: item, Line: doc.line, Err: err})
		}
		obj, err := decode(doc.text)
		if err != nil {
			if runtime.IsNotRegisteredError(err) {
				objs.Ignored++
				continue
			}
			report(0, err)
			continue
		}
		if list, ok := obj.(*v1.List); ok {
			for j, raw := range list.Items {
				item, err := decode(raw.Raw)
				if err != nil {
					if runtime.IsNotRegisteredError(err) {
						objs.Ignored++
						continue
					}
					report(j+1, err)
					continue
				}
				if err := objs.add(item); err != nil {
					report(j+1, err)
				}
			}
			continue
		}
		if err := objs.add(obj); err != nil {
			report(0, err)
		}
	}
	return objs, problems
}

func decode(data []byte) (runtime.Object, error) {
	// Given YAML, the strict decoder converts it to JSON twice (the second
	// time to find duplicate fields), which was most of the time spent on
	// a large file; converting once here, as strictly, and handing it JSON
	// halves that. JSON is decoded as written.
	if !utilyaml.IsJSONBuffer(data) {
		if j, err := yaml.YAMLToJSONStrict(data); err == nil {
			obj, _, err := decoder.Decode(j, nil, nil)
			if err == nil {
				return obj, nil
			}
			if runtime.IsNotRegisteredError(err) {
				return nil, err
			}
		}
		// Bad documents are rare: decode the YAML as written, so that the
		// error reads as before (about the document as written, not its
		// JSON), and an ignored kind stays ignored even with a duplicate
		// field.
	}
	obj, _, err := decoder.Decode(data, nil, nil)
	if err != nil {
		// A strict error comes with a decoded object; kubectl refuses it
		// and so do we, so that a typo in a field name is not silently
		// ignored.
		return nil, err
	}
	return obj, nil
}

func (o *Objects) add(obj runtime.Object) error {
	switch obj := obj.(type) {
	case *v1.Service:
		if obj.Namespace == "" {
			obj.Namespace = "default"
		}
		// No API server allocates a cluster IP for a file.
		if obj.Spec.Type != v1.ServiceTypeExternalName && obj.Spec.ClusterIP == "" && len(obj.Spec.ClusterIPs) == 0 {
			//lint:ignore ST1005 the message starts with the object's kind, as Kubernetes writes it
			return fmt.Errorf("Service %s/%s: spec.clusterIP is required in a service file", obj.Namespace, obj.Name)
		}
		o.Services = append(o.Services, obj)
	case *discovery.EndpointSlice:
		if obj.Namespace == "" {
			obj.Namespace = "default"
		}
		o.EndpointSlices = append(o.EndpointSlices, obj)
	case *v1.List:
		return fmt.Errorf("a List inside a List is not supported")
	default:
		o.Ignored++
	}
	return nil
}

type document struct {
	text []byte
	line int
}

// splitDocuments splits YAML at "---" lines and drops documents that hold
// only comments and blank lines. It tracks line numbers, which
// k8s.io/apimachinery's YAML reader does not.
func splitDocuments(data []byte) []document {
	var docs []document
	var cur bytes.Buffer
	start, line := 1, 0
	meaningful := false
	flush := func(next int) {
		if meaningful {
			docs = append(docs, document{text: bytes.Clone(cur.Bytes()), line: start})
		}
		cur.Reset()
		meaningful = false
		start = next
	}
	for len(data) > 0 {
		line++
		var l []byte
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			l, data = data[:i+1], data[i+1:]
		} else {
			l, data = data, nil
		}
		trimmed := strings.TrimRight(string(l), " \t\r\n")
		if trimmed == "---" || strings.HasPrefix(trimmed, "--- ") || strings.HasPrefix(trimmed, "---\t") {
			flush(line + 1)
			if rest := strings.TrimSpace(trimmed[3:]); rest != "" && !strings.HasPrefix(rest, "#") {
				// "--- {json}" or "--- key: value": the document starts here.
				start = line
				cur.WriteString(rest + "\n")
				meaningful = true
			}
			continue
		}
		if trimmed == "..." { // explicit document end
			flush(line + 1)
			continue
		}
		cur.Write(l)
		if t := strings.TrimSpace(trimmed); t != "" && !strings.HasPrefix(t, "#") {
			meaningful = true
		} else if !meaningful {
			start = line + 1 // report the first line with content
		}
	}
	flush(line + 1)
	return docs
}
