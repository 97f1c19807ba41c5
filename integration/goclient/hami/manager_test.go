package hami

import (
	"context"
	"errors"
	"testing"
	"time"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func manager(t *testing.T) (*fakesidecar.Server, *Manager) {
	t.Helper()
	s, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	c, err := migclient.New(context.Background(), socket, migclient.Options{CallTimeout: 5 * time.Second,
		AllocateTimeout: 5 * time.Second, MaxAttempts: 3, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	m, err := New(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return s, m
}

var owner = Owner{PodUID: "p", Namespace: "ns", Name: "p", ContainerName: "c"}

func TestAReusedAllocationRollsBackToIdleAndACreatedOneIsDestroyed(t *testing.T) {
	s, m := manager(t)
	ctx := context.Background()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	res, err := m.EnsureContainer(ctx, owner, []Reservation{
		{DeviceIndex: 0, GPUIndex: 0, Profile: "1g.10gb", Placement: Placement{0, 1}},
		{DeviceIndex: 1, GPUIndex: 1, Profile: "2g.20gb", Placement: Placement{2, 2}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res[0].Reused || res[0].MigUUID != cached.MigUUID || !res[1].Created || res[1].CDIDevice == "" {
		t.Fatalf("results %+v", res)
	}
	info, ok, err := m.AllocationRuntimeInfo(ctx, 1, "2g.20gb", Placement{2, 2})
	if err != nil || !ok || info.MigUUID != res[1].MigUUID {
		t.Fatalf("runtime info %+v %t %v", info, ok, err)
	}
	// The annotation patch failed: roll back as the plugin's deferred rollback does.
	if err := m.Release(ctx, owner); err != nil {
		t.Fatal(err)
	}
	if err := m.MarkIdle(ctx, owner); err != nil {
		t.Fatal(err)
	}
	got := s.Instances()
	if len(got) != 1 || got[0].MigUUID != cached.MigUUID || got[0].State != pb.InstanceState_IDLE {
		t.Fatalf("after rollback: %+v", got)
	}
	if _, ok, _ := m.AllocationRuntimeInfo(ctx, 1, "2g.20gb", Placement{2, 2}); ok {
		t.Fatal("the destroyed instance still has runtime info")
	}
}

func TestAdoptAllocationAcceptsOnlyTheIdentityTheSidecarHoldsActive(t *testing.T) {
	s, m := manager(t)
	ctx := context.Background()
	res, err := m.EnsureAllocation(ctx, owner, 0, 0, "1g.10gb", Placement{3, 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.AdoptAllocation(ctx, 0, "1g.10gb", res.MigUUID, Placement{3, 1}, res.GIID, res.CIID); err != nil {
		t.Fatal(err)
	}
	if err := m.AdoptAllocation(ctx, 0, "1g.10gb", res.MigUUID, Placement{3, 1}, res.GIID+1, res.CIID); !errors.Is(err, ErrNotLive) {
		t.Fatalf("wrong GI ID adopted: %v", err)
	}
	idle := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 5, Size: 1, State: pb.InstanceState_IDLE})
	if err := m.AdoptAllocation(ctx, 0, "1g.10gb", idle.MigUUID, Placement{5, 1}, idle.GI, idle.CI); !errors.Is(err, ErrNotLive) {
		t.Fatalf("an IDLE instance adopted as live: %v", err)
	}
}

func TestDisableIdleGPUsDestroysIdleInstancesAndSkipsBusyGPUs(t *testing.T) {
	s, m := manager(t)
	ctx := context.Background()
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "2g.20gb", Start: 0, Size: 2, State: pb.InstanceState_IDLE})
	s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_ACTIVE})
	done, err := m.DisableIdleGPUs(ctx, map[int]struct{}{1: {}})
	if err != nil || len(done) != 1 || done[0] != 0 {
		t.Fatalf("disabled %v, %v", done, err)
	}
	if s.MigEnabled("GPU-a") || !s.MigEnabled("GPU-b") {
		t.Fatal("MIG modes wrong after the pass")
	}
	if got := s.Instances(); len(got) != 1 || got[0].GPU != "GPU-b" {
		t.Fatalf("instances %+v", got)
	}
	if err := m.EnsureMigModeEnabled(ctx, 0); err != nil || !s.MigEnabled("GPU-a") {
		t.Fatalf("re-enable: %v", err)
	}
	if err := m.RetryErrorAllocations(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestDiscoverProfilesPublishesTheReusablePlacementFirst(t *testing.T) {
	s, m := manager(t)
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "2g.20gb", Start: 4, Size: 2, State: pb.InstanceState_IDLE})
	profiles, count, err := m.DiscoverProfiles(context.Background(), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range profiles {
		if p.Name == "2g.20gb" && (p.Placements[0].Start != 4 || len(p.Placements) != 3) {
			t.Fatalf("2g.20gb placements %+v", p.Placements)
		}
	}
	if count != 7 {
		t.Fatalf("instance count %d, want 7", count)
	}
}

func TestDisableIdleGPUsReportsAPendingDisableAsNeedsReset(t *testing.T) {
	s, m := manager(t)
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	s.ResetNeeded("GPU-a")
	done, err := m.DisableIdleGPUs(context.Background(), map[int]struct{}{1: {}})
	if !errors.Is(err, ErrNeedsReset) || len(done) != 0 {
		t.Fatalf("disabled %v, %v; want none and ErrNeedsReset", done, err)
	}
	if !s.MigEnabled("GPU-a") || len(s.Instances()) != 0 {
		t.Fatalf("MIG on %t, instances %+v: want MIG still on (pending off) and the idle instance gone", s.MigEnabled("GPU-a"), s.Instances())
	}
}

func TestDisableIdleGPUsDoesNotTakeTheAnswerForTheMode(t *testing.T) {
	s, m := manager(t)
	s.IgnoreMigMode("GPU-a")
	done, err := m.DisableIdleGPUs(context.Background(), map[int]struct{}{1: {}})
	if err == nil || errors.Is(err, ErrNeedsReset) || len(done) != 0 {
		t.Fatalf("disabled %v, %v; want none and an error naming the mode read back", done, err)
	}
	if !s.MigEnabled("GPU-a") {
		t.Fatal("the fake changed the mode it was told to ignore")
	}
}
