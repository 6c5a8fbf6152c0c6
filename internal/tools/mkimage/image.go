package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"time"
)

// DefaultPath is where the binary lies in the image and what it runs.
const DefaultPath = "/usr/local/bin/xdproxy"

// Media types and annotations of the OCI image spec (v1.1) and containerd.
const (
	mediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	mediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"

	annotationRefName = "org.opencontainers.image.ref.name"
	// annotationImageName is containerd's full image name; ctr, Docker's
	// containerd image store and podman read it before ref.name.
	annotationImageName = "io.containerd.image.name"
)

// defaultEnv is the PATH every base image sets; a container runtime adds it
// when the config has none, but stating it keeps `docker inspect` honest.
var defaultEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// Options describes one image.
type Options struct {
	// Binary is the file put in the image.
	Binary string
	// Path is the absolute path of the binary in the image and the entrypoint.
	Path string
	// Arch is the image's architecture as GOARCH names it; the OS is linux.
	Arch string
	// Tags are the references REPOSITORY:TAG the image is loaded as.
	Tags []string
	// Created is the image's creation time and every file's modification time.
	Created time.Time
}

// descriptor is an OCI content descriptor.
type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *platform         `json:"platform,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

type index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

// imageConfig is the OCI image configuration; the field names inside
// "config" are capitalised, as the spec (inherited from Docker) has them.
type imageConfig struct {
	Created      string          `json:"created"`
	Architecture string          `json:"architecture"`
	OS           string          `json:"os"`
	Config       containerConfig `json:"config"`
	RootFS       rootFS          `json:"rootfs"`
	History      []history       `json:"history"`
}

type containerConfig struct {
	Env        []string `json:"Env"`
	Entrypoint []string `json:"Entrypoint"`
	WorkingDir string   `json:"WorkingDir"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

type history struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
}

// dockerManifest is one entry of a Docker archive's manifest.json.
type dockerManifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

// blob is one file under blobs/sha256/.
type blob struct {
	digest string // sha256:<hex>
	data   []byte
}

// file is one regular file of the image tarball.
type file struct {
	name string
	data []byte
}

func newBlob(data []byte) blob {
	sum := sha256.Sum256(data)
	return blob{digest: "sha256:" + hex.EncodeToString(sum[:]), data: data}
}

func (b blob) path() string { return "blobs/sha256/" + strings.TrimPrefix(b.digest, "sha256:") }

// Write writes the image tarball for opts to w.
func Write(w io.Writer, opts Options) error {
	if err := opts.validate(); err != nil {
		return err
	}
	created := opts.Created.UTC().Truncate(time.Second)
	layer, diffID, err := buildLayer(opts.Binary, opts.Path, created)
	if err != nil {
		return err
	}

	cfg := imageConfig{
		Created:      created.Format(time.RFC3339),
		Architecture: opts.Arch,
		OS:           "linux",
		Config: containerConfig{
			Env:        defaultEnv,
			Entrypoint: []string{opts.Path},
			WorkingDir: "/",
		},
		RootFS: rootFS{Type: "layers", DiffIDs: []string{diffID}},
		// One entry per layer: Docker checks that they pair up.
		History: []history{{Created: created.Format(time.RFC3339), CreatedBy: "mkimage: " + opts.Path}},
	}
	config, err := jsonBlob(cfg)
	if err != nil {
		return err
	}
	man, err := jsonBlob(manifest{
		SchemaVersion: 2,
		MediaType:     mediaTypeManifest,
		Config:        descriptor{MediaType: mediaTypeConfig, Digest: config.digest, Size: int64(len(config.data))},
		Layers:        []descriptor{{MediaType: mediaTypeLayer, Digest: layer.digest, Size: int64(len(layer.data))}},
	})
	if err != nil {
		return err
	}

	// One index entry per tag, all naming the same manifest: the layout's way
	// of giving one image several names.
	idx := index{SchemaVersion: 2, MediaType: mediaTypeIndex}
	for _, ref := range opts.Tags {
		_, tag, _ := splitReference(ref)
		idx.Manifests = append(idx.Manifests, descriptor{
			MediaType:   mediaTypeManifest,
			Digest:      man.digest,
			Size:        int64(len(man.data)),
			Annotations: map[string]string{annotationImageName: ref, annotationRefName: tag},
			Platform:    &platform{Architecture: opts.Arch, OS: "linux"},
		})
	}
	indexJSON, err := json.Marshal(idx)
	if err != nil {
		return err
	}
	dockerJSON, err := json.Marshal([]dockerManifest{{
		Config:   config.path(),
		RepoTags: opts.Tags,
		Layers:   []string{layer.path()},
	}})
	if err != nil {
		return err
	}

	// The entries in name order, directories first, as `docker save` writes them.
	tw := tar.NewWriter(w)
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: created}); err != nil {
			return err
		}
	}
	blobs := []blob{layer, config, man}
	slices.SortFunc(blobs, func(a, b blob) int { return strings.Compare(a.digest, b.digest) })
	var files []file
	for _, b := range blobs {
		files = append(files, file{b.path(), b.data})
	}
	files = append(files,
		file{"index.json", indexJSON},
		file{"manifest.json", dockerJSON},
		file{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
	)
	for _, f := range files {
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644, Size: int64(len(f.data)), ModTime: created}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if _, err := tw.Write(f.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

// buildLayer returns the gzip-compressed layer holding only the binary and
// its directories, and the digest of the uncompressed tar (the config's
// diff_id).
func buildLayer(binary, dest string, mtime time.Time) (blob, string, error) {
	f, err := os.Open(binary)
	if err != nil {
		return blob{}, "", err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return blob{}, "", err
	}
	if !info.Mode().IsRegular() {
		return blob{}, "", fmt.Errorf("%s is not a regular file", binary)
	}

	var compressed bytes.Buffer
	// The gzip header carries no name and no time, so the output depends on
	// the input alone.
	zw := gzip.NewWriter(&compressed)
	uncompressed := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(zw, uncompressed))
	// The parent directories come first, 0755: a loader that has to make
	// them up may choose another mode (Docker 20.10 makes them 0600, so
	// that only CAP_DAC_OVERRIDE could reach the binary).
	name := strings.TrimPrefix(dest, "/")
	for i, c := range name {
		if c != '/' {
			continue
		}
		dir := &tar.Header{Typeflag: tar.TypeDir, Name: name[:i+1], Mode: 0o755, ModTime: mtime, Uname: "root", Gname: "root"}
		if err := tw.WriteHeader(dir); err != nil {
			return blob{}, "", err
		}
	}
	hdr := &tar.Header{
		Typeflag: tar.TypeReg,
		Name:     name,
		Mode:     0o755,
		Size:     info.Size(),
		ModTime:  mtime,
		Uname:    "root",
		Gname:    "root",
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return blob{}, "", err
	}
	n, err := io.Copy(tw, f)
	if err != nil {
		return blob{}, "", fmt.Errorf("read %s: %w", binary, err)
	}
	if n != info.Size() {
		return blob{}, "", fmt.Errorf("%s changed size while being read", binary)
	}
	if err := tw.Close(); err != nil {
		return blob{}, "", err
	}
	if err := zw.Close(); err != nil {
		return blob{}, "", err
	}
	return newBlob(compressed.Bytes()), "sha256:" + hex.EncodeToString(uncompressed.Sum(nil)), nil
}

func jsonBlob(v any) (blob, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return blob{}, err
	}
	return newBlob(data), nil
}

// The reference grammar of github.com/distribution/reference, restricted to
// REPOSITORY:TAG (no digests).
var (
	domainPart = `(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?`
	pathPart   = `[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*`
	repoRE     = regexp.MustCompile(`^(?:` + domainPart + `/)?` + pathPart + `(?:/` + pathPart + `)*$`)
	tagRE      = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	archRE     = regexp.MustCompile(`^[a-z0-9]+$`)
)

// splitReference splits REPOSITORY:TAG at the colon after the last slash.
func splitReference(ref string) (repo, tag string, ok bool) {
	i := strings.LastIndexByte(ref, ':')
	if i < 0 || strings.Contains(ref[i:], "/") {
		return ref, "", false
	}
	return ref[:i], ref[i+1:], true
}

func (o Options) validate() error {
	var errs []error
	if o.Binary == "" {
		errs = append(errs, errors.New("no binary given"))
	}
	if !path.IsAbs(o.Path) || path.Clean(o.Path) != o.Path || o.Path == "/" {
		errs = append(errs, fmt.Errorf("path %q: want a clean absolute file path such as %s", o.Path, DefaultPath))
	}
	if !archRE.MatchString(o.Arch) {
		errs = append(errs, fmt.Errorf("architecture %q: want a GOARCH such as amd64 or arm64", o.Arch))
	}
	if len(o.Tags) == 0 {
		errs = append(errs, errors.New("no tag given: name at least one REPOSITORY:TAG"))
	}
	seen := map[string]bool{}
	for _, ref := range o.Tags {
		repo, tag, ok := splitReference(ref)
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("reference %q has no tag: want REPOSITORY:TAG", ref))
		case !repoRE.MatchString(repo):
			errs = append(errs, fmt.Errorf("reference %q: %q is not a repository name (lower case, such as ghcr.io/xdproxy/xdproxy)", ref, repo))
		case !tagRE.MatchString(tag):
			errs = append(errs, fmt.Errorf("reference %q: %q is not a tag (letters, digits, _ . -, at most 128, not starting with . or -)", ref, tag))
		case seen[ref]:
			errs = append(errs, fmt.Errorf("reference %q given twice", ref))
		}
		seen[ref] = true
	}
	return errors.Join(errs...)
}
