// Command mkimage writes xdproxy's container image without a container
// engine: one static binary in one layer, as a single tarball that
// `docker load`, `podman load` and `ctr images import` all accept.
//
// The tarball is an OCI image layout (oci-layout, index.json, blobs/sha256/…)
// with a Docker archive's manifest.json beside it, both naming the same
// blobs. Loaders that know OCI layouts read index.json, whose entries carry
// the full reference in io.containerd.image.name and the tag in
// org.opencontainers.image.ref.name (as `docker save` and containerd write
// them); the others read manifest.json's RepoTags.
//
// The output depends only on the inputs: file times are the creation time
// (SOURCE_DATE_EPOCH, else the Unix epoch), owners are root and the JSON is
// written in a fixed order, so two builds of the same binary are
// byte-identical.
//
// It is a build tool run by `make image`; the product never imports it.
//
//	mkimage -binary bin/image/linux-amd64/xdproxy -arch amd64 \
//	    -tag ghcr.io/xdproxy/xdproxy:v1.2.0 -tag ghcr.io/xdproxy/xdproxy:latest \
//	    -o bin/xdproxy-image.tar
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// tagList collects repeated -tag flags.
type tagList []string

func (t *tagList) String() string { return strings.Join(*t, ",") }

func (t *tagList) Set(v string) error {
	*t = append(*t, v)
	return nil
}

func main() {
	var (
		opts Options
		tags tagList
		out  string
	)
	flag.StringVar(&opts.Binary, "binary", "", "the static binary to put in the image (required)")
	flag.StringVar(&opts.Path, "path", DefaultPath, "where the binary lies in the image; also the entrypoint")
	flag.StringVar(&opts.Arch, "arch", os.Getenv("GOARCH"), "the image's architecture, in GOARCH's terms (required)")
	flag.Var(&tags, "tag", "a reference REPOSITORY:TAG the image is loaded as (repeat for several; at least one)")
	flag.StringVar(&out, "o", "", "the tarball to write (required)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: mkimage -binary FILE -arch GOARCH -tag REPO:TAG [-tag ...] -o FILE.tar\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 0 || opts.Binary == "" || out == "" {
		flag.Usage()
		os.Exit(2)
	}
	opts.Tags = tags
	created, err := creationTime()
	if err != nil {
		fatal(err)
	}
	opts.Created = created
	if err := writeFile(out, opts); err != nil {
		fatal(err)
	}
	fmt.Printf("mkimage: wrote %s (%s)\n", out, strings.Join(tags, ", "))
}

// creationTime is SOURCE_DATE_EPOCH (reproducible-builds.org) if set, else
// the Unix epoch, so that the image does not depend on when it was built.
func creationTime() (time.Time, error) {
	v := os.Getenv("SOURCE_DATE_EPOCH")
	if v == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	sec, err := strconv.ParseInt(v, 10, 64)
	if err != nil || sec < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: want seconds since the Unix epoch", v)
	}
	return time.Unix(sec, 0).UTC(), nil
}

// writeFile writes the image to a temporary file beside path and renames it
// into place, so a failed build leaves no truncated tarball behind.
func writeFile(path string, opts Options) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".mkimage-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // fails harmlessly after the rename
	if err := Write(tmp, opts); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "mkimage:", err)
	os.Exit(1)
}
