package drivercdi

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nvmlmock "github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/specs-go"
)

// TestWhatTheSidecarHandsOutIsWhatNvcdiGives compares, for one MIG instance, what a container gets
// from the CDI names the sidecar answered (its instance's spec and its driver spec, read from the
// sidecar's CDI directory) with what it gets from the spec NVIDIA's nvcdi builds for the same MIG
// device on go-nvml's H100 mock over the same driver root: both are resolved and injected into an
// empty OCI spec by the reference CDI library, as a runtime does, and the device nodes, mounts,
// hooks and environment must be equal. Spec and device names may differ.
//
// The sidecar's side comes from a running sidecar, so tests/e2e/test_driver_cdi.py drives this test
// with the environment below; nvcdi reads the MIG capability minors from the host's
// /proc/driver/nvidia-caps/mig-minors and the majors from /proc/devices, so it runs in a mount
// namespace where those are the simulated node's. Without the environment it skips.
func TestWhatTheSidecarHandsOutIsWhatNvcdiGives(t *testing.T) {
	cdiDir := os.Getenv("DRIVERCDI_SIDECAR_CDI_DIR")
	if cdiDir == "" {
		t.Skip("run by tests/e2e/test_driver_cdi.py against a sidecar (DRIVERCDI_SIDECAR_CDI_DIR unset)")
	}
	names := strings.Split(os.Getenv("DRIVERCDI_SIDECAR_NAMES"), ",")
	driverRoot := os.Getenv("DRIVERCDI_DRIVER_ROOT")
	hookPath := os.Getenv("DRIVERCDI_HOOK_PATH")
	mig := parseMIG(t, os.Getenv("DRIVERCDI_MIG"))

	sidecar := inject(t, cdiDir, names...)

	lib, err := nvcdi.New(
		nvcdi.WithMode(nvcdi.ModeNvml),
		nvcdi.WithLogger(quiet()),
		nvcdi.WithNvmlLib(h100With(t, mig, driverVersion(t, driverRoot))),
		nvcdi.WithDriverRoot(driverRoot),
		nvcdi.WithNVIDIACDIHookPath(hookPath),
		nvcdi.WithDeviceNamers(uuidNamer(t)),
		nvcdi.WithFeatureFlags(nvcdi.FeatureDisableNvsandboxUtils),
	)
	if err != nil {
		t.Fatal(err)
	}
	devices, err := lib.GetDeviceSpecsByID(mig.uuid)
	if err != nil {
		t.Fatalf("nvcdi device spec of %s: %v", mig.uuid, err)
	}
	common, err := lib.GetCommonEdits()
	if err != nil {
		t.Fatalf("nvcdi common edits: %v", err)
	}
	nvDir := t.TempDir()
	writeSpec(t, nvDir, &specs.Spec{Version: specs.CurrentVersion, Kind: "nvidia.com/gpu", Devices: devices,
		ContainerEdits: *common.ContainerEdits})
	reference := inject(t, nvDir, "nvidia.com/gpu="+mig.uuid)

	if diff := differences(describe(sidecar), describe(reference)); diff != "" {
		t.Fatalf("the sidecar's CDI names (%v) give a container something else than nvcdi's spec:\n%s", names, diff)
	}
	got := describe(sidecar)
	// What a CUDA process needs: the parent GPU's node, the GI and CI capability nodes, the control
	// nodes, libcuda.so.<version> with libcuda.so.1 made by the hooks (create-symlinks for libcuda.so,
	// ldconfig in update-ldcache for the SONAME), and nvidia-smi.
	for _, want := range []string{"dev /dev/nvidia" + strconv.Itoa(mig.gpuMinor) + " ", "dev /dev/nvidiactl ", "dev /dev/nvidia-uvm ",
		"dev /dev/nvidia-uvm-tools ", "mount /usr/lib/x86_64-linux-gnu/libcuda.so.", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so]",
		"update-ldcache --folder /usr/lib/x86_64-linux-gnu]", "mount /usr/bin/nvidia-smi "} {
		if !slices.ContainsFunc(got, func(line string) bool { return strings.Contains(line, want) }) {
			t.Errorf("the container gets no %q:\n%s", want, strings.Join(got, "\n"))
		}
	}
	if caps := slices.DeleteFunc(slices.Clone(got), func(line string) bool { return !strings.HasPrefix(line, "dev /dev/nvidia-caps/") }); len(caps) != 2 {
		t.Errorf("capability nodes %v, want the GI's and the CI's", caps)
	}
	t.Logf("the container gets (%d entries):\n%s", len(got), strings.Join(got, "\n"))
}

type migDevice struct {
	uuid                   string
	gpuMinor, gi, ci, size int
	start                  int
}

// parseMIG reads "MIG-UUID:gpuMinor:gi:ci:start:size".
func parseMIG(t *testing.T, text string) migDevice {
	t.Helper()
	parts := strings.Split(text, ":")
	if len(parts) != 6 {
		t.Fatalf("DRIVERCDI_MIG %q is not MIG-UUID:gpuMinor:gi:ci:start:size", text)
	}
	n := make([]int, 5)
	for i, p := range parts[1:] {
		v, err := strconv.Atoi(p)
		if err != nil {
			t.Fatal(err)
		}
		n[i] = v
	}
	return migDevice{uuid: parts[0], gpuMinor: n[0], gi: n[1], ci: n[2], start: n[3], size: n[4]}
}

// driverVersion is the version of the driver root's libcuda.so.<version>: the mock's NVML reports
// the node's driver, as a real NVML would.
func driverVersion(t *testing.T, root string) string {
	t.Helper()
	found, err := filepath.Glob(filepath.Join(root, "usr/lib/x86_64-linux-gnu/libcuda.so.*.*"))
	if err != nil || len(found) != 1 {
		t.Fatalf("libcuda.so.<version> under %s: %v %v", root, found, err)
	}
	return strings.TrimPrefix(filepath.Base(found[0]), "libcuda.so.")
}

// h100With is go-nvml's one-H100 mock at minor mig.gpuMinor with MIG enabled and one MIG device
// handle, of the sidecar's GI and CI IDs and MIG UUID (the mock models GIs and CIs, not their
// device handles).
func h100With(t *testing.T, mig migDevice, version string) nvml.Interface {
	t.Helper()
	srv := dgxh100.New()
	srv.Devices = srv.Devices[:1]
	srv.DriverVersion = version
	srv.SystemGetDriverVersionFunc = func() (string, nvml.Return) { return version, nvml.SUCCESS }
	gpu, ok := srv.Devices[0].(*server.Device)
	if !ok {
		t.Fatalf("the mock's device is a %T", srv.Devices[0])
	}
	gpu.Minor = mig.gpuMinor
	gpu.MigMode = nvml.DEVICE_MIG_ENABLE
	handle := &nvmlmock.Device{}
	handle.IsMigDeviceHandleFunc = func() (bool, nvml.Return) { return true, nvml.SUCCESS }
	handle.GetDeviceHandleFromMigDeviceHandleFunc = func() (nvml.Device, nvml.Return) { return gpu, nvml.SUCCESS }
	handle.GetUUIDFunc = func() (string, nvml.Return) { return mig.uuid, nvml.SUCCESS }
	handle.GetIndexFunc = func() (int, nvml.Return) { return 0, nvml.SUCCESS }
	handle.GetGpuInstanceIdFunc = func() (int, nvml.Return) { return mig.gi, nvml.SUCCESS }
	handle.GetComputeInstanceIdFunc = func() (int, nvml.Return) { return mig.ci, nvml.SUCCESS }
	handle.GetMinorNumberFunc = func() (int, nvml.Return) { return mig.gpuMinor, nvml.SUCCESS }
	handle.GetAttributesFunc = func() (nvml.DeviceAttributes, nvml.Return) {
		return nvml.DeviceAttributes{GpuInstanceSliceCount: uint32(mig.size), ComputeInstanceSliceCount: uint32(mig.size)}, nvml.SUCCESS
	}
	handle.GetNameFunc = func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3 MIG 1g.10gb", nvml.SUCCESS }
	// The sidecar's GI and CI, at its placement, with its IDs.
	profile, ret := gpu.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if ret != nvml.SUCCESS {
		t.Fatalf("the mock's 1-slice GI profile: %v", ret)
	}
	created, ret := gpu.CreateGpuInstanceWithPlacement(&profile, &nvml.GpuInstancePlacement{Start: uint32(mig.start), Size: uint32(mig.size)})
	if ret != nvml.SUCCESS {
		t.Fatalf("the mock's GI at %d+%d: %v", mig.start, mig.size, ret)
	}
	gi := created.(*server.GpuInstance)
	gi.Info.Id = uint32(mig.gi)
	ciProfile, ret := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if ret != nvml.SUCCESS {
		t.Fatalf("the mock's 1-slice CI profile: %v", ret)
	}
	madeCI, ret := gi.CreateComputeInstance(&ciProfile)
	if ret != nvml.SUCCESS {
		t.Fatalf("the mock's CI: %v", ret)
	}
	ci := madeCI.(*server.ComputeInstance)
	ci.Info.Id = uint32(mig.ci)
	gpu.GetGpuInstanceByIdFunc = func(id int) (nvml.GpuInstance, nvml.Return) {
		if id == mig.gi {
			return gi, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	gi.GetComputeInstanceByIdFunc = func(id int) (nvml.ComputeInstance, nvml.Return) {
		if id == mig.ci {
			return ci, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	gpu.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	gpu.GetMigDeviceHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		if i == 0 {
			return handle, nvml.SUCCESS
		}
		return nil, nvml.ERROR_NOT_FOUND
	}
	gpu.IsMigDeviceHandleFunc = func() (bool, nvml.Return) { return false, nvml.SUCCESS }
	byUUID := srv.DeviceGetHandleByUUIDFunc
	srv.DeviceGetHandleByUUIDFunc = func(uuid string) (nvml.Device, nvml.Return) {
		if uuid == mig.uuid {
			return handle, nvml.SUCCESS
		}
		return byUUID(uuid)
	}
	return srv
}

func uuidNamer(t *testing.T) nvcdi.DeviceNamer {
	t.Helper()
	namer, err := nvcdi.NewDeviceNamer(nvcdi.DeviceNameStrategyUUID)
	if err != nil {
		t.Fatal(err)
	}
	return namer
}

func quiet() *logrus.Logger {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return l
}

func writeSpec(t *testing.T, dir string, spec *specs.Spec) {
	t.Helper()
	version, err := specs.MinimumRequiredVersion(spec)
	if err != nil {
		t.Fatal(err)
	}
	spec.Version = version
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if err := cache.WriteSpec(spec, "nvidia.com-gpu.json"); err != nil {
		t.Fatal(err)
	}
}

// inject resolves names from the specs in dir and injects them into an empty OCI spec.
func inject(t *testing.T, dir string, names ...string) *oci.Spec {
	t.Helper()
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := cache.GetErrors(); len(errs) != 0 {
		t.Fatalf("CDI specs in %s: %v", dir, errs)
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, names...)
	if err != nil || len(unresolved) != 0 {
		t.Fatalf("inject %v from %s: unresolved %v: %v", names, dir, unresolved, err)
	}
	return spec
}

// describe is what a container gets, one sorted line per device node, mount, hook and variable.
func describe(s *oci.Spec) []string {
	var lines []string
	for _, d := range s.Linux.Devices {
		lines = append(lines, fmt.Sprintf("dev %s %s %d:%d mode=%s uid=%s gid=%s", d.Path, d.Type, d.Major, d.Minor,
			optional(d.FileMode), optional(d.UID), optional(d.GID)))
	}
	for _, m := range s.Mounts {
		lines = append(lines, fmt.Sprintf("mount %s %s %s %v", m.Destination, m.Source, m.Type, m.Options))
	}
	if s.Hooks != nil {
		for stage, hooks := range map[string][]oci.Hook{"prestart": s.Hooks.Prestart, "createRuntime": s.Hooks.CreateRuntime, //nolint:staticcheck // prestart is still a hook stage CDI can name
			"createContainer": s.Hooks.CreateContainer, "startContainer": s.Hooks.StartContainer, "poststart": s.Hooks.Poststart,
			"poststop": s.Hooks.Poststop} {
			for _, h := range hooks {
				lines = append(lines, fmt.Sprintf("hook %s %s %v %v", stage, h.Path, h.Args, h.Env))
			}
		}
	}
	for _, e := range s.Process.Env {
		lines = append(lines, "env "+e)
	}
	slices.Sort(lines)
	return lines
}

func optional[T any](p *T) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprint(*p)
}

func differences(got, want []string) string {
	var out []string
	for _, line := range got {
		if !slices.Contains(want, line) {
			out = append(out, "  only the sidecar's: "+line)
		}
	}
	for _, line := range want {
		if !slices.Contains(got, line) {
			out = append(out, "  only nvcdi's:      "+line)
		}
	}
	return strings.Join(out, "\n")
}
