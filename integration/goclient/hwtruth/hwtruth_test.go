// Package hwtruth checks the simulator's MIG tables against a second source: the MIG profile
// tables of go-nvml's mock GPUs (github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus). For every model
// both describe, each GI profile index is compared: slices, instance count, memory, SMs and the
// legal placements. A difference the simulator's source notes explain (sidecar/nvml/tables) is
// listed in knownDifferences with the source that wins; any other difference fails the test.
// testdata/sim-tables.json is `python -m sidecar.nvml.tables.export`; a Python test keeps it current.
package hwtruth

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
)

type simProfile struct {
	Index               int        `json:"index"`
	ID                  int        `json:"id"`
	Name                string     `json:"name"`
	SliceCount          uint32     `json:"slice_count"`
	InstanceCount       uint32     `json:"instance_count"`
	MemoryMB            uint64     `json:"memory_mb"`
	MultiprocessorCount uint32     `json:"multiprocessor_count"`
	Placements          [][2]int64 `json:"placements"`
}

type simModel struct {
	Name     string       `json:"name"`
	MemoryMB uint64       `json:"memory_mb"`
	Profiles []simProfile `json:"profiles"`
}

// The models both sources describe: simulator key -> go-nvml's config.
var pairs = map[string]gpus.Config{
	"a100-40gb":  gpus.A100_SXM4_40GB,
	"a100-80gb":  gpus.A100_SXM4_80GB,
	"a30":        gpus.A30_PCIE_24GB,
	"h100-80gb":  gpus.H100_SXM5_80GB,
	"h200-141gb": gpus.H200_SXM5_141GB,
	"b200":       gpus.B200_SXM5_180GB,
}

// A difference between the two sources on one field of one GI profile.
type difference struct {
	where, field string
	sim, mock    any
	profile      simProfile
	model        simModel
	config       gpus.Config
}

func (d difference) String() string {
	return fmt.Sprintf("%s %s: simulator %v, go-nvml %v", d.where, d.field, d.sim, d.mock)
}

func differences(t *testing.T) ([]difference, []string) {
	t.Helper()
	raw, err := os.ReadFile("testdata/sim-tables.json")
	if err != nil {
		t.Fatal(err)
	}
	var sim map[string]simModel
	if err := json.Unmarshal(raw, &sim); err != nil {
		t.Fatal(err)
	}
	var out []difference
	var missing []string
	for key, mock := range pairs {
		model, ok := sim[key]
		if !ok {
			t.Fatalf("the simulator has no model %s", key)
		}
		seen := map[int]bool{}
		for _, p := range model.Profiles {
			seen[p.Index] = true
			info, ok := mock.MIGProfiles.GpuInstanceProfiles[p.Index]
			where := fmt.Sprintf("%s %s (index %d)", key, p.Name, p.Index)
			if !ok {
				missing = append(missing, where+": not in go-nvml")
				continue
			}
			diff := func(field string, ours, theirs any) {
				if fmt.Sprint(ours) != fmt.Sprint(theirs) {
					out = append(out, difference{where, field, ours, theirs, p, model, mock})
				}
			}
			diff("id", p.ID, info.Id)
			diff("slices", p.SliceCount, info.SliceCount)
			diff("instances", p.InstanceCount, info.InstanceCount)
			diff("memory MiB", p.MemoryMB, info.MemorySizeMB)
			diff("SMs", p.MultiprocessorCount, info.MultiprocessorCount)
			var theirs [][2]int64
			for _, pl := range mock.MIGProfiles.GpuInstancePlacements[p.Index] {
				theirs = append(theirs, [2]int64{int64(pl.Start), int64(pl.Size)})
			}
			diff("placements", p.Placements, theirs)
		}
		for index := range mock.MIGProfiles.GpuInstanceProfiles {
			if !seen[index] {
				missing = append(missing, fmt.Sprintf("%s index %d: only in go-nvml", key, index))
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].String() < out[j].String() })
	return out, missing
}

// knownDifferences are the kinds of difference the simulator's source notes explain
// (sidecar/nvml/tables), each with the source that wins and a test of whether a difference is one.
var knownDifferences = []struct {
	why  string
	kind func(d difference) bool
}{
	{
		"go-nvml's mock puts the profile index (NVML_GPU_INSTANCE_PROFILE_*) in Id; real drivers " +
			"answer distinct IDs (19, 14, 9, 5, 0 ...), as every nvidia-smi -lgip listing shows: the simulator wins",
		func(d difference) bool { return d.field == "id" && fmt.Sprint(d.mock) == fmt.Sprint(d.profile.Index) },
	},
	{
		"go-nvml's mock gives memory as the profile name's GB (or near it); the simulator's memorySizeMB " +
			"comes from lgip listings and the user guide (H200 1g.18gb: 16.00 GiB on a real H200): the simulator wins",
		func(d difference) bool {
			if d.field != "memory MiB" {
				return false
			}
			sim, mock := float64(d.sim.(uint64)), float64(d.mock.(uint64))
			var g, gb int
			if _, err := fmt.Sscanf(d.profile.Name, "%dg.%dgb", &g, &gb); err == nil && mock == float64(gb*1024) {
				return sim > 0.8*mock // the name's GB, whole, where the listing has less (H200 1g.18gb: 16.00 GiB)
			}
			return sim > 0.9*mock && sim < 1.1*mock
		},
	},
	{
		"go-nvml's mock multiplies the 1g SM count by the slices (112 on a 7g H100); real listings " +
			"show more SMs on larger GIs (132 on H100 7g.80gb, 60 on 3g.40gb, 26 on 1g.20gb): the simulator wins",
		func(d difference) bool {
			one := d.config.MIGProfiles.GpuInstanceProfiles[0]
			return d.field == "SMs" && fmt.Sprint(d.mock) == fmt.Sprint(one.MultiprocessorCount*d.profile.SliceCount)
		},
	},
	{
		"go-nvml's mock sizes a placement in compute slices (3g at 0:3, 7g at 0:7); NVML sizes it in " +
			"memory slices (3g.40gb at 0:4 and 4:4, 7g at 0:8, lgipp listings): the simulator wins",
		func(d difference) bool {
			if d.field != "placements" {
				return false
			}
			var scaled [][2]int64
			for _, pl := range d.profile.Placements {
				scaled = append(scaled, [2]int64{pl[0], int64(d.profile.SliceCount)})
			}
			return fmt.Sprint(scaled) == fmt.Sprint(d.mock)
		},
	},
	{
		"go-nvml's mock gives the double-memory 1g profile the plain 1g placements (0..6, size 1); " +
			"NVML places it on even starts, two memory slices (lgipp on H100: 1g.20gb at 0,2,4,6): the simulator wins",
		func(d difference) bool {
			if d.field != "placements" || d.profile.SliceCount != 1 || len(d.profile.Placements) == 0 ||
				d.profile.Placements[0][1] != 2 {
				return false
			}
			var plain [][2]int64
			for _, pl := range d.config.MIGProfiles.GpuInstancePlacements[0] {
				plain = append(plain, [2]int64{int64(pl.Start), int64(pl.Size)})
			}
			return fmt.Sprint(plain) == fmt.Sprint(d.mock)
		},
	},
}

func TestTheSimulatorsTablesAgreeWithGoNvmlsMockGPUs(t *testing.T) {
	diffs, missing := differences(t)
	for _, m := range missing {
		t.Errorf("a profile one source has and the other lacks: %s", m)
	}
	explained := map[string]int{}
	for _, d := range diffs {
		known := false
		for _, k := range knownDifferences {
			if k.kind(d) {
				t.Logf("%s\n    (%s)", d, k.why)
				explained[k.why]++
				known = true
				break
			}
		}
		if !known {
			t.Errorf("a difference no source note explains: %s", d)
		}
	}
	for _, k := range knownDifferences {
		if explained[k.why] == 0 {
			t.Errorf("a listed difference no longer occurs (drop it from the notes): %s", k.why)
		}
	}
}

// The check is not blind: a value changed in the simulator's tables is a difference no note explains.
func TestAChangedTableValueIsCaught(t *testing.T) {
	d := difference{where: "h100-80gb 1g.10gb (index 0)", field: "instances", sim: uint32(6), mock: uint32(7)}
	for _, k := range knownDifferences {
		if k.kind(d) {
			t.Fatalf("an instance-count difference passed as known: %s", k.why)
		}
	}
	d = difference{field: "memory MiB", sim: uint64(5000), mock: uint64(10240)}
	for _, k := range knownDifferences {
		if k.kind(d) {
			t.Fatalf("a memory half the other source's passed as known: %s", k.why)
		}
	}
}
