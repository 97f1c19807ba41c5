package schedule

import (
	"reflect"
	"testing"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

func at(start, size uint32) register.Placement { return register.Placement{Start: start, Size: size} }

func idleAt(profile string, start, size uint32) register.IdleInstance {
	return register.IdleInstance{Profile: profile, Placement: at(start, size), MigUUID: "MIG-" + profile}
}

// The 1g.10gb and 2g.20gb placements of an H100-80GB in the order HAMi v2.10 tries them
// (orderedMigPlacements: 1g from the top, 2g from the bottom).
var (
	oneG = []register.Placement{at(6, 1), at(5, 1), at(4, 1), at(3, 1), at(2, 1), at(1, 1), at(0, 1)}
	twoG = []register.Placement{at(0, 2), at(2, 2), at(4, 2)}
)

func uuids(gpus []GPU) []string {
	out := make([]string, len(gpus))
	for i, g := range gpus {
		out[i] = g.UUID
	}
	return out
}

func TestRank(t *testing.T) {
	cases := []struct {
		name       string
		idle       Idle
		profile    string
		gpus       []GPU // HAMi's candidates, in HAMi's order
		wantGPUs   []string
		wantFirst  register.Placement // the placement HAMi takes on the first GPU
		wantOnGPU  string             // and the full order there, when set
		wantPlaces []register.Placement
	}{
		{
			name:    "no annotation: HAMi's order, untouched",
			idle:    nil,
			profile: "1g.10gb",
			gpus: []GPU{
				{UUID: "GPU-7", Placements: oneG}, {UUID: "GPU-6", Placements: oneG}, {UUID: "GPU-5", Placements: oneG},
			},
			wantGPUs: []string{"GPU-7", "GPU-6", "GPU-5"}, wantFirst: at(6, 1),
			wantOnGPU: "GPU-7", wantPlaces: oneG,
		},
		{
			// Spread walks the least loaded GPU first; the one holding an IDLE 1g.10gb is the
			// third in that order and goes first, the others keep spread's order after it.
			name: "spread over several GPUs: the GPU with the exact IDLE instance first, spread's order after",
			idle: Idle{
				"GPU-5": {idleAt("1g.10gb", 2, 1)},
				"GPU-6": {idleAt("2g.20gb", 4, 2)}, // not the requested profile: no GPU preference
			},
			profile: "1g.10gb",
			gpus: []GPU{
				{UUID: "GPU-7", Placements: oneG}, {UUID: "GPU-6", Placements: oneG},
				{UUID: "GPU-5", Placements: oneG}, {UUID: "GPU-4", Placements: oneG},
			},
			wantGPUs: []string{"GPU-5", "GPU-7", "GPU-6", "GPU-4"}, wantFirst: at(2, 1),
			wantOnGPU: "GPU-6",
			// 4 and 5 would overwrite the IDLE 2g.20gb: after every free placement, top first as HAMi has it.
			wantPlaces: []register.Placement{at(6, 1), at(3, 1), at(2, 1), at(1, 1), at(0, 1), at(5, 1), at(4, 1)},
		},
		{
			name: "two GPUs hold one: both go first, in HAMi's order",
			idle: Idle{
				"GPU-2": {idleAt("2g.20gb", 2, 2)},
				"GPU-0": {idleAt("2g.20gb", 4, 2)},
			},
			profile:  "2g.20gb",
			gpus:     []GPU{{UUID: "GPU-1", Placements: twoG}, {UUID: "GPU-2", Placements: twoG}, {UUID: "GPU-0", Placements: twoG}},
			wantGPUs: []string{"GPU-2", "GPU-0", "GPU-1"}, wantFirst: at(2, 2),
			wantOnGPU: "GPU-0", wantPlaces: []register.Placement{at(4, 2), at(0, 2), at(2, 2)},
		},
		{
			// The annotation still names GPU-6's IDLE 1g.10gb at 5, but a reservation has taken
			// that slice since (HAMi no longer lists 5 as a candidate): no preference for GPU-6.
			name:    "stale annotation naming an instance that is gone: no preference, HAMi's order",
			idle:    Idle{"GPU-6": {idleAt("1g.10gb", 5, 1)}},
			profile: "1g.10gb",
			gpus: []GPU{
				{UUID: "GPU-7", Placements: oneG},
				{UUID: "GPU-6", Placements: []register.Placement{at(6, 1), at(4, 1), at(3, 1)}},
			},
			wantGPUs: []string{"GPU-7", "GPU-6"}, wantFirst: at(6, 1),
			wantOnGPU: "GPU-6", wantPlaces: []register.Placement{at(6, 1), at(4, 1), at(3, 1)},
		},
		{
			// A 1g.20gb sits at 4:2, where a 2g.20gb would go: not a reuse, and taking it would
			// overwrite its two slices, so the free placements come first.
			name:     "profile mismatch at the same placement: not a reuse, overwritten slices last",
			idle:     Idle{"GPU-1": {idleAt("1g.20gb", 4, 2)}},
			profile:  "2g.20gb",
			gpus:     []GPU{{UUID: "GPU-0", Placements: twoG}, {UUID: "GPU-1", Placements: twoG}},
			wantGPUs: []string{"GPU-0", "GPU-1"}, wantFirst: at(0, 2),
			wantOnGPU: "GPU-1", wantPlaces: []register.Placement{at(0, 2), at(2, 2), at(4, 2)},
		},
		{
			// Spread meets GPU-0 first, but every 2g.20gb placement there overwrites IDLE slices;
			// GPU-1 has a free one and goes first, so no IDLE instance is destroyed while there is
			// room. Between GPUs that must overwrite, the fewest slices first.
			name: "a GPU with a free placement before one that must overwrite IDLE slices",
			idle: Idle{
				"GPU-0": {idleAt("1g.10gb", 0, 1), idleAt("1g.10gb", 2, 1), idleAt("1g.10gb", 4, 1)},
				"GPU-2": {idleAt("3g.40gb", 0, 4), idleAt("1g.20gb", 4, 2)},
			},
			profile: "2g.20gb",
			gpus: []GPU{
				{UUID: "GPU-2", Placements: twoG}, {UUID: "GPU-0", Placements: twoG}, {UUID: "GPU-1", Placements: twoG},
			},
			wantGPUs: []string{"GPU-1", "GPU-0", "GPU-2"}, wantFirst: at(0, 2),
			wantOnGPU: "GPU-2", wantPlaces: []register.Placement{at(4, 2), at(0, 2), at(2, 2)},
		},
		{
			// No free placement on the GPU: the one that overwrites the fewest IDLE slices first.
			name: "fewest IDLE slices overwritten when nothing is free",
			idle: Idle{"GPU-0": {
				idleAt("1g.10gb", 0, 1), idleAt("1g.10gb", 1, 1),
				idleAt("1g.10gb", 2, 1), idleAt("1g.20gb", 4, 2),
			}},
			profile:  "2g.20gb",
			gpus:     []GPU{{UUID: "GPU-0", Placements: twoG}},
			wantGPUs: []string{"GPU-0"}, wantFirst: at(2, 2),
			wantOnGPU: "GPU-0", wantPlaces: []register.Placement{at(2, 2), at(0, 2), at(4, 2)},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Rank(tc.idle, tc.profile, tc.gpus)
			if !reflect.DeepEqual(uuids(got), tc.wantGPUs) {
				t.Fatalf("GPUs %v, want %v", uuids(got), tc.wantGPUs)
			}
			if got[0].Placements[0] != tc.wantFirst {
				t.Fatalf("first placement %v, want %v", got[0].Placements[0], tc.wantFirst)
			}
			for _, g := range got {
				if g.UUID == tc.wantOnGPU && !reflect.DeepEqual(g.Placements, tc.wantPlaces) {
					t.Fatalf("%s: placements %v, want %v", g.UUID, g.Placements, tc.wantPlaces)
				}
			}
			// Only HAMi's candidates: the same placements per GPU, none added or dropped.
			for _, in := range tc.gpus {
				for _, g := range got {
					if g.UUID == in.UUID && len(g.Placements) != len(in.Placements) {
						t.Fatalf("%s: %d placements from %d", g.UUID, len(g.Placements), len(in.Placements))
					}
				}
			}
		})
	}
}

func TestRankLeavesHAMisSlicesAsTheyWere(t *testing.T) {
	given := append([]register.Placement(nil), twoG...)
	Rank(Idle{"GPU-0": {idleAt("2g.20gb", 4, 2)}}, "2g.20gb", []GPU{{UUID: "GPU-0", Placements: given}})
	if !reflect.DeepEqual(given, twoG) {
		t.Fatalf("the caller's placements became %v", given)
	}
}

// hamiPlacement has the shape of HAMi's device.MigPlacement: Placements takes and returns HAMi's
// own slices.
type hamiPlacement struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

func TestPlacementsTakesAndReturnsTheCallersType(t *testing.T) {
	got := Placements([]register.IdleInstance{idleAt("3g.40gb", 0, 4)}, "3g.40gb",
		[]hamiPlacement{{Start: 4, Size: 4}, {Start: 0, Size: 4}})
	want := []hamiPlacement{{Start: 0, Size: 4}, {Start: 4, Size: 4}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if !Reuses([]register.IdleInstance{idleAt("3g.40gb", 0, 4)}, "3g.40gb", got[0]) || Reuses(nil, "3g.40gb", got[0]) {
		t.Fatal("Reuses disagrees with the placement key")
	}
	idle := []register.IdleInstance{idleAt("1g.10gb", 0, 1), idleAt("2g.20gb", 2, 2)}
	for p, want := range map[hamiPlacement]uint32{{0, 1}: 0, {4, 4}: 1, {0, 4}: 4, {0, 2}: 2} {
		if got := Cost(idle, "1g.10gb", p); got != want {
			t.Fatalf("Cost of %v: %d, want %d", p, got, want)
		}
	}
}

func TestCheapestLastPutsTheCheapestDevicesWhereFitLooksFirst(t *testing.T) {
	// Fit walks from the end: device 2 (a reuse) is met first, then 3 and 1 (free, in the order
	// HAMi's walk meets them), then 4 and 0.
	costs := []uint32{3, 1, 0, 1, 2}
	got := CheapestLast([]int{0, 1, 2, 3, 4}, func(d int) uint32 { return costs[d] })
	if want := []int{0, 4, 1, 3, 2}; !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if got := CheapestLast([]int{0, 1}, func(int) uint32 { return 1 }); !reflect.DeepEqual(got, []int{0, 1}) {
		t.Fatalf("equal costs: got %v", got)
	}
}

func TestTheAnnotationTheRegisterHelperWritesDecodesToTheSameInventory(t *testing.T) {
	inventory := map[string][]register.IdleInstance{
		"GPU-a": {idleAt("1g.10gb", 3, 1), idleAt("2g.20gb", 0, 2)},
		"GPU-b": {idleAt("3g.40gb", 4, 4)},
	}
	value, err := register.EncodeIdle(inventory)
	if err != nil {
		t.Fatal(err)
	}
	idle, err := DecodeIdle(value)
	if err != nil {
		t.Fatal(err)
	}
	if len(idle) != 2 || len(idle["GPU-a"]) != 2 || idle["GPU-b"][0] != idleAt("3g.40gb", 4, 4) {
		t.Fatalf("decoded %v from %s", idle, value)
	}
	if got, err := DecodeIdle(""); got != nil || err != nil {
		t.Fatalf("no annotation: %v, %v", got, err)
	}
	if got, err := DecodeIdle(`{"GPU-a":[{"profile":`); got != nil || err == nil {
		t.Fatalf("a broken value: %v, %v", got, err)
	}
}

func TestAttachKeepsAGPUsIdleInstancesInHAMisCustomInfo(t *testing.T) {
	idle := Idle{"GPU-a": {idleAt("1g.10gb", 3, 1)}}
	if info := Attach(nil, idle, "GPU-b"); info != nil {
		t.Fatalf("nothing idle on GPU-b, got %v", info)
	}
	info := Attach(map[string]any{"other": 1}, idle, "GPU-a")
	if got := IdleOf(info); len(got) != 1 || got[0] != idleAt("1g.10gb", 3, 1) || info["other"] != 1 {
		t.Fatalf("got %v from %v", got, info)
	}
	if IdleOf(nil) != nil || IdleOf(map[string]any{InfoKey: "junk"}) != nil {
		t.Fatal("IdleOf read something that is not an inventory")
	}
}
