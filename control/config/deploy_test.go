package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// TestDeployExample: deploy/xdproxy.yaml parses, and the values it shows
// for the fields it documents are the defaults it says they are.
func TestDeployExample(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "xdproxy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	example, err := ParseWith(b, Options{Host: &testHost})
	if err != nil {
		t.Fatal(err)
	}
	def, err := ParseWith([]byte(file("", "", "")), Options{Host: &testHost})
	if err != nil {
		t.Fatal(err)
	}
	// The example sets these to non-default values, to show them.
	def.NodeZone = "zone-a"
	def.ClusterCIDRs = example.ClusterCIDRs
	// nat/conntrack does not export its fragment defaults; the example
	// states them.
	if c := example.Conntrack; c.FragmentTimeout != 30*time.Second || c.FragmentMaxEntries != 4096 {
		t.Errorf("fragment settings %v, %d: want conntrack's defaults 30s, 4096", c.FragmentTimeout, c.FragmentMaxEntries)
	}
	example.Conntrack.FragmentTimeout, example.Conntrack.FragmentMaxEntries = 0, 0
	if !reflect.DeepEqual(example, def) {
		t.Errorf("deploy/xdproxy.yaml shows values that are not the defaults:\n got %+v\nwant %+v", example, def)
	}
}

// TestDaemonSetConfig: the config in deploy/daemonset.yaml's ConfigMap
// parses with the node name the container passes as --node-name.
func TestDaemonSetConfig(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var cm struct {
			Kind string            `json:"kind"`
			Data map[string]string `json:"data"`
		}
		if err := yaml.Unmarshal([]byte(doc), &cm); err != nil {
			t.Fatal(err)
		}
		if cm.Kind != "ConfigMap" {
			continue
		}
		found = true
		in, ok := cm.Data["xdproxy.yaml"]
		if !ok {
			t.Fatal("the ConfigMap has no xdproxy.yaml")
		}
		c, err := ParseWith([]byte(in), Options{Host: &testHost, NodeName: "node-1"})
		if err != nil {
			t.Fatal(err)
		}
		if c.NodeName != "node-1" || c.Services.Kubernetes == nil {
			t.Errorf("parsed %+v", c)
		}
	}
	if !found {
		t.Fatal("no ConfigMap in deploy/daemonset.yaml")
	}
}

// TestREADMEExamples: the README's YAML examples of whole files parse.
func TestREADMEExamples(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, block := range strings.Split(string(b), "```yaml\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		if !strings.HasPrefix(block, "apiVersion: "+APIVersion) {
			continue
		}
		n++
		if _, err := ParseWith([]byte(block), Options{Host: &testHost}); err != nil {
			t.Errorf("%v\n%s", err, block)
		}
	}
	if n == 0 {
		t.Error("no example file in README.md")
	}
}
