package filesource

import (
	"strings"
	"testing"
)

const serviceA = `apiVersion: v1
kind: Service
metadata:
  name: a
  namespace: web
spec:
  clusterIP: 172.30.0.10
  ports:
  - name: http
    port: 80
    targetPort: 8080
`

const sliceA = `apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: a-1
  namespace: web
  labels:
    kubernetes.io/service-name: a
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: ["10.0.0.1"]
- addresses: ["10.0.0.2"]
  conditions:
    ready: false
`

func TestParse(t *testing.T) {
	testCases := []struct {
		name                     string
		data                     string
		wantServices, wantSlices int
		wantIgnored              int
		wantProblems             []string // "document N line L item I: substring"
	}{
		{
			name:         "service and slice",
			data:         serviceA + "---\n" + sliceA,
			wantServices: 1, wantSlices: 1,
		},
		{
			name:         "leading separator, comments, empty documents and a document end",
			data:         "# services\n---\n" + serviceA + "...\n---\n# nothing\n---\n---\n" + sliceA + "---\n",
			wantServices: 1, wantSlices: 1,
		},
		{
			name:         "JSON document",
			data:         `{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"clusterIP":"172.30.0.9","ports":[{"port":53,"protocol":"UDP"}]}}`,
			wantServices: 1,
		},
		{
			name: "kind List with a bad item",
			data: `apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: b}
  spec: {clusterIP: 172.30.0.11, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: c}
  spec: {ports: [{port: 80}]}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: d}
`,
			wantServices: 1, wantIgnored: 1,
			wantProblems: []string{"document 1 (line 1) item 2: Service default/c: spec.clusterIP is required"},
		},
		{
			name: "invalid documents are skipped, the rest is kept",
			data: serviceA + "---\n" +
				"apiVersion: v1\nkind: Service\nmetadata: {name: typo}\nspec:\n  clusterIp: 172.30.0.12\n" + // unknown field
				"---\n" +
				"apiVersion: v1\nkind: Service\nmetadata: [name: x\n" + // YAML syntax
				"---\n" +
				"kind: Service\nmetadata: {name: nokind}\n" + // no apiVersion
				"---\n" + sliceA,
			wantServices: 1, wantSlices: 1,
			wantProblems: []string{
				`document 2 (line 13): strict decoding error: unknown field "spec.clusterIp"`,
				"document 3 (line 19): yaml: line 3: did not find expected ',' or ']'",
				"document 4 (line 23):",
			},
		},
		{
			// Parse converts YAML to JSON itself: the decoder must still see
			// duplicate and unknown fields, and errors must still name them.
			name: "duplicate and unknown fields are rejected",
			data: "apiVersion: v1\nkind: Service\nmetadata: {name: dup}\nspec:\n  clusterIP: 172.30.0.12\n  clusterIP: 172.30.0.13\n" +
				"---\n" +
				`{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"clusterIP":"172.30.0.9","clusterIP":"172.30.0.8"}}` + "\n" +
				"---\n" +
				"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  clusterIP: 172.30.0.12\n  ports: [{port: 80, bogus: 1}]\n" +
				"---\n" +
				"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: b}\n  spec: {clusterIP: 172.30.0.11}\n  bogus: 1\n" +
				"---\n" +
				"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  clusterIP: 172.30.0.12\n  ports: [{port: eighty}]\n" +
				"---\n" +
				"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d, name: e}\n", // ignored, as before
			wantIgnored: 1,
			wantProblems: []string{
				`document 1 (line 1): strict decoding error: yaml: unmarshal errors:` + "\n" + `  line 6: key "clusterIP" already set in map`,
				`document 2 (line 8): strict decoding error: duplicate field "spec.clusterIP"`,
				`document 3 (line 10): strict decoding error: unknown field "spec.ports[0].bogus"`,
				`document 4 (line 17) item 1: strict decoding error: unknown field "bogus"`,
				`document 5 (line 26): json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of type int32`,
			},
		},
		{
			name:        "other kinds are ignored, not errors",
			data:        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
			wantIgnored: 2,
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			objs, problems := Parse([]byte(tc.data))
			if len(objs.Services) != tc.wantServices || len(objs.EndpointSlices) != tc.wantSlices || objs.Ignored != tc.wantIgnored {
				t.Errorf("got %d services, %d slices, %d ignored; want %d, %d, %d",
					len(objs.Services), len(objs.EndpointSlices), objs.Ignored, tc.wantServices, tc.wantSlices, tc.wantIgnored)
			}
			if len(problems) != len(tc.wantProblems) {
				t.Fatalf("problems %v, want %d", problems, len(tc.wantProblems))
			}
			for i, p := range problems {
				if !strings.Contains(p.Error(), tc.wantProblems[i]) {
					t.Errorf("problem %d: %q, want it to contain %q", i, p.Error(), tc.wantProblems[i])
				}
			}
		})
	}
}

func TestParseFillsDefaults(t *testing.T) {
	objs, problems := Parse([]byte(strings.ReplaceAll(serviceA, "  namespace: web\n", "") + "---\n" + sliceA))
	if len(problems) != 0 {
		t.Fatal(problems)
	}
	if ns := objs.Services[0].Namespace; ns != "default" {
		t.Errorf("namespace %q, want default", ns)
	}
	if ns := objs.EndpointSlices[0].Namespace; ns != "web" {
		t.Errorf("slice namespace %q", ns)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(serviceA + "---\n" + sliceA))
	f.Add([]byte("--- {\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[{}]}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 64<<10 {
			// Real manifest files can be larger, but the fuzzer learns
			// nothing from a big input that it does not from a small
			// one, and YAML's cost grows faster than its size.
			t.Skip()
		}
		objs, problems := Parse(data)
		for _, p := range problems {
			if p.Document < 1 || p.Line < 1 || p.Err == nil {
				t.Fatalf("bad problem %+v", p)
			}
		}
		_ = objs
	})
}
