package main

import (
	"testing"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// scheduledPod is a pod as the schedule step leaves it: one container with one reservation.
func scheduledPod(t *testing.T) (*storedPod, []annotation.Allocation) {
	t.Helper()
	allocs := []annotation.Allocation{{
		ContainerIndex: 0, DeviceIndex: 0, GPUUUID: "GPU-a", Profile: "1g.10gb",
		Placement: &annotation.Placement{Start: 6, Size: 1},
	}}
	text, err := annotation.Encode(allocs)
	if err != nil {
		t.Fatal(err)
	}
	return &storedPod{
		UID: "uid-1", Namespace: "default", Name: "train", Containers: []string{"main"},
		Annotation: map[string]string{annotation.Key: text},
	}, allocs
}

func allocated(migUUID string) []migclient.AllocatedDevice {
	return []migclient.AllocatedDevice{{
		DeviceIndex: 0, GPUUUID: "GPU-a", Profile: "1g.10gb", Placement: migclient.Placement{Start: 6, Size: 1},
		MigUUID: migUUID, GPUInstanceID: 0, ComputeInstanceID: 0, Outcome: migclient.OutcomeCreated,
	}}
}

func TestAnAllocatedContainerGetsItsRuntimeIdentityInTheAnnotation(t *testing.T) {
	sp, allocs := scheduledPod(t)
	if err := recordIdentity(sp, allocs, 0, allocated("MIG-1fabbad4-1984-57cf-b48e-500e47c07038")); err != nil {
		t.Fatal(err)
	}
	pod, err := sp.parsed()
	if err != nil {
		t.Fatal(err)
	}
	got := pod.Allocations[0]
	if !got.HasRuntimeIdentity() || got.MigUUID != "MIG-1fabbad4-1984-57cf-b48e-500e47c07038" || *got.GPUInstanceID != 0 {
		t.Fatalf("runtime identity not recorded: %+v", got)
	}
}

func TestAnIdentityThatCannotBeWrittenLeavesTheAnnotationAsItWas(t *testing.T) {
	sp, allocs := scheduledPod(t)
	before := sp.Annotation[annotation.Key]
	if err := recordIdentity(sp, allocs, 0, allocated("GPU-a")); err == nil {
		t.Fatal("an identity that is no MIG UUID was written")
	}
	if got := sp.Annotation[annotation.Key]; got != before {
		t.Fatalf("annotation changed to %q, want the scheduler's %q", got, before)
	}
	if _, err := sp.parsed(); err != nil {
		t.Fatalf("the pod's annotation no longer parses: %v", err)
	}
}
