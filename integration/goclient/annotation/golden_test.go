package annotation

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// The files under testdata/hami are hami.io/vgpu-mig-allocations values in HAMi's format, written
// as data from its documented and observed shape (no HAMi code): the scheduler's reservations
// (containerIndex, deviceIndex, gpuUUID, profile, placement), then the device plugin's runtime
// identity (migUUID, gpuInstanceID, computeInstanceID, 0 written as 0) added container by
// container, compact and in container-then-device order as HAMi's json.Marshal writes them;
// documented.json is the indented form of HAMi's developer documentation.

const (
	gpu0 = "GPU-8e3b5a41-6f0c-4d9e-9a1b-2c7d4e5f6a70"
	gpu1 = "GPU-1f2e3d4c-5b6a-4798-8a9b-0c1d2e3f4a5b"
)

func id(v uint32) *uint32 { return &v }

func scheduled() []Allocation {
	return []Allocation{
		{ContainerIndex: 0, DeviceIndex: 0, GPUUUID: gpu0, Profile: "1g.18gb", Placement: &Placement{Start: 6, Size: 1}},
		{ContainerIndex: 1, DeviceIndex: 0, GPUUUID: gpu0, Profile: "3g.71gb", Placement: &Placement{Start: 0, Size: 4}},
		{ContainerIndex: 1, DeviceIndex: 1, GPUUUID: gpu1, Profile: "2g.35gb", Placement: &Placement{Start: 4, Size: 2}},
	}
}

func golden(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "hami", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestTheCodecReadsAndWritesHAMisFormatByteForByte(t *testing.T) {
	first := scheduled()
	first[0].MigUUID, first[0].GPUInstanceID, first[0].ComputeInstanceID = "MIG-4a5b6c7d-8e9f-5a0b-9c1d-2e3f4a5b6c7d", id(13), id(0)
	all := scheduled()
	copy(all[:1], first[:1])
	all[1].MigUUID, all[1].GPUInstanceID, all[1].ComputeInstanceID = "MIG-0b1c2d3e-4f5a-5b6c-8d7e-9f0a1b2c3d4e", id(2), id(0)
	all[2].MigUUID, all[2].GPUInstanceID, all[2].ComputeInstanceID = "MIG-9c8b7a6f-5e4d-5c3b-a2a1-0f9e8d7c6b5a", id(0), id(0)
	for _, tc := range []struct {
		file    string
		want    []Allocation
		pending int // reservations without runtime identity
	}{
		{"scheduled.json", scheduled(), 3},
		{"first-container-allocated.json", first, 2},
		{"all-allocated.json", all, 0},
	} {
		t.Run(tc.file, func(t *testing.T) {
			raw := golden(t, tc.file)
			got, err := Parse(raw)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("parsed %+v\nwant   %+v", got, tc.want)
			}
			pending := 0
			for _, a := range got {
				if !a.HasRuntimeIdentity() {
					pending++
				}
			}
			if pending != tc.pending {
				t.Fatalf("%d pending reservations, want %d", pending, tc.pending)
			}
			out, err := Encode(got)
			if err != nil || out != raw {
				t.Fatalf("encoded %s (%v)\nwant    %s", out, err, raw)
			}
		})
	}
}

func TestTheCodecAddsTheRuntimeIdentityAsHAMisPluginDoes(t *testing.T) {
	allocs, err := Parse(golden(t, "scheduled.json"))
	if err != nil {
		t.Fatal(err)
	}
	withFirst, err := WithRuntimeIdentity(allocs, 0, []Identity{{MigUUID: "MIG-4a5b6c7d-8e9f-5a0b-9c1d-2e3f4a5b6c7d", GPUInstanceID: 13, ComputeInstanceID: 0}})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := Encode(withFirst); err != nil || out != golden(t, "first-container-allocated.json") {
		t.Fatalf("after the first container: %s %v", out, err)
	}
}

func TestTheDocumentedExampleParses(t *testing.T) {
	got, err := Parse(golden(t, "documented.json"))
	if err != nil {
		t.Fatal(err)
	}
	want := []Allocation{{ContainerIndex: 0, DeviceIndex: 0, GPUUUID: gpu0, Profile: "2g.10gb", Placement: &Placement{Start: 2, Size: 2},
		MigUUID: "MIG-4a5b6c7d-8e9f-5a0b-9c1d-2e3f4a5b6c7d", GPUInstanceID: id(4), ComputeInstanceID: id(0)}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parsed %+v", got)
	}
}
