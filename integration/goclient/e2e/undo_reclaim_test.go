// The HAMi lazy-lifecycle scenarios of the 4.1 additions UndoAllocate, ReclaimIdle and SetMigMode
// reclaim_idle, through the client and the hami adapter against a real sidecar.
package e2e

import (
	"slices"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

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
	m, err := hami.New(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	owner := hami.Owner{PodUID: "second", PodNamespace: "e2e", PodName: "second", ContainerName: "main"}
	gpu := int(gpus[0].Index)
	reused, took, err := m.EnsureAllocation(owner, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || !took || reused != first.Devices[0].MigUUID {
		t.Fatalf("device 0: %s %t %v, want %s reused", reused, took, err, first.Devices[0].MigUUID)
	}
	owner.DeviceIndex = 1
	created, took, err := m.EnsureAllocation(owner, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 1, Size: 1})
	if err != nil || !took {
		t.Fatalf("device 1: %s %t %v", created, took, err)
	}
	// A later step failed: HAMi's rollback releases what it took, newest first.
	for i, uuid := range []string{reused, created} {
		owner.DeviceIndex = i
		if err := m.Release(owner, uuid); err != nil {
			t.Fatal(err)
		}
	}
	s := states(ctx, t, c)
	if len(s) != 1 || s[first.Devices[0].MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("after rollback: %v", s)
	}
	if uuids, _ := hardware(t); !slices.Equal(uuids, []string{reused}) {
		t.Fatalf("hardware after rollback: %v, want only %s", uuids, reused)
	}
	if owner.DeviceIndex = 0; m.Release(owner, reused) != nil || len(states(ctx, t, c)) != 1 {
		t.Fatalf("repeated release: %v %v", err, states(ctx, t, c))
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
	l, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	// The two simulated H100s change MIG mode in place (the A100 would wait for a reset).
	const h100s = 2
	// A GPU in use that is in MIG mode stops the pass before anything changes.
	if done, err := l.DisableIdleGPUs(h100s, map[int]struct{}{int(gpus[0].Index): {}}); err == nil || len(done) != 0 {
		t.Fatalf("a busy MIG GPU: disabled %v, %v", done, err)
	}
	if s := states(ctx, t, c); len(s) != 1 {
		t.Fatalf("the refused pass changed the instances: %v", s)
	}
	done, err := l.DisableIdleGPUs(h100s, nil)
	if err != nil || !slices.Equal(done, []int{0, 1}) {
		t.Fatalf("disabled %v, %v; want both H100s", done, err)
	}
	if s := states(ctx, t, c); len(s) != 0 {
		t.Fatalf("instances left after disable: %v", s)
	}
	after, err := c.ListGpus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range after {
		if on := g.Index >= h100s; g.MigMode.Current != on || g.MigMode.Pending != on {
			t.Fatalf("GPU %d MIG mode %+v after disabling GPUs 0 and 1", g.Index, g.MigMode)
		}
	}
	if _, gis := hardware(t); len(gis) != 0 {
		t.Fatalf("GPU instances left after disable: %v", gis)
	}
	// A second pass finds them off, not pending, and changes nothing.
	if again, err := l.DisableIdleGPUs(h100s, nil); err != nil || len(again) != h100s {
		t.Fatalf("second pass: %v %v", again, err)
	}
	// In mig mode again: RestoreAllocations enables MIG on the GPUs not in use.
	if err := l.RestoreAllocations(h100s, nil, nil, false); err != nil {
		t.Fatal(err)
	}
	if after, err = c.ListGpus(ctx); err != nil {
		t.Fatal(err)
	}
	for _, g := range after {
		if !g.MigMode.Current {
			t.Fatalf("GPU %d MIG mode %+v after RestoreAllocations", g.Index, g.MigMode)
		}
	}
}
