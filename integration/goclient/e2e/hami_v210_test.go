// The hami adapter's method sets (PluginManager, LazyPluginManager) against a real sidecar, method by method,
// the way HAMi's plugin calls them: one EnsureAllocation per device, Release for what a failed
// container took, the runtime identity read back for the pod annotation, the reconciler's key
// set, the startup ResetIdleGPUs and AdoptAllocation, a new adapter over the same sidecar, and a
// sidecar restart recovered from the pod list.
package e2e

import (
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
)

// record puts what HAMi's annotateMigRuntimeInfo writes for one device into the pod list.
func (p *plugin) record(o hami.Owner, gpuUUID string, info hami.RuntimeInfo) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.active[o.PodUID] = append(p.active[o.PodUID], &pb.ActiveAllocation{
		Pod:           &pb.PodRef{Uid: o.PodUID, Namespace: o.PodNamespace, Name: o.PodName},
		ContainerName: o.ContainerName, ContainerIndex: uint32(o.ContainerIndex), DeviceIndex: uint32(o.DeviceIndex),
		GpuUuid: gpuUUID, Profile: info.Profile, Placement: &pb.Placement{Start: info.Placement.Start, Size: info.Placement.Size},
		MigUuid: info.MigUUID, GpuInstanceId: info.GIID, ComputeInstanceId: info.CIID,
	})
}

func TestTheV210AdapterAnswersEveryCallOfHAMisPlugin(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	gpu, at := int(gpus[0].Index), nvml.GpuInstancePlacement{Start: 0, Size: 1}
	m, err := hami.New(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}

	// Startup: GPU 1 idle with MIG off comes back on; GPU 0 in use is not touched.
	if _, err := c.SetMigMode(ctx, gpus[1].UUID, false); err != nil {
		t.Fatal(err)
	}
	reset, err := m.ResetIdleGPUs(len(gpus), map[int]struct{}{gpu: {}})
	if err != nil || slices.Contains(reset, gpu) || !slices.Contains(reset, int(gpus[1].Index)) {
		t.Fatalf("ResetIdleGPUs: %v %v", reset, err)
	}
	if after, err := c.ListGpus(ctx); err != nil || !after[gpus[1].Index].MigMode.Current {
		t.Fatalf("GPU 1 after ResetIdleGPUs: %+v %v", after, err)
	}

	// Create; the answer's runtime identity and CDI device; a repeat is not taken again.
	a := hami.Owner{PodUID: "a", PodNamespace: "e2e", PodName: "pod-a", ContainerName: "main"}
	migA, took, err := m.EnsureAllocation(a, gpu, "1g.10gb", at)
	if err != nil || !took {
		t.Fatalf("create: %s %t %v", migA, took, err)
	}
	info, ok := m.AllocationRuntimeInfo(gpu, "1g.10gb", at)
	if !ok || info.MigUUID != migA || info.Placement != at || info.Profile != "1g.10gb" {
		t.Fatalf("runtime info %+v %t", info, ok)
	}
	name, ok := m.CDIDevice(migA)
	if !ok || !slices.ContainsFunc(specNames(t), func(spec string) bool {
		return strings.Contains(spec, migA) && strings.Contains(spec, name[strings.Index(name, "=")+1:])
	}) {
		t.Fatalf("CDI device %q %t names no spec the sidecar wrote", name, ok)
	}
	if again, took, err := m.EnsureAllocation(a, gpu, "1g.10gb", at); err != nil || took || again != migA {
		t.Fatalf("repeat: %s %t %v", again, took, err)
	}
	p.record(a, gpus[0].UUID, info)
	if err := m.AdoptAllocation(gpu, "1g.10gb", migA, at, info.GIID, info.CIID); err != nil {
		t.Fatal(err)
	}
	if err := m.AdoptAllocation(gpu, "1g.10gb", migA, at, info.GIID, info.CIID+1); !errors.Is(err, hami.ErrNotLive) {
		t.Fatalf("a wrong CI ID adopted: %v", err)
	}

	// Rollback of a created device: device 0 created, device 1 refused.
	b := hami.Owner{PodUID: "b", PodNamespace: "e2e", PodName: "pod-b", ContainerName: "main"}
	migB, took, err := m.EnsureAllocation(b, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 1, Size: 1})
	if err != nil || !took {
		t.Fatal(migB, took, err)
	}
	b.DeviceIndex = 1
	if _, _, err := m.EnsureAllocation(b, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 7, Size: 1}); err == nil {
		t.Fatal("an illegal placement was allocated")
	}
	b.DeviceIndex = 0
	if err := m.Release(b, migB); err != nil {
		t.Fatal(err)
	}
	if uuids, _ := hardware(t); !slices.Equal(uuids, []string{migA}) {
		t.Fatalf("hardware after the rollback of a created device: %v", uuids)
	}

	// Pod a goes; the reconciler's pass idles its instance; pod c reuses it and rolls back.
	p.forget("a")
	if err := m.ReconcileActiveAllocations(map[hami.AllocationKey]struct{}{}); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, c); s[migA] != pb.InstanceState_IDLE {
		t.Fatalf("after the release: %v", s)
	}
	if _, ok := m.AllocationRuntimeInfo(gpu, "1g.10gb", at); ok {
		t.Fatal("an IDLE instance reported as a realized reservation")
	}
	cOwner := hami.Owner{PodUID: "c", PodNamespace: "e2e", PodName: "pod-c", ContainerName: "main"}
	reused, took, err := m.EnsureAllocation(cOwner, gpu, "1g.10gb", at)
	if err != nil || !took || reused != migA {
		t.Fatalf("reuse: %s %t %v", reused, took, err)
	}
	if err := m.Release(cOwner, reused); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, c); len(s) != 1 || s[migA] != pb.InstanceState_IDLE {
		t.Fatalf("after the rollback of a reused device: %v", s)
	}

	// A new adapter over the same sidecar (a restarted plugin) sees and releases the same state.
	m.Shutdown()
	if _, _, err := m.EnsureAllocation(cOwner, gpu, "1g.10gb", at); !errors.Is(err, hami.ErrShutdown) {
		t.Fatalf("after Shutdown: %v", err)
	}
	m2, err := hami.New(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	d := hami.Owner{PodUID: "d", PodNamespace: "e2e", PodName: "pod-d", ContainerName: "main"}
	migD, took, err := m2.EnsureAllocation(d, gpu, "1g.10gb", at)
	if err != nil || !took || migD != migA {
		t.Fatalf("reuse through a new adapter: %s %t %v", migD, took, err)
	}
	info, _ = m2.AllocationRuntimeInfo(gpu, "1g.10gb", at)
	p.record(d, gpus[0].UUID, info)

	// The sidecar is killed and restarted: the next call recovers it from the pod list.
	restart := exec.Command("/bin/sh", "-c", env(t, "MIGSIDECAR_RESTART_CMD"))
	if out, err := restart.CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	if err := m2.AdoptAllocation(gpu, "1g.10gb", migD, at, info.GIID, info.CIID); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	if s := states(ctx, t, c); len(s) != 1 || s[migD] != pb.InstanceState_ACTIVE {
		t.Fatalf("after the restart: %v", s)
	}
	if name, ok := m2.CDIDevice(migD); !ok || name == "" {
		t.Fatalf("CDI device after the restart: %q %t", name, ok)
	}
	m2.Shutdown()
}

func TestTheLazyAdapterAnswersThePR3128MethodSet(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	gpu, at := int(gpus[0].Index), nvml.GpuInstancePlacement{Start: 2, Size: 1}
	l, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.RestoreAllocations(len(gpus), nil, map[string]hami.OwnershipRecord{}, false); err != nil {
		t.Fatal(err)
	}
	if got, err := l.RetryErrorAllocations(map[hami.AllocationKey]struct{}{}); err != nil || len(got) != 0 {
		t.Fatalf("RetryErrorAllocations: %v %v", got, err)
	}
	o := hami.Owner{PodUID: "x", PodNamespace: "e2e", PodName: "pod-x", ContainerName: "main"}
	first, err := l.EnsureAllocation(o, gpu, "1g.10gb", at)
	if err != nil || !first.Created || first.Reused {
		t.Fatalf("create: %+v %v", first, err)
	}
	info, ok := l.AllocationRuntimeInfo(gpu, "1g.10gb", at)
	if !ok || info.MigUUID != first.MigUUID {
		t.Fatalf("runtime info %+v %t", info, ok)
	}
	if err := l.AdoptAllocation(gpu, "1g.10gb", first.MigUUID, at, info.GIID, info.CIID); err != nil {
		t.Fatal(err)
	}
	if name, ok := l.CDIDevice(first.MigUUID); !ok || name == "" {
		t.Fatalf("CDI device %q %t", name, ok)
	}
	if err := l.ReconcileActiveAllocations(nil); err != nil { // pod x was never annotated: released
		t.Fatal(err)
	}
	y := hami.Owner{PodUID: "y", PodNamespace: "e2e", PodName: "pod-y", ContainerName: "main"}
	again, err := l.EnsureAllocation(y, gpu, "1g.10gb", at)
	if err != nil || !again.Reused || again.Created || again.MigUUID != first.MigUUID {
		t.Fatalf("reuse: %+v %v", again, err)
	}
	l.MarkIdle(y, again.MigUUID) // the allocation failed later
	if s := states(ctx, t, c); len(s) != 1 || s[first.MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("after MarkIdle: %v", s)
	}
	if err := l.Release(y, again.MigUUID); err != nil { // not ACTIVE any more: nothing to undo
		t.Fatal(err)
	}
	big, err := l.EnsureAllocation(y, gpu, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2})
	if err != nil || !big.Created || !slices.Equal(big.Reclaimed, []string{first.MigUUID}) {
		t.Fatalf("create over the idle instance: %+v %v", big, err)
	}
	if err := l.Release(y, big.MigUUID); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, c); len(s) != 0 {
		t.Fatalf("after Release: %v", s)
	}
	l.Shutdown()
	if err := l.RestoreAllocations(len(gpus), nil, nil, false); !errors.Is(err, hami.ErrShutdown) {
		t.Fatalf("after Shutdown: %v", err)
	}
}
