package layout

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/xdproxy/xdproxy"

// layers are the product's layers, lowest first. A package imports only
// packages of its own rank or a lower one. "x/..." is x and everything
// below it; an exact name wins over a pattern.
var layers = []struct {
	name     string
	rank     int
	packages []string
}{
	{"machine instructions", 5, []string{"nat/cpu"}},
	{"packet types", 10, []string{"nat/packet"}},
	{"translation", 20, []string{"nat", "nat/conntrack"}},
	{"kernel-facing", 30, []string{"xdp", "xdp/afxdp", "xdp/socklb"}},
	{"dataplane tables", 40, []string{"dataplane/service", "dataplane/maglev", "dataplane/route"}},
	{"dataplane", 50, []string{"dataplane"}},
	{"control: leaves", 60, []string{"control/changes", "control/health", "control/metrics", "control/runner"}},
	{"control: API objects to model", 61, []string{"control/k8sconv"}},
	{"control: sources", 62, []string{"control/kubesource", "control/filesource"}},
	{"control: configuration", 63, []string{"control/config"}},
	{"control: agent", 64, []string{"control/agent"}},
	{"commands", 70, []string{"cmd/..."}},
}

// side are the packages beside the layers: benchmark, manifests and test
// scaffolding. They may import anything; the product imports none of them.
var side = []string{"bench/...", "deploy/...", "internal/..."}

// commandImports are the only packages of this module a command imports.
var commandImports = []string{"control/agent", "control/config"}

// knownViolations are packages that break the rules today, with the reason
// and the way out. The test logs them instead of failing, and fails once
// one of them keeps the rules (remove it here then).
var knownViolations = map[string]string{}

// pkg is what the rules need of a package, as `go list` reports it, with
// paths relative to the module.
type pkg struct {
	Path    string   // module-relative
	Imports []string // module-relative for this module's, as is otherwise
	Deps    []string // every package it links, the same way
}

// match reports whether rel is pattern, or below it for "x/...".
func match(pattern, rel string) bool {
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return rel == base || strings.HasPrefix(rel, base+"/")
	}
	return rel == pattern
}

// rankOf returns the rank of a module package, -1 for a side package, and
// false for one no rule places.
func rankOf(rel string) (int, bool) {
	for _, exact := range []bool{true, false} {
		for _, l := range layers {
			for _, p := range l.packages {
				if strings.HasSuffix(p, "/...") != exact && match(p, rel) {
					return l.rank, true
				}
			}
		}
	}
	for _, p := range side {
		if match(p, rel) {
			return -1, true
		}
	}
	return 0, false
}

func layerName(rank int) string {
	for _, l := range layers {
		if l.rank == rank {
			return l.name
		}
	}
	return "side"
}

func ours(path string) (string, bool) {
	if path == module {
		return ".", true
	}
	return strings.CutPrefix(path, module+"/")
}

// check returns, for every package that breaks a rule, what it breaks.
func check(pkgs []pkg) map[string][]string {
	bad := map[string][]string{}
	report := func(p pkg, format string, args ...any) {
		bad[p.Path] = append(bad[p.Path], fmt.Sprintf(format, args...))
	}
	for _, p := range pkgs {
		rank, ok := rankOf(p.Path)
		if !ok {
			report(p, "in no layer: place it in README.md's Architecture and in internal/layout's layers")
			continue
		}
		if rank < 0 {
			continue // side packages may import anything
		}
		for _, imp := range p.Imports {
			rel, mine := ours(imp)
			if !mine {
				continue
			}
			ir, ok := rankOf(rel)
			switch {
			case !ok:
				report(p, "imports %s, which is in no layer", rel)
			case ir < 0:
				report(p, "imports %s: product packages never import bench/, deploy/ or internal/", rel)
			case ir > rank:
				report(p, "imports %s: %s (%d) may not import %s (%d)", rel, layerName(rank), rank, layerName(ir), ir)
			}
			if match("cmd/...", p.Path) && !slices.Contains(commandImports, rel) {
				report(p, "imports %s: a command imports only %s of this module", rel, strings.Join(commandImports, " and "))
			}
		}
		for _, d := range p.Deps {
			if d == "testing" {
				report(p, `links the "testing" package`)
			}
			if rel, mine := ours(d); mine {
				if r, ok := rankOf(rel); ok && r < 0 && !slices.Contains(p.Imports, d) {
					report(p, "links %s through its imports", rel)
				}
			}
		}
	}
	return bad
}

// goList lists the module's packages (their own files, not their tests).
func goList(t *testing.T) []pkg {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the import rules are read with the go command: %v", err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(gobin, "list", "-e", "-json=ImportPath,Imports,Deps", module+"/...")
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath    string
			Imports, Deps []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		rel, _ := ours(p.ImportPath)
		pkgs = append(pkgs, pkg{Path: rel, Imports: p.Imports, Deps: p.Deps})
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list found %d packages; is the test run inside the module?", len(pkgs))
	}
	return pkgs
}

func TestImportRules(t *testing.T) {
	pkgs := goList(t)
	bad := check(pkgs)
	for _, p := range pkgs {
		problems := bad[p.Path]
		why, known := knownViolations[p.Path]
		switch {
		case known && len(problems) > 0:
			t.Logf("known: %s (%s):\n\t%s", p.Path, why, strings.Join(problems, "\n\t"))
		case known:
			t.Errorf("%s keeps the rules now: remove it from knownViolations", p.Path)
		case len(problems) > 0:
			t.Errorf("%s breaks the import rules (README.md, Architecture):\n\t%s", p.Path, strings.Join(problems, "\n\t"))
		}
	}
	for path := range knownViolations {
		if !slices.ContainsFunc(pkgs, func(p pkg) bool { return p.Path == path }) {
			t.Errorf("knownViolations names %s, which no longer exists", path)
		}
	}
}

// TestCheckCatches feeds check made-up packages that break each rule once.
func TestCheckCatches(t *testing.T) {
	m := func(rel string) string { return module + "/" + rel }
	for _, c := range []struct {
		name string
		p    pkg
		want string // in the one problem reported; "" for none
	}{
		{"lower imports higher", pkg{Path: "nat", Imports: []string{m("dataplane")}}, "translation (20) may not import dataplane (50)"},
		{"kernel layer imports the dataplane", pkg{Path: "xdp/afxdp", Imports: []string{m("dataplane/service")}}, "may not import"},
		{"source imports the agent", pkg{Path: "control/kubesource", Imports: []string{m("control/agent")}}, "may not import"},
		{"product imports test scaffolding", pkg{Path: "dataplane", Imports: []string{m("internal/testbed")}}, "never import bench/, deploy/ or internal/"},
		{"product imports the benchmark", pkg{Path: "control/agent", Imports: []string{m("bench/runner")}}, "never import"},
		{"product links testing", pkg{Path: "control/metrics", Imports: []string{"example.com/x"}, Deps: []string{"example.com/x", "testing"}}, `links the "testing" package`},
		{"product links scaffolding indirectly", pkg{Path: "control/health", Imports: []string{"example.com/y"}, Deps: []string{"example.com/y", m("internal/kubetest")}}, "links internal/kubetest through its imports"},
		{"command imports the dataplane", pkg{Path: "cmd/xdproxy", Imports: []string{m("control/agent"), m("dataplane")}}, "a command imports only"},
		{"package in no layer", pkg{Path: "policy"}, "in no layer"},
		{"same layer", pkg{Path: "dataplane/service", Imports: []string{m("dataplane/maglev"), m("nat/packet")}}, ""},
		{"command as it should be", pkg{Path: "cmd/xdproxy", Imports: []string{m("control/agent"), m("control/config"), "flag"}}, ""},
		{"side package imports anything", pkg{Path: "bench/runner", Imports: []string{m("control/agent"), m("internal/testbed")}, Deps: []string{"testing"}}, ""},
	} {
		got := check([]pkg{c.p})[c.p.Path]
		switch {
		case c.want == "" && len(got) > 0:
			t.Errorf("%s: unexpected %q", c.name, got)
		case c.want != "" && (len(got) != 1 || !strings.Contains(got[0], c.want)):
			t.Errorf("%s: got %q, want one problem with %q", c.name, got, c.want)
		}
	}
}
