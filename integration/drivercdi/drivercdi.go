// Package drivercdi builds the CDI device that gives a container the NVIDIA driver: its libraries
// and binaries, its control device nodes (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset),
// the nvidia-cdi-hook hooks that make the libraries loadable and the environment. These are what
// NVIDIA's own library (nvcdi) calls the common edits: the same for every GPU and MIG device of a
// node, so the sidecar publishes them once, as one device of a kind of its own, and hands its name
// out beside each instance's (hooks named by two devices would run twice: a runtime de-duplicates
// device nodes and mounts, not hooks).
//
// nvcdi finds everything under the driver root it is given; nothing is assumed. NVML is never
// loaded: the driver version comes from the versioned library names under the root
// (libcuda.so.<version>), which is nvcdi's own fallback when NVML is absent. That keeps the command
// usable where NVML cannot be loaded (a simulated node, whose driver root holds library stubs) and
// keeps it from ever touching the GPU.
package drivercdi

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	nvmlmock "github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	nvspec "github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi/spec"
	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi/transform/root"
	"github.com/sirupsen/logrus"
	"tags.cncf.io/container-device-interface/specs-go"
)

// Options say where the driver is and what the spec is called.
type Options struct {
	// DriverRoot is where this process sees the driver's files ("/" for a host-installed driver,
	// /run/nvidia/driver for the GPU Operator's, or wherever the node's root is mounted).
	DriverRoot string
	// DevRoot is where this process sees the driver's device nodes; empty: DriverRoot.
	DevRoot string
	// HostDriverRoot is the same directory as the container runtime on the node sees it, which is
	// what the spec names; empty: DriverRoot.
	HostDriverRoot string
	// HostDevRoot is DevRoot as the runtime sees it; empty: HostDriverRoot.
	HostDevRoot string
	// HookPath is nvidia-cdi-hook's path on the node (HAMi's chart calls it nvidiaHookPath).
	HookPath string
	// Kind is the spec's "vendor/class"; Name the one device's name.
	Kind string
	Name string
	// Log receives nvcdi's messages; nil discards them.
	Log io.Writer
}

// Spec returns the CDI spec holding the driver's common edits as its one device.
func Spec(o Options) (*specs.Spec, error) {
	vendor, class, ok := strings.Cut(o.Kind, "/")
	if !ok || vendor == "" || class == "" || strings.Contains(class, "/") {
		return nil, fmt.Errorf("kind %q is not vendor/class", o.Kind)
	}
	if o.Name == "" {
		return nil, errors.New("the device name is empty")
	}
	logger := logrus.New()
	logger.SetOutput(io.Discard)
	if o.Log != nil {
		logger.SetOutput(o.Log)
	}
	lib, err := nvcdi.New(
		nvcdi.WithMode(nvcdi.ModeNvml),
		nvcdi.WithLogger(logger),
		nvcdi.WithNvmlLib(noNVML()),
		nvcdi.WithDriverRoot(o.DriverRoot),
		nvcdi.WithDevRoot(o.DevRoot),
		nvcdi.WithNVIDIACDIHookPath(o.HookPath),
		nvcdi.WithFeatureFlags(nvcdi.FeatureDisableNvsandboxUtils),
		nvcdi.WithVendor(vendor),
		nvcdi.WithClass(class),
	)
	if err != nil {
		return nil, fmt.Errorf("nvcdi: %w", err)
	}
	edits, err := lib.GetCommonEdits()
	if err != nil {
		return nil, fmt.Errorf("nvcdi common edits under driver root %s: %w", o.DriverRoot, err)
	}
	built, err := nvspec.New(
		nvspec.WithVendor(vendor),
		nvspec.WithClass(class),
		nvspec.WithDeviceSpecs([]specs.Device{{Name: o.Name, ContainerEdits: *edits.ContainerEdits}}),
		nvspec.WithFormat(nvspec.FormatJSON),
	)
	if err != nil {
		return nil, fmt.Errorf("nvcdi spec: %w", err)
	}
	raw := built.Raw()
	hostRoot := o.HostDriverRoot
	if hostRoot == "" {
		hostRoot = o.DriverRoot
	}
	toHost := root.NewDriverTransformer(
		root.WithDriverRoot(o.DriverRoot),
		root.WithTargetDriverRoot(hostRoot),
		root.WithDevRoot(o.DevRoot),
		root.WithTargetDevRoot(o.HostDevRoot),
	)
	if err := toHost.Transform(raw); err != nil {
		return nil, fmt.Errorf("driver root %s as the host sees it (%s): %w", o.DriverRoot, hostRoot, err)
	}
	// The lowest version that covers the fields used: a runtime with an older CDI library rejects a
	// version it does not know.
	version, err := specs.MinimumRequiredVersion(raw)
	if err != nil {
		return nil, fmt.Errorf("the spec's minimum CDI version: %w", err)
	}
	raw.Version = version
	return raw, nil
}

// noNVML is an NVML that is not there: nvcdi then reads the driver version from the driver root.
func noNVML() nvml.Interface {
	return &nvmlmock.Interface{
		InitFunc:     func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ShutdownFunc: func() nvml.Return { return nvml.SUCCESS },
		SystemGetDriverVersionFunc: func() (string, nvml.Return) {
			return "", nvml.ERROR_UNINITIALIZED
		},
	}
}
