package hami

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func lazy(t *testing.T) (*fakesidecar.Server, *Lazy) {
	t.Helper()
	s, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	none := func(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil }
	l, err := DialLazy(context.Background(), socket, migclient.Options{CallTimeout: 5 * time.Second,
		AllocateTimeout: 5 * time.Second, MaxAttempts: 3, AllowSimulatedBackend: true, ListActive: none})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Shutdown)
	return s, l
}

func own(uid string, device int) Owner {
	return Owner{PodUID: uid, PodNamespace: "ns", PodName: uid, ContainerName: "c", DeviceIndex: device}
}

func TestReleaseUndoesTheContainerAReusedInstanceGoesIdleACreatedOneIsDestroyed(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	reused, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || !took || reused != cached.MigUUID {
		t.Fatalf("reuse: %s %t %v", reused, took, err)
	}
	created, err := l.EnsureAllocation(own("p", 1), 1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2})
	if err != nil || !created.Created || created.Reused {
		t.Fatalf("create: %+v %v", created, err)
	}
	if name, ok := m.CDIDevice(created.MigUUID); !ok || name == "" {
		t.Fatalf("CDI device of %s: %q %t", created.MigUUID, name, ok)
	}
	info, ok := m.AllocationRuntimeInfo(1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2})
	if !ok || info.MigUUID != created.MigUUID {
		t.Fatalf("runtime info %+v %t", info, ok)
	}
	// HAMi's rollback: Release for each device it took. The first undoes the container.
	for _, uuid := range []string{created.MigUUID, reused} {
		if err := m.Release(uuid); err != nil {
			t.Fatal(err)
		}
	}
	got := s.Instances()
	if len(got) != 1 || got[0].MigUUID != cached.MigUUID || got[0].State != pb.InstanceState_IDLE {
		t.Fatalf("after rollback: %+v", got)
	}
	if _, ok := m.AllocationRuntimeInfo(1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2}); ok {
		t.Fatal("the destroyed instance still has runtime info")
	}
	if err := m.Release("MIG-unknown"); err != nil {
		t.Fatalf("unknown MIG UUID: %v", err)
	}
}

func TestARepeatedEnsureAllocationIsNotTakenAgain(t *testing.T) {
	_, l := lazy(t)
	m := l.Manager()
	first, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil || !took {
		t.Fatal(took, err)
	}
	again, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil || took || again != first {
		t.Fatalf("repeat: %s %t %v, want %s not taken", again, took, err, first)
	}
	if _, _, err := m.EnsureAllocation(own("p", -1), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1}); err == nil {
		t.Fatal("a negative device index was sent")
	}
	if _, _, err := m.EnsureAllocation(own("p", 1), 9, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1}); err == nil {
		t.Fatal("an unknown GPU index was sent")
	}
}

func TestAdoptAllocationAcceptsOnlyTheIdentityTheSidecarHoldsActive(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	res, err := l.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	info, _ := m.AllocationRuntimeInfo(0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	at := nvml.GpuInstancePlacement{Start: 3, Size: 1}
	if err := m.AdoptAllocation(0, "1g.10gb", res.MigUUID, at, info.GIID, info.CIID); err != nil {
		t.Fatal(err)
	}
	if err := l.AdoptAllocation(0, "1g.10gb", res.MigUUID, at, info.GIID+1, info.CIID); !errors.Is(err, ErrNotLive) {
		t.Fatalf("wrong GI ID adopted: %v", err)
	}
	idle := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 5, Size: 1, State: pb.InstanceState_IDLE})
	if err := m.AdoptAllocation(0, "1g.10gb", idle.MigUUID, nvml.GpuInstancePlacement{Start: 5, Size: 1}, idle.GI, idle.CI); !errors.Is(err, ErrNotLive) {
		t.Fatalf("an IDLE instance adopted as live: %v", err)
	}
}

func TestResetIdleGPUsEnablesMigOnIdleGPUsAndKeepsTheCache(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	if done, err := l.DisableIdleGPUs(1, nil); err != nil || !slices.Equal(done, []int{0}) {
		t.Fatalf("disable GPU 0: %v %v", done, err)
	}
	reset, err := m.ResetIdleGPUs(2, map[int]struct{}{})
	if err != nil || !slices.Equal(reset, []int{0, 1}) || !s.MigEnabled("GPU-a") {
		t.Fatalf("reset %v %v, MIG on GPU-a %t", reset, err, s.MigEnabled("GPU-a"))
	}
	if got := s.Instances(); len(got) != 1 || got[0].State != pb.InstanceState_IDLE {
		t.Fatalf("the idle cache is gone: %+v", got)
	}
	s.ResetNeeded("GPU-a")
	if _, err := l.DisableIdleGPUs(1, nil); !errors.Is(err, ErrNeedsReset) {
		t.Fatalf("a disable pending a reset: %v", err)
	}
}

func TestDisableIdleGPUsRefusesABusyMigGPUAndDoesNotTakeTheAnswerForTheMode(t *testing.T) {
	s, l := lazy(t)
	if done, err := l.DisableIdleGPUs(2, map[int]struct{}{0: {}}); err == nil || len(done) != 0 || !s.MigEnabled("GPU-a") {
		t.Fatalf("a busy MIG GPU: %v %v", done, err)
	}
	s.IgnoreMigMode("GPU-a")
	if done, err := l.DisableIdleGPUs(1, nil); err == nil || errors.Is(err, ErrNeedsReset) || len(done) != 0 {
		t.Fatalf("disabled %v, %v; want none and an error naming the mode read back", done, err)
	}
}

func TestTheLazyExtrasAndShutdown(t *testing.T) {
	_, l := lazy(t)
	if got, err := l.RetryErrorAllocations(nil); err != nil || len(got) != 0 {
		t.Fatalf("retry: %v %v", got, err)
	}
	if err := l.RestoreAllocations(2, nil, nil, true); err == nil {
		t.Fatal("adoptExisting differing from the sidecar's was accepted")
	}
	if err := l.RestoreAllocations(2, nil, nil, false); err != nil {
		t.Fatal(err)
	}
	if err := l.ReconcileActiveAllocations(nil); err != nil {
		t.Fatal(err)
	}
	l.MarkIdle("MIG-unknown")
	if _, ok := l.CDIDevice("MIG-unknown"); ok {
		t.Fatal("a CDI device for an unknown MIG UUID")
	}
	l.Shutdown()
	l.Shutdown()
	if _, err := l.Manager().ResetIdleGPUs(1, nil); !errors.Is(err, ErrShutdown) {
		t.Fatalf("after Shutdown: %v", err)
	}
}
