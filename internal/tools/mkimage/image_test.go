package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

const (
	testRepo = "ghcr.io/xdproxy/xdproxy"
	testArch = "arm64"
)

var testCreated = time.Unix(1_700_000_000, 0).UTC()

// fakeBinary writes a small file standing in for xdproxy and returns its
// path and contents.
func fakeBinary(t *testing.T) (string, []byte) {
	t.Helper()
	data := []byte("\x7fELF not really xdproxy\n")
	for i := range 4096 { // enough that gzip has something to do
		data = append(data, byte(i*7))
	}
	path := filepath.Join(t.TempDir(), "xdproxy")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, data
}

func testOptions(binary string) Options {
	return Options{
		Binary:  binary,
		Path:    DefaultPath,
		Arch:    testArch,
		Tags:    []string{testRepo + ":v1.2.3-4-gabcdef0-dirty", testRepo + ":latest"},
		Created: testCreated,
	}
}

func build(t *testing.T, opts Options) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Write(&buf, opts); err != nil {
		t.Fatalf("Write: %v", err)
	}
	return buf.Bytes()
}

type entry struct {
	hdr  *tar.Header
	data []byte
}

// readTar returns the entries of a tarball in order.
func readTar(t *testing.T, r io.Reader) []entry {
	t.Helper()
	tr := tar.NewReader(r)
	var out []entry
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("reading tar: %v", err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, entry{hdr, data})
	}
}

func digestOf(data []byte) string {
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func decodeJSON(t *testing.T, name string, data []byte, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: %v\n%s", name, err, data)
	}
}

func TestImageTarball(t *testing.T) {
	binary, binData := fakeBinary(t)
	opts := testOptions(binary)
	entries := readTar(t, bytes.NewReader(build(t, opts)))

	files := map[string][]byte{}
	var names []string
	for _, e := range entries {
		names = append(names, e.hdr.Name)
		if !e.hdr.ModTime.Equal(testCreated) || e.hdr.Uid != 0 || e.hdr.Gid != 0 {
			t.Errorf("%s: mtime %v uid %d gid %d, want %v, 0, 0", e.hdr.Name, e.hdr.ModTime, e.hdr.Uid, e.hdr.Gid, testCreated)
		}
		switch e.hdr.Typeflag {
		case tar.TypeDir:
			if e.hdr.Mode != 0o755 {
				t.Errorf("%s: mode %o, want 755", e.hdr.Name, e.hdr.Mode)
			}
		case tar.TypeReg:
			if e.hdr.Mode != 0o644 {
				t.Errorf("%s: mode %o, want 644", e.hdr.Name, e.hdr.Mode)
			}
			files[e.hdr.Name] = e.data
		default:
			t.Errorf("%s: type %c, want a file or a directory", e.hdr.Name, e.hdr.Typeflag)
		}
	}

	// Every blob is named by its digest.
	var blobNames []string
	for name, data := range files {
		if hexDigest, ok := strings.CutPrefix(name, "blobs/sha256/"); ok {
			blobNames = append(blobNames, name)
			if got := digestOf(data); got != "sha256:"+hexDigest {
				t.Errorf("blob %s holds content with digest %s", name, got)
			}
		}
	}
	slices.Sort(blobNames)
	wantNames := append(append([]string{"blobs/", "blobs/sha256/"}, blobNames...), "index.json", "manifest.json", "oci-layout")
	if !slices.Equal(names, wantNames) || len(blobNames) != 3 {
		t.Fatalf("tar entries:\n  %s\nwant two directories, three blobs (layer, config, manifest) and the three layout files:\n  %s",
			strings.Join(names, "\n  "), strings.Join(wantNames, "\n  "))
	}
	blobAt := func(what string, d descriptor) []byte {
		t.Helper()
		data, ok := files["blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:")]
		if !ok {
			t.Fatalf("%s: no blob for %s", what, d.Digest)
		}
		if int64(len(data)) != d.Size {
			t.Fatalf("%s: descriptor size %d, blob holds %d bytes", what, d.Size, len(data))
		}
		return data
	}

	if got := string(files["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout = %s", got)
	}

	// index.json: one entry per tag, all the same manifest.
	var idx index
	decodeJSON(t, "index.json", files["index.json"], &idx)
	if idx.SchemaVersion != 2 || idx.MediaType != mediaTypeIndex || len(idx.Manifests) != len(opts.Tags) {
		t.Fatalf("index.json: schemaVersion %d mediaType %q with %d manifests, want 2, %q, %d",
			idx.SchemaVersion, idx.MediaType, len(idx.Manifests), mediaTypeIndex, len(opts.Tags))
	}
	for i, d := range idx.Manifests {
		_, tag, _ := strings.Cut(strings.TrimPrefix(opts.Tags[i], testRepo), ":")
		want := map[string]string{annotationImageName: opts.Tags[i], annotationRefName: tag}
		if d.MediaType != mediaTypeManifest || d.Digest != idx.Manifests[0].Digest ||
			d.Platform == nil || *d.Platform != (platform{Architecture: testArch, OS: "linux"}) ||
			len(d.Annotations) != len(want) || d.Annotations[annotationImageName] != want[annotationImageName] ||
			d.Annotations[annotationRefName] != want[annotationRefName] {
			t.Errorf("index.json manifests[%d] = %+v (platform %+v), want manifest %s for linux/%s annotated %v",
				i, d, d.Platform, idx.Manifests[0].Digest, testArch, want)
		}
	}

	var man manifest
	decodeJSON(t, "manifest", blobAt("index.json manifests[0]", idx.Manifests[0]), &man)
	if man.SchemaVersion != 2 || man.MediaType != mediaTypeManifest || man.Config.MediaType != mediaTypeConfig ||
		len(man.Layers) != 1 || man.Layers[0].MediaType != mediaTypeLayer {
		t.Fatalf("manifest = %+v, want schema 2, an OCI config and one gzip layer", man)
	}
	configData := blobAt("manifest config", man.Config)
	layerData := blobAt("manifest layers[0]", man.Layers[0])

	// The layer: gzip over a tar holding only the binary.
	zr, err := gzip.NewReader(bytes.NewReader(layerData))
	if err != nil {
		t.Fatalf("layer is not gzip: %v", err)
	}
	uncompressed, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("layer: %v", err)
	}
	// The binary's directories (so that no loader has to make them up) and
	// the binary, nothing else.
	layer := readTar(t, bytes.NewReader(uncompressed))
	var layerNames []string
	for _, e := range layer {
		layerNames = append(layerNames, e.hdr.Name)
	}
	if want := []string{"usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/xdproxy"}; !slices.Equal(layerNames, want) {
		t.Fatalf("layer entries %q, want %q", layerNames, want)
	}
	for i, e := range layer {
		hdr := e.hdr
		wantType := byte(tar.TypeDir)
		if i == len(layer)-1 {
			wantType = tar.TypeReg
		}
		if hdr.Typeflag != wantType || hdr.Mode != 0o755 || hdr.Uid != 0 || hdr.Gid != 0 || !hdr.ModTime.Equal(testCreated) {
			t.Errorf("layer entry %q type %c mode %o uid %d gid %d mtime %v, want type %c, 755, root, %v",
				hdr.Name, hdr.Typeflag, hdr.Mode, hdr.Uid, hdr.Gid, hdr.ModTime, wantType, testCreated)
		}
	}
	if !bytes.Equal(layer[len(layer)-1].data, binData) {
		t.Errorf("the layer's file differs from the binary")
	}

	var cfg imageConfig
	decodeJSON(t, "config", configData, &cfg)
	if !slices.Equal(cfg.Config.Entrypoint, []string{DefaultPath}) {
		t.Errorf("config Entrypoint = %q, want [%s]", cfg.Config.Entrypoint, DefaultPath)
	}
	if cfg.OS != "linux" || cfg.Architecture != testArch || cfg.Created != "2023-11-14T22:13:20Z" {
		t.Errorf("config os %q architecture %q created %q, want linux, %s, 2023-11-14T22:13:20Z", cfg.OS, cfg.Architecture, cfg.Created, testArch)
	}
	if cfg.RootFS.Type != "layers" || !slices.Equal(cfg.RootFS.DiffIDs, []string{digestOf(uncompressed)}) {
		t.Errorf("config rootfs = %+v, want layers [%s] (the uncompressed layer)", cfg.RootFS, digestOf(uncompressed))
	}
	if len(cfg.History) != 1 {
		t.Errorf("config has %d history entries, want 1 (one per layer)", len(cfg.History))
	}

	// manifest.json, for loaders of Docker archives: the same blobs.
	var docker []dockerManifest
	decodeJSON(t, "manifest.json", files["manifest.json"], &docker)
	if len(docker) != 1 {
		t.Fatalf("manifest.json has %d images, want 1", len(docker))
	}
	if want := "blobs/sha256/" + strings.TrimPrefix(man.Config.Digest, "sha256:"); docker[0].Config != want {
		t.Errorf("manifest.json Config = %q, want %q", docker[0].Config, want)
	}
	if want := []string{"blobs/sha256/" + strings.TrimPrefix(man.Layers[0].Digest, "sha256:")}; !slices.Equal(docker[0].Layers, want) {
		t.Errorf("manifest.json Layers = %q, want %q", docker[0].Layers, want)
	}
	if !slices.Equal(docker[0].RepoTags, opts.Tags) {
		t.Errorf("manifest.json RepoTags = %q, want %q", docker[0].RepoTags, opts.Tags)
	}
}

func TestImageIsReproducible(t *testing.T) {
	binary, _ := fakeBinary(t)
	first := build(t, testOptions(binary))
	// A copy of the binary with another name and modification time.
	data, err := os.ReadFile(binary)
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "other")
	if err := os.WriteFile(other, data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(other, time.Now(), time.Now().Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if second := build(t, testOptions(other)); !bytes.Equal(first, second) {
		t.Fatalf("two builds of the same binary differ (%d and %d bytes)", len(first), len(second))
	}

	changed := testOptions(binary)
	changed.Created = testCreated.Add(time.Second)
	if bytes.Equal(first, build(t, changed)) {
		t.Fatal("the creation time does not reach the image")
	}
}

func TestWriteFileReplacesAtomically(t *testing.T) {
	binary, _ := fakeBinary(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "sub", "image.tar")
	if err := writeFile(out, testOptions(binary)); err != nil {
		t.Fatal(err)
	}
	bad := testOptions(binary)
	bad.Tags = nil
	if err := writeFile(out, bad); err == nil {
		t.Fatal("writeFile without tags succeeded")
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, build(t, testOptions(binary))) {
		t.Error("a failed build changed the existing tarball")
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "sub", ".mkimage-*")); len(left) != 0 {
		t.Errorf("temporary files left behind: %v", left)
	}
}

func TestOptionsRejected(t *testing.T) {
	binary, _ := fakeBinary(t)
	for _, tc := range []struct {
		name   string
		change func(*Options)
		want   string
	}{
		{"no tags", func(o *Options) { o.Tags = nil }, "no tag given"},
		{"no tag in reference", func(o *Options) { o.Tags = []string{testRepo} }, "has no tag"},
		{"port is not a tag", func(o *Options) { o.Tags = []string{"localhost:5000/xdproxy"} }, "has no tag"},
		{"upper-case repository", func(o *Options) { o.Tags = []string{"ghcr.io/XDProxy/xdproxy:latest"} }, "not a repository name"},
		{"bad tag", func(o *Options) { o.Tags = []string{testRepo + ":v1+build"} }, "not a tag"},
		{"tag twice", func(o *Options) { o.Tags = []string{testRepo + ":latest", testRepo + ":latest"} }, "given twice"},
		{"relative path", func(o *Options) { o.Path = "usr/local/bin/xdproxy" }, "clean absolute file path"},
		{"no arch", func(o *Options) { o.Arch = "" }, "want a GOARCH"},
		{"missing binary", func(o *Options) { o.Binary = filepath.Join(t.TempDir(), "absent") }, "no such file"},
		{"directory as binary", func(o *Options) { o.Binary = t.TempDir() }, "not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := testOptions(binary)
			tc.change(&opts)
			err := Write(io.Discard, opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Write = %v, want an error containing %q", err, tc.want)
			}
		})
	}
	// A registry with a port is a repository, not a tag.
	opts := testOptions(binary)
	opts.Tags = []string{"localhost:5000/xdproxy:dev"}
	if err := Write(io.Discard, opts); err != nil {
		t.Errorf("localhost:5000/xdproxy:dev: %v", err)
	}
}

func TestCreationTime(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "")
	if got, err := creationTime(); err != nil || !got.Equal(time.Unix(0, 0)) {
		t.Errorf("without SOURCE_DATE_EPOCH: %v, %v; want the Unix epoch", got, err)
	}
	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	if got, err := creationTime(); err != nil || !got.Equal(testCreated) {
		t.Errorf("SOURCE_DATE_EPOCH=1700000000: %v, %v; want %v", got, err, testCreated)
	}
	t.Setenv("SOURCE_DATE_EPOCH", "yesterday")
	if _, err := creationTime(); err == nil {
		t.Error("SOURCE_DATE_EPOCH=yesterday accepted")
	}
}
