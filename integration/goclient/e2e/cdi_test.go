package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
)

// TestEverySpecTheSidecarWroteLoadsAndInjectsWithTheReferenceLibrary checks the CDI files with
// the library container runtimes use: each parses and validates on its own, the directory loads
// into a cache without errors (which also catches a device name claimed by two files), and each
// allocated device resolves and injects into an empty OCI spec.
func TestEverySpecTheSidecarWroteLoadsAndInjectsWithTheReferenceLibrary(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	dir := env(t, "MIGSIDECAR_CDI_DIR")
	res := allocate(ctx, t, c, p, request("cdi", dev(gpus[0], "1g.10gb", 4, 1), dev(gpus[1], "3g.40gb", 4, 4)))

	files, err := filepath.Glob(filepath.Join(dir, "*"))
	if err != nil {
		t.Fatal(err)
	}
	var specs int
	for _, f := range files {
		if !strings.HasSuffix(f, ".json") && !strings.HasSuffix(f, ".yaml") {
			continue
		}
		specs++
		spec, err := cdi.ReadSpec(f, 0)
		if err != nil {
			t.Errorf("%s: %v", filepath.Base(f), err)
			continue
		}
		info, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != 0o644 {
			t.Errorf("%s: mode %o, want 644", filepath.Base(f), info.Mode().Perm())
		}
		if len(spec.Devices) != 1 {
			t.Errorf("%s: %d devices, want one per instance", filepath.Base(f), len(spec.Devices))
		}
	}
	if specs < len(res.Devices) {
		t.Fatalf("%d spec files for %d allocated devices", specs, len(res.Devices))
	}

	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := cache.GetErrors(); len(errs) != 0 {
		t.Fatalf("cache errors: %v", errs)
	}
	for _, d := range res.Devices {
		if !parser.IsQualifiedName(d.CDIDevice) {
			t.Fatalf("device %d: %q is not a qualified CDI name", d.DeviceIndex, d.CDIDevice)
		}
		if cache.GetDevice(d.CDIDevice) == nil {
			t.Fatalf("device %s not in the cache", d.CDIDevice)
		}
		spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		unresolved, err := cache.InjectDevices(spec, d.CDIDevice)
		if err != nil || len(unresolved) != 0 {
			t.Fatalf("inject %s: unresolved %v, %v", d.CDIDevice, unresolved, err)
		}
		var caps int
		for _, n := range spec.Linux.Devices {
			if strings.HasPrefix(n.Path, "/dev/nvidia-caps/nvidia-cap") {
				caps++
			}
		}
		if caps != 2 {
			t.Fatalf("%s injected %d nvidia-caps nodes, want the GI and CI access nodes: %+v", d.CDIDevice, caps, spec.Linux.Devices)
		}
	}
}
