package sidecartest

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestTheDoubleAnswersTheAdapterAsHAMisTestsUseIt(t *testing.T) {
	sc := Start(t, "GPU-a")
	cached := sc.PutIdle("GPU-a", "1g.10gb", 3, 1)
	m, err := hami.Dial(context.Background(), sc.Socket, migclient.Options{CallTimeout: 5 * time.Second,
		AllocateTimeout: 5 * time.Second, MaxAttempts: 1, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	a := hami.Owner{PodUID: "a", PodNamespace: "ns", PodName: "a", ContainerName: "c"}
	got, took, err := m.EnsureAllocation(a, 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil || !took || got != cached {
		t.Fatalf("reuse: %s %t %v", got, took, err)
	}
	if state, holder := sc.State(cached); state != "ACTIVE" || holder != "a" {
		t.Fatalf("after the reuse: %s %q", state, holder)
	}
	created, _, err := m.EnsureAllocation(hami.Owner{PodUID: "b", ContainerName: "c"}, 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1})
	if err != nil || sc.Count() != 2 {
		t.Fatalf("create: %s %v, %d instances", created, err, sc.Count())
	}
	if err := m.Release(a, cached); err != nil {
		t.Fatal(err)
	}
	if state, holder := sc.State(cached); state != "IDLE" || holder != "" {
		t.Fatalf("after the rollback: %s %q", state, holder)
	}
	if state, _ := sc.State("MIG-never"); state != "" {
		t.Fatalf("an unknown MIG UUID: %s", state)
	}
}

func TestTheDoubleAnswersTheDriversCDINamesOnceSet(t *testing.T) {
	sc := Start(t, "GPU-a")
	m, err := hami.Dial(context.Background(), sc.Socket, migclient.Options{CallTimeout: 5 * time.Second,
		AllocateTimeout: 5 * time.Second, MaxAttempts: 1, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	const driver = "k8s.hami.io/mig-driver=common"
	for i, want := range [][]string{nil, {driver}} {
		if want != nil {
			sc.SetDriverCDIDevices(want...)
		}
		owner := hami.Owner{PodUID: "p", ContainerName: "c", DeviceIndex: i}
		mig, _, err := m.EnsureAllocation(owner, 0, "1g.10gb", nvml.GpuInstancePlacement{Start: uint32(i), Size: 1})
		if err != nil {
			t.Fatal(err)
		}
		if name, ok := m.CDIDevice(mig); !ok || name == "" {
			t.Fatalf("no CDI name for %s", mig)
		}
		if got := m.DriverCDIDevices(); !slices.Equal(got, want) {
			t.Fatalf("after allocation %d: driver CDI names %v, want %v", i, got, want)
		}
	}
}
