package annotation

import (
	"errors"
	"testing"
)

const allocated = `[{"containerIndex":0,"deviceIndex":1,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1},
  "migUUID":"MIG-1","gpuInstanceID":0,"computeInstanceID":0},
 {"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"2g.20gb","placement":{"start":0,"size":2},"extra":true},
 {"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-b","profile":"3g.40gb","placement":{"start":4,"size":4}}]`

func TestParseReadsReservationsAndRuntimeIdentityIncludingZeroIDs(t *testing.T) {
	allocs, err := Parse(allocated)
	if err != nil {
		t.Fatal(err)
	}
	if len(allocs) != 3 {
		t.Fatalf("got %d entries", len(allocs))
	}
	first := allocs[0]
	if !first.HasRuntimeIdentity() || *first.GPUInstanceID != 0 || *first.ComputeInstanceID != 0 || first.MigUUID != "MIG-1" {
		t.Fatalf("runtime identity with zero IDs not kept: %+v", first)
	}
	if allocs[1].HasRuntimeIdentity() {
		t.Fatal("an entry without runtime fields must be pending")
	}
	c0 := ForContainer(allocs, 0)
	if len(c0) != 2 || c0[0].DeviceIndex != 0 || c0[1].DeviceIndex != 1 {
		t.Fatalf("container 0 not sorted by device index: %+v", c0)
	}
}

func TestParseTreatsAnEmptyValueAsNoReservations(t *testing.T) {
	allocs, err := Parse("  ")
	if err != nil || allocs != nil {
		t.Fatalf("got %v, %v", allocs, err)
	}
}

func TestParseRejectsMalformedAnnotations(t *testing.T) {
	cases := map[string]string{
		"not json":         `{`,
		"not an array":     `{"containerIndex":0}`,
		"null entry":       `[null]`,
		"negative index":   `[{"containerIndex":-1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1}}]`,
		"empty gpu":        `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"","profile":"1g.10gb","placement":{"start":0,"size":1}}]`,
		"empty profile":    `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"","placement":{"start":0,"size":1}}]`,
		"no placement":     `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb"}]`,
		"zero size":        `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":0}}]`,
		"partial identity": `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1},"migUUID":"MIG-1","gpuInstanceID":3}]`,
		"ids without uuid": `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1},"gpuInstanceID":3,"computeInstanceID":0}]`,
		"not a MIG uuid":   `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1},"migUUID":"GPU-x","gpuInstanceID":3,"computeInstanceID":0}]`,
		"duplicate key": `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1}},
		                   {"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":1,"size":1}}]`,
	}
	for name, value := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse(value); !errors.Is(err, ErrInvalid) {
				t.Fatalf("want ErrInvalid, got %v", err)
			}
		})
	}
}

func TestRuntimeIdentityRoundTripsThroughEncode(t *testing.T) {
	allocs, err := Parse(allocated)
	if err != nil {
		t.Fatal(err)
	}
	patched, err := WithRuntimeIdentity(allocs, 1, []Identity{{DeviceIndex: 0, MigUUID: "MIG-2", GPUInstanceID: 2, ComputeInstanceID: 0}})
	if err != nil {
		t.Fatal(err)
	}
	text, err := Encode(patched)
	if err != nil {
		t.Fatal(err)
	}
	again, err := Parse(text)
	if err != nil {
		t.Fatal(err)
	}
	c1 := ForContainer(again, 1)
	if len(c1) != 1 || c1[0].MigUUID != "MIG-2" || *c1[0].GPUInstanceID != 2 || *c1[0].ComputeInstanceID != 0 {
		t.Fatalf("identity lost: %+v", c1)
	}
	if allocs[2].HasRuntimeIdentity() {
		t.Fatal("WithRuntimeIdentity changed its input")
	}
}

func TestWithRuntimeIdentityRefusesToHalfAnnotateAContainer(t *testing.T) {
	allocs, err := Parse(allocated)
	if err != nil {
		t.Fatal(err)
	}
	_, err = WithRuntimeIdentity(allocs, 0, []Identity{{DeviceIndex: 0, MigUUID: "MIG-3"}})
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("missing identity for device 1 accepted: %v", err)
	}
	_, err = WithRuntimeIdentity(allocs, 1, []Identity{{DeviceIndex: 0, MigUUID: "MIG-3"}, {DeviceIndex: 7, MigUUID: "MIG-4"}})
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("identity for an unknown device accepted: %v", err)
	}
}

func TestActiveAllocationsCarryPodContainerAndIdentity(t *testing.T) {
	allocs, err := Parse(allocated)
	if err != nil {
		t.Fatal(err)
	}
	pod := Pod{UID: "u1", Namespace: "ns", Name: "p", ContainerNames: []string{"init", "main"}, Allocations: allocs}
	onlyAllocated, err := pod.ActiveAllocations(false)
	if err != nil {
		t.Fatal(err)
	}
	if len(onlyAllocated) != 1 || onlyAllocated[0].GetMigUuid() != "MIG-1" || onlyAllocated[0].GetContainerName() != "init" ||
		onlyAllocated[0].GetPod().GetUid() != "u1" || onlyAllocated[0].GetPlacement().GetStart() != 6 {
		t.Fatalf("unexpected %v", onlyAllocated)
	}
	all, err := pod.ActiveAllocations(true)
	if err != nil || len(all) != 3 {
		t.Fatalf("pending entries not included: %v %v", all, err)
	}
	pod.ContainerNames = []string{"only"}
	if _, err := pod.ActiveAllocations(true); !errors.Is(err, ErrInvalid) {
		t.Fatalf("container index beyond the pod accepted: %v", err)
	}
}
