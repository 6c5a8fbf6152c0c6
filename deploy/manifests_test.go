// The tests of this directory check the manifests a cluster operator applies:
// that a real kube-apiserver accepts every object in them, and that the
// DaemonSet runs the image `make image` builds, the way that image can run.
package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/xdproxy/xdproxy/internal/kubetest"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	daemonSetFile = "daemonset.yaml"
	makefile      = "../Makefile"
	// binaryPath is where internal/tools/mkimage puts xdproxy in the image
	// (its DefaultPath) and the image's entrypoint.
	binaryPath = "/usr/local/bin/xdproxy"
)

// object is one document of a manifest file.
type object struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	raw []byte
}

func readObjects(t *testing.T, path string) []object {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var o object
		if err := yaml.Unmarshal(doc, &o); err != nil {
			t.Fatalf("%s: document %d: %v", path, len(objs)+1, err)
		}
		if o.Kind == "" { // a document of comments only
			continue
		}
		o.raw = doc
		objs = append(objs, o)
	}
}

// daemonSet returns the one DaemonSet in the manifest and its xdproxy container.
func daemonSet(t *testing.T) (*appsv1.DaemonSet, *corev1.Container) {
	t.Helper()
	var found []*appsv1.DaemonSet
	for _, o := range readObjects(t, daemonSetFile) {
		if o.Kind != "DaemonSet" {
			continue
		}
		ds := new(appsv1.DaemonSet)
		if err := yaml.UnmarshalStrict(o.raw, ds); err != nil {
			t.Fatalf("%s: DaemonSet %s: %v", daemonSetFile, o.Metadata.Name, err)
		}
		found = append(found, ds)
	}
	if len(found) != 1 {
		t.Fatalf("%s holds %d DaemonSets, want 1", daemonSetFile, len(found))
	}
	ds := found[0]
	for i := range ds.Spec.Template.Spec.Containers {
		if c := &ds.Spec.Template.Spec.Containers[i]; c.Name == "xdproxy" {
			return ds, c
		}
	}
	t.Fatalf("DaemonSet %s has no container named xdproxy", ds.Name)
	return nil, nil
}

// Server-side dry run: the API server decodes, defaults, validates (strict
// field validation rejects unknown fields) and admits each object, without
// storing it.
func TestManifestsAcceptedByAPIServer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver; skipped under -short")
	}
	objs := readObjects(t, daemonSetFile)
	if len(objs) == 0 {
		t.Fatalf("%s holds no objects", daemonSetFile)
	}
	path, err := filepath.Abs(daemonSetFile)
	if err != nil {
		t.Fatal(err)
	}
	// As a cluster's API server runs (kubeadm's default): the init
	// container that mounts the state directory is privileged.
	c := kubetest.Start(t, kubetest.Options{APIServerArgs: []string{"--allow-privileged=true"}})
	out, err := c.Kubectl("apply", "--dry-run=server", "--validate=strict", "-o", "name", "-f", path)
	if err != nil {
		t.Fatalf("the API server rejects %s: %v\n%s", daemonSetFile, err, out)
	}
	// One line per object, "kind.group/name", in the file's order.
	lines := strings.Fields(string(out))
	if len(lines) != len(objs) {
		t.Fatalf("kubectl accepted %d objects, the file holds %d:\n%s", len(lines), len(objs), out)
	}
	for i, o := range objs {
		kind, name, _ := strings.Cut(lines[i], "/")
		kind, _, _ = strings.Cut(kind, ".")
		if kind != strings.ToLower(o.Kind) || name != o.Metadata.Name {
			t.Errorf("object %d: kubectl says %q, want %s %s", i+1, lines[i], o.Kind, o.Metadata.Name)
		}
	}
	t.Logf("accepted:\n%s", out)
}

var makeImageRE = regexp.MustCompile(`(?m)^IMAGE[ \t]*\?=[ \t]*(\S+)[ \t]*$`)

// The DaemonSet must name what `make image` tags, or nodes would pull (or
// fail to find) some other image.
func TestDaemonSetImageIsMakeImage(t *testing.T) {
	mk, err := os.ReadFile(makefile)
	if err != nil {
		t.Fatal(err)
	}
	m := makeImageRE.FindAllSubmatch(mk, -1)
	if len(m) != 1 {
		t.Fatalf("%s: found %d lines `IMAGE ?= REPOSITORY`, want 1", makefile, len(m))
	}
	wantRepo := string(m[0][1])

	_, c := daemonSet(t)
	repo, tag, ok := splitImage(c.Image)
	if !ok || repo != wantRepo || tag != "latest" {
		t.Errorf("DaemonSet image %q, want %s:latest (the Makefile's IMAGE; make image tags latest and the version)", c.Image, wantRepo)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %q, want IfNotPresent: an image loaded on the node must be used as it is", c.ImagePullPolicy)
	}
}

// splitImage splits REPOSITORY:TAG at the colon after the last slash.
func splitImage(ref string) (repo, tag string, ok bool) {
	i := strings.LastIndexByte(ref, ':')
	if i < 0 || strings.Contains(ref[i:], "/") {
		return ref, "", false
	}
	return ref[:i], ref[i+1:], true
}

// The image holds the binary alone: the container must run it directly and
// leave $(NODE_NAME) to the kubelet, and mount what the agent uses.
func TestDaemonSetRunsTheBinaryWithoutAShell(t *testing.T) {
	ds, c := daemonSet(t)
	if !slices.Equal(c.Command, []string{binaryPath}) {
		t.Errorf("command %q, want [%s]: the image has no shell", c.Command, binaryPath)
	}
	for _, arg := range slices.Concat(c.Command, c.Args) {
		for _, word := range strings.FieldsFunc(arg, func(r rune) bool { return r == ' ' || r == '/' || r == ';' || r == '&' || r == '|' }) {
			if word == "sh" || word == "bash" || word == "sed" {
				t.Errorf("command line %q runs %s, which the image does not have", slices.Concat(c.Command, c.Args), word)
			}
		}
	}
	wantArgs := []string{"run", "--config=/etc/xdproxy/xdproxy.yaml", "--node-name=$(NODE_NAME)"}
	if !slices.Equal(c.Args, wantArgs) {
		t.Errorf("args %q, want %q", c.Args, wantArgs)
	}
	var nodeName *corev1.EnvVar
	for i := range c.Env {
		if c.Env[i].Name == "NODE_NAME" {
			nodeName = &c.Env[i]
		}
	}
	if nodeName == nil || nodeName.ValueFrom == nil || nodeName.ValueFrom.FieldRef == nil ||
		nodeName.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("env NODE_NAME = %+v, want it from the downward API's spec.nodeName ($(NODE_NAME) in args expands only from env)", nodeName)
	}

	// The --config file comes from the ConfigMap mounted at its directory.
	volumes := map[string]corev1.Volume{}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		volumes[v.Name] = v
	}
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m
	}
	config, ok := mounts["/etc/xdproxy"]
	if !ok || volumes[config.Name].ConfigMap == nil {
		t.Errorf("no ConfigMap mounted at /etc/xdproxy, where --config points")
	} else {
		cmName := volumes[config.Name].ConfigMap.Name
		found := false
		for _, o := range readObjects(t, daemonSetFile) {
			if o.Kind == "ConfigMap" && o.Metadata.Name == cmName {
				var cm corev1.ConfigMap
				if err := yaml.Unmarshal(o.raw, &cm); err != nil {
					t.Fatal(err)
				}
				_, found = cm.Data["xdproxy.yaml"]
			}
		}
		if !found {
			t.Errorf("ConfigMap %s in %s has no key xdproxy.yaml", cmName, daemonSetFile)
		}
	}
	// The admin socket and pinned BPF objects live on the host, so that a
	// restarted pod finds what the previous one left.
	for _, path := range []string{"/run/xdproxy", "/sys/fs/bpf"} {
		m, ok := mounts[path]
		if !ok || volumes[m.Name].HostPath == nil || volumes[m.Name].HostPath.Path != path {
			t.Errorf("no hostPath volume %s mounted at %s", path, path)
		}
	}
	if !ds.Spec.Template.Spec.HostNetwork {
		t.Error("hostNetwork is off: the agent attaches to the node's NICs")
	}
}

// The init container mounts the state directory's tmpfs on the node: it
// runs xdproxy mount-state-dir on the agent's config, from the agent's
// image, and its mount of the hostPath propagates back to the node.
func TestDaemonSetMountsTheStateDir(t *testing.T) {
	ds, agent := daemonSet(t)
	var init *corev1.Container
	for i := range ds.Spec.Template.Spec.InitContainers {
		if c := &ds.Spec.Template.Spec.InitContainers[i]; slices.Contains(c.Args, "mount-state-dir") {
			init = c
		}
	}
	if init == nil {
		t.Fatal("no init container runs xdproxy mount-state-dir")
	}
	if init.Image != agent.Image || !slices.Equal(init.Command, []string{binaryPath}) {
		t.Errorf("init container runs %q from %s, want [%s] from the agent's image %s", init.Command, init.Image, binaryPath, agent.Image)
	}
	wantArgs := []string{"mount-state-dir", "--config=/etc/xdproxy/xdproxy.yaml", "--node-name=$(NODE_NAME)"}
	if !slices.Equal(init.Args, wantArgs) {
		t.Errorf("init container args %q, want %q", init.Args, wantArgs)
	}
	if init.SecurityContext == nil || init.SecurityContext.Privileged == nil || !*init.SecurityContext.Privileged {
		t.Error("init container is not privileged: Bidirectional mount propagation needs it")
	}
	var run *corev1.VolumeMount
	for i := range init.VolumeMounts {
		if init.VolumeMounts[i].MountPath == "/run/xdproxy" {
			run = &init.VolumeMounts[i]
		}
	}
	if run == nil || run.MountPropagation == nil || *run.MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("init container mounts /run/xdproxy as %+v, want Bidirectional propagation", run)
	}
	for _, m := range agent.VolumeMounts {
		if m.MountPath == "/run/xdproxy" && run != nil && m.Name != run.Name {
			t.Errorf("the agent's /run/xdproxy is volume %s, the init container's %s", m.Name, run.Name)
		}
	}
}
