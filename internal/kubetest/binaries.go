package kubetest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// BinDirEnv names the environment variable that overrides where the control-plane
// binaries are looked up.
const BinDirEnv = "XDPROXY_KUBE_BIN"

// projectModule is the module path of the repository whose build/kube/bin holds
// the binaries by default.
const projectModule = "github.com/xdproxy/xdproxy"

// Binary returns the path of one of the programs internal/kubetools builds
// (kube-apiserver, etcd, kubectl, kube-proxy), or an error that says how to
// build it.
func Binary(name string) (string, error) {
	dir, err := binDir()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, name)
	info, err := os.Stat(path)
	if err != nil || !info.Mode().IsRegular() || info.Mode().Perm()&0o111 == 0 {
		return "", fmt.Errorf("%s is not in %s: run `make kube-tools` (internal/kubetools/build.sh) to build the kube tools, or set %s to a directory holding them", name, dir, BinDirEnv)
	}
	return path, nil
}

func binDir() (string, error) {
	if dir := os.Getenv(BinDirEnv); dir != "" {
		return filepath.Abs(dir)
	}
	root, err := repoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "build", "kube", "bin"), nil
}

// repoRoot walks up from the working directory (a package directory under go
// test) to the directory whose go.mod declares the project's module.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if modulePath(filepath.Join(dir, "go.mod")) == projectModule {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the repository root (a go.mod for module " + projectModule + ") above the working directory; set " + BinDirEnv)
		}
		dir = parent
	}
}

// modulePath returns the module line of a go.mod, or "" if there is none.
func modulePath(gomod string) string {
	f, err := os.Open(gomod)
	if err != nil {
		return ""
	}
	defer f.Close()
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(scanner.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`)
		}
	}
	return ""
}
