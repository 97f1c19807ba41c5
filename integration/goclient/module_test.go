package goclient_test

// HAMi imports this module from a release, where the replace directive of its go.mod is ignored
// (Go honours replace directives only in the main module). This test plays that consumer: it
// serves this module and the api module from the working tree as a module proxy, at the api
// version go.mod requires, creates a fresh module that imports migclient, and runs the go get
// the README gives. Everything else comes from the local module cache, so it runs offline.

import (
	"archive/zip"
	"bytes"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// release is a version a release tag names: vMAJOR.MINOR.PATCH, no pre-release, no pseudo-version.
var release = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+$`)

// modulePath is the module line of a go.mod.
func modulePath(t *testing.T, gomod []byte) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^module\s+(\S+)\s*$`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("go.mod has no module line")
	}
	return string(m[1])
}

// required is the version go.mod requires of module mod.
func required(t *testing.T, gomod []byte, mod string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(mod) + `\s+(\S+)`).FindSubmatch(gomod)
	if m == nil {
		t.Fatalf("go.mod does not require %s", mod)
	}
	return string(m[1])
}

// escape is a module path as a module proxy spells it: each upper-case letter as '!' and its
// lower case.
func escape(p string) string {
	var b strings.Builder
	for _, r := range p {
		if r >= 'A' && r <= 'Z' {
			b.WriteByte('!')
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String()
}

// serve writes module mod at version from directory dir into a file-based module proxy.
func serve(t *testing.T, proxy, mod, version, dir string) {
	t.Helper()
	at := filepath.Join(proxy, filepath.FromSlash(escape(mod)), "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	z := zip.NewWriter(&buf)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if d.IsDir() {
			if rel == "." {
				return nil
			}
			if strings.HasPrefix(d.Name(), ".") || d.Name() == "__pycache__" {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
				return filepath.SkipDir // another module
			}
			return nil
		}
		if !d.Type().IsRegular() || strings.HasPrefix(d.Name(), ".") {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		w, err := z.Create(path.Join(mod+"@"+version, filepath.ToSlash(rel)))
		if err != nil {
			return err
		}
		_, err = w.Write(data)
		return err
	})
	if err == nil {
		err = z.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"list":            []byte(version + "\n"),
		version + ".info": fmt.Appendf(nil, `{"Version":%q,"Time":"2026-01-01T00:00:00Z"}`, version),
		version + ".mod":  gomod,
		version + ".zip":  buf.Bytes(),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(at, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestAModuleOutsideThisRepositoryCanImportTheClientFromARelease(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module graph with the go command")
	}
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	apiDir := filepath.Join("..", "..", "api")
	apiMod, err := os.ReadFile(filepath.Join(apiDir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	client, api := modulePath(t, gomod), modulePath(t, apiMod)
	version := required(t, gomod, api)
	if !release.MatchString(version) {
		t.Fatalf("go.mod requires %s %s, which no release tag names; a module importing %s ignores the replace "+
			"directive and cannot find it", api, version, client)
	}

	goEnv := func(name string) string {
		out, err := exec.Command("go", "env", name).Output()
		if err != nil {
			t.Fatalf("go env %s: %v", name, err)
		}
		return strings.TrimSpace(string(out))
	}
	localCache := filepath.Join(goEnv("GOMODCACHE"), "cache", "download")
	tmp := t.TempDir()
	proxy := filepath.Join(tmp, "proxy")
	serve(t, proxy, api, version, apiDir)
	serve(t, proxy, client, version, ".")
	consumer := filepath.Join(tmp, "plugin")
	if err := os.Mkdir(consumer, 0o755); err != nil {
		t.Fatal(err)
	}
	main := "package main\n\nimport \"" + client + "/migclient\"\n\nfunc main() { _ = migclient.DefaultCallTimeout }\n"
	if err := os.WriteFile(filepath.Join(consumer, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(),
		"GOMODCACHE="+filepath.Join(tmp, "modcache"), // the release served here never reaches the real cache
		"GOPROXY="+(&url.URL{Scheme: "file", Path: proxy}).String()+","+(&url.URL{Scheme: "file", Path: localCache}).String(),
		"GOFLAGS=-mod=mod -modcacherw", "GOSUMDB=off", "GONOSUMDB=", "GOPRIVATE=", "GONOPROXY=",
		"GOWORK=off", "GOTOOLCHAIN=local",
	)
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("go", args...)
		cmd.Dir, cmd.Env = consumer, env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("mod", "init", "example.com/plugin")
	run("get", client+"@"+version)
	deps := run("list", "-deps", ".")
	if !strings.Contains(deps, api+"/hami/migsidecar/v1\n") {
		t.Fatalf("migclient's contract package is not among the consumer's dependencies:\n%s", deps)
	}
	if got := strings.TrimSpace(run("list", "-m", api)); got != api+" "+version {
		t.Fatalf("the consumer uses %q, want %s %s", got, api, version)
	}
}
