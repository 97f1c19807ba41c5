// The HAMi lazy-lifecycle scenarios of the 4.1 additions UndoAllocate, ReclaimIdle and SetMigMode
// reclaim_idle, through the client and the hami adapter against a real sidecar.
package e2e

import (
	"slices"
	"testing"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestAReuseThenFailRollbackAfterASuccessfulAllocateLeavesTheCacheAsItWas(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	first := allocate(ctx, t, c, p, request("first", dev(gpus[0], "1g.10gb", 0, 1)))
	p.forget("first")
	if _, err := c.ReleaseByPodList(ctx, p.list); err != nil {
		t.Fatal(err)
	}
	m, err := hami.New(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	owner := hami.Owner{PodUID: "second", Namespace: "e2e", Name: "second", ContainerName: "main"}
	res, err := m.EnsureContainer(ctx, owner, []hami.Reservation{
		{DeviceIndex: 0, GPUIndex: int(gpus[0].Index), Profile: "1g.10gb", Placement: hami.Placement{Start: 0, Size: 1}},
		{DeviceIndex: 1, GPUIndex: int(gpus[0].Index), Profile: "1g.10gb", Placement: hami.Placement{Start: 1, Size: 1}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res[0].Reused || res[0].MigUUID != first.Devices[0].MigUUID || !res[1].Created {
		t.Fatalf("results %+v", res)
	}
	undo, err := m.UndoContainer(ctx, owner) // the annotation patch failed
	if err != nil {
		t.Fatal(err)
	}
	if len(undo.Destroyed) != 1 || undo.Destroyed[0].MigUUID != res[1].MigUUID || len(undo.Idled) != 1 {
		t.Fatalf("undo %+v", undo)
	}
	s := states(ctx, t, c)
	if len(s) != 1 || s[first.Devices[0].MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("after rollback: %v", s)
	}
	if again, err := m.UndoContainer(ctx, owner); err != nil || len(again.Destroyed)+len(again.Idled) != 0 {
		t.Fatalf("repeated undo: %+v %v", again, err)
	}
}

func TestReclaimIdleRefusesAnActiveInstanceAndDestroysTheIdleOne(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	keep := allocate(ctx, t, c, p, request("keep", dev(gpus[1], "1g.10gb", 0, 1)))
	gone := allocate(ctx, t, c, p, request("gone", dev(gpus[1], "1g.10gb", 1, 1)))
	p.forget("gone")
	if _, err := c.ReleaseByPodList(ctx, p.list); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ReclaimIdle(ctx, gpus[1].UUID, keep.Devices[0].MigUUID); !migclient.IsReason(err, migclient.ReasonNotIdle) {
		t.Fatalf("reclaim of an ACTIVE instance: %v", err)
	}
	if _, err := c.ReclaimIdle(ctx, gpus[1].UUID, "MIG-00000000-0000-0000-0000-000000000000"); !migclient.IsReason(err, migclient.ReasonUnknownInstance) {
		t.Fatalf("reclaim of an unknown instance: %v", err)
	}
	got, err := c.ReclaimIdle(ctx, gpus[1].UUID)
	if err != nil || len(got) != 1 || got[0].MigUUID != gone.Devices[0].MigUUID {
		t.Fatalf("reclaim: %+v %v", got, err)
	}
	if s := states(ctx, t, c); len(s) != 1 || s[keep.Devices[0].MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("after reclaim: %v", s)
	}
}

func TestDisablingMigOnAGPUWithOnlyIdleInstancesDestroysThemFirst(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	allocate(ctx, t, c, p, request("cached", dev(gpus[1], "2g.20gb", 0, 2)))
	p.forget("cached")
	if _, err := c.ReleaseByPodList(ctx, p.list); err != nil {
		t.Fatal(err)
	}
	m, err := hami.New(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	inUse := map[int]struct{}{}
	for _, g := range gpus {
		if g.UUID != gpus[1].UUID {
			inUse[int(g.Index)] = struct{}{}
		}
	}
	// The simulated H100 changes MIG mode in place, so the disable must be done, not pending.
	done, err := m.DisableIdleGPUs(ctx, inUse)
	if err != nil || !slices.Equal(done, []int{int(gpus[1].Index)}) {
		t.Fatalf("disabled %v, %v; want GPU %d", done, err, gpus[1].Index)
	}
	if s := states(ctx, t, c); len(s) != 0 {
		t.Fatalf("instances left after disable: %v", s)
	}
	after, err := c.ListGpus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range after {
		if on := g.UUID != gpus[1].UUID; g.MigMode.Current != on || g.MigMode.Pending != on {
			t.Fatalf("GPU %d MIG mode %+v after disabling only GPU %d", g.Index, g.MigMode, gpus[1].Index)
		}
	}
	if _, gis := hardware(t); len(gis) != 0 {
		t.Fatalf("GPU instances left after disable: %v", gis)
	}
	// A second pass finds nothing to do: the GPU is off, not pending.
	if again, err := m.DisableIdleGPUs(ctx, inUse); err != nil || len(again) != 0 {
		t.Fatalf("second pass: %v %v", again, err)
	}
}
