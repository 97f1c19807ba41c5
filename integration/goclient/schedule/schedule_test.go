package schedule

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

func at(start, size uint32) Placement { return Placement{Start: start, Size: size} }

func idleAt(profile string, start, size uint32) IdleInstance {
	return IdleInstance{Profile: profile, Placement: at(start, size), MigUUID: "MIG-" + profile}
}

// The 1g.10gb and 2g.20gb placements of an H100-80GB in the order HAMi v2.10 tries them
// (orderedMigPlacements: 1g from the top, 2g from the bottom).
var (
	oneG = []Placement{at(6, 1), at(5, 1), at(4, 1), at(3, 1), at(2, 1), at(1, 1), at(0, 1)}
	twoG = []Placement{at(0, 2), at(2, 2), at(4, 2)}
)

func uuids(gpus []GPU) []string {
	out := make([]string, len(gpus))
	for i, g := range gpus {
		out[i] = g.UUID
	}
	return out
}

// The GPU key before the policy (IdleFirst): every GPU below has its own level, so WithinPolicy
// would keep HAMi's order for all of them (TestWithinPolicyKeepsTheGPUThePolicyChooses).
func TestRankIdleFirst(t *testing.T) {
	cases := []struct {
		name       string
		idle       Idle
		profile    string
		gpus       []GPU // HAMi's candidates, in HAMi's order
		wantGPUs   []string
		wantFirst  Placement // the placement HAMi takes on the first GPU
		wantOnGPU  string    // and the full order there, when set
		wantPlaces []Placement
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
			wantPlaces: []Placement{at(6, 1), at(3, 1), at(2, 1), at(1, 1), at(0, 1), at(5, 1), at(4, 1)},
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
			wantOnGPU: "GPU-0", wantPlaces: []Placement{at(4, 2), at(0, 2), at(2, 2)},
		},
		{
			// The annotation still names GPU-6's IDLE 1g.10gb at 5, but a reservation has taken
			// that slice since (HAMi no longer lists 5 as a candidate): no preference for GPU-6.
			name:    "stale annotation naming an instance that is gone: no preference, HAMi's order",
			idle:    Idle{"GPU-6": {idleAt("1g.10gb", 5, 1)}},
			profile: "1g.10gb",
			gpus: []GPU{
				{UUID: "GPU-7", Placements: oneG},
				{UUID: "GPU-6", Placements: []Placement{at(6, 1), at(4, 1), at(3, 1)}},
			},
			wantGPUs: []string{"GPU-7", "GPU-6"}, wantFirst: at(6, 1),
			wantOnGPU: "GPU-6", wantPlaces: []Placement{at(6, 1), at(4, 1), at(3, 1)},
		},
		{
			// A 1g.20gb sits at 4:2, where a 2g.20gb would go: not a reuse, and taking it would
			// overwrite its two slices, so the free placements come first.
			name:     "profile mismatch at the same placement: not a reuse, overwritten slices last",
			idle:     Idle{"GPU-1": {idleAt("1g.20gb", 4, 2)}},
			profile:  "2g.20gb",
			gpus:     []GPU{{UUID: "GPU-0", Placements: twoG}, {UUID: "GPU-1", Placements: twoG}},
			wantGPUs: []string{"GPU-0", "GPU-1"}, wantFirst: at(0, 2),
			wantOnGPU: "GPU-1", wantPlaces: []Placement{at(0, 2), at(2, 2), at(4, 2)},
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
			wantOnGPU: "GPU-2", wantPlaces: []Placement{at(4, 2), at(0, 2), at(2, 2)},
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
			wantOnGPU: "GPU-0", wantPlaces: []Placement{at(2, 2), at(0, 2), at(4, 2)},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			gpus := make([]GPU, len(tc.gpus))
			for i, g := range tc.gpus {
				gpus[i] = GPU{UUID: g.UUID, Level: float64(i), Placements: g.Placements}
			}
			got := Rank(tc.idle, tc.profile, gpus, IdleFirst)
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
	given := append([]Placement(nil), twoG...)
	Rank(Idle{"GPU-0": {idleAt("2g.20gb", 4, 2)}}, "2g.20gb", []GPU{{UUID: "GPU-0", Placements: given}}, IdleFirst)
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
	got := Placements([]IdleInstance{idleAt("3g.40gb", 0, 4)}, "3g.40gb",
		[]hamiPlacement{{Start: 4, Size: 4}, {Start: 0, Size: 4}})
	want := []hamiPlacement{{Start: 0, Size: 4}, {Start: 4, Size: 4}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if !Reuses([]IdleInstance{idleAt("3g.40gb", 0, 4)}, "3g.40gb", got[0]) || Reuses(nil, "3g.40gb", got[0]) {
		t.Fatal("Reuses disagrees with the placement key")
	}
	idle := []IdleInstance{idleAt("1g.10gb", 0, 1), idleAt("2g.20gb", 2, 2)}
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
	cost := func(d int) uint32 { return costs[d] }
	own := func(d int) int { return d } // every device its own level: no ties
	if got, want := CheapestLast([]int{0, 1, 2, 3, 4}, IdleFirst, own, cost), []int{0, 4, 1, 3, 2}; !reflect.DeepEqual(got, want) {
		t.Fatalf("IdleFirst: got %v, want %v", got, want)
	}
	if got := CheapestLast([]int{0, 1}, IdleFirst, own, func(int) uint32 { return 1 }); !reflect.DeepEqual(got, []int{0, 1}) {
		t.Fatalf("equal costs: got %v", got)
	}
	// WithinPolicy: the policy's order stands between levels; the key orders only the tied run of
	// devices 1-3, whose walk meets 2 (the reuse) first, then 3 and 1.
	if got, want := CheapestLast([]int{0, 1, 2, 3, 4}, WithinPolicy, own, cost), []int{0, 1, 2, 3, 4}; !reflect.DeepEqual(got, want) {
		t.Fatalf("WithinPolicy, no ties: got %v, want %v", got, want)
	}
	level := func(d int) string { return map[int]string{0: "a", 1: "b", 2: "b", 3: "b", 4: "c"}[d] }
	if got, want := CheapestLast([]int{0, 1, 2, 3, 4}, WithinPolicy, level, cost), []int{0, 1, 3, 2, 4}; !reflect.DeepEqual(got, want) {
		t.Fatalf("WithinPolicy, a tie: got %v, want %v", got, want)
	}
}

// The two cases of a user's GPU policy the IDLE preference must not override: binpack fills the
// busiest GPU even when an empty one holds an IDLE instance of the profile, and spread takes the
// least busy even when a busy one does. Level is the policy's score (binpack meets the highest
// first, spread the lowest); the GPUs come in the order the policy meets them.
func TestWithinPolicyKeepsTheGPUThePolicyChooses(t *testing.T) {
	cases := []struct {
		name      string
		idle      Idle
		gpus      []GPU
		within    []string
		first     []string
		wantFirst Placement // on the first GPU under WithinPolicy
	}{
		{
			name: "binpack: the busy GPU it fills, not the empty one with the IDLE instance",
			idle: Idle{"GPU-empty": {idleAt("1g.10gb", 6, 1)}},
			gpus: []GPU{
				{UUID: "GPU-busy", Level: 2.5, Placements: oneG[:3]},
				{UUID: "GPU-empty", Level: 0.3, Placements: oneG},
			},
			within: []string{"GPU-busy", "GPU-empty"}, first: []string{"GPU-empty", "GPU-busy"},
			wantFirst: at(6, 1),
		},
		{
			name: "spread: the empty GPU, not the busy one with the IDLE instance",
			idle: Idle{"GPU-busy": {idleAt("1g.10gb", 4, 1)}},
			gpus: []GPU{
				{UUID: "GPU-empty", Level: 0.3, Placements: oneG},
				{UUID: "GPU-busy", Level: 2.5, Placements: oneG[:3]},
			},
			within: []string{"GPU-empty", "GPU-busy"}, first: []string{"GPU-busy", "GPU-empty"},
			wantFirst: at(6, 1),
		},
		{
			// Equal scores are the policy's ties: among them the IDLE instance goes first, the
			// busier GPU still before both.
			name: "ties: the IDLE instance first among the GPUs the policy ranks equal",
			idle: Idle{"GPU-b": {idleAt("1g.10gb", 3, 1)}},
			gpus: []GPU{
				{UUID: "GPU-busy", Level: 2.5, Placements: oneG[:3]},
				{UUID: "GPU-a", Level: 0.3, Placements: oneG},
				{UUID: "GPU-b", Level: 0.3, Placements: oneG},
			},
			within: []string{"GPU-busy", "GPU-b", "GPU-a"}, first: []string{"GPU-b", "GPU-busy", "GPU-a"},
			wantFirst: at(6, 1),
		},
		{
			// The placement key holds on the policy's GPU under either preference.
			name: "the placement key on the GPU the policy chose",
			idle: Idle{"GPU-busy": {idleAt("1g.10gb", 4, 1)}},
			gpus: []GPU{
				{UUID: "GPU-busy", Level: 2.5, Placements: oneG[:3]},
				{UUID: "GPU-empty", Level: 0.3, Placements: oneG},
			},
			within: []string{"GPU-busy", "GPU-empty"}, first: []string{"GPU-busy", "GPU-empty"},
			wantFirst: at(4, 1),
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			within := Rank(tc.idle, "1g.10gb", tc.gpus, WithinPolicy)
			if !reflect.DeepEqual(uuids(within), tc.within) {
				t.Fatalf("WithinPolicy: %v, want %v", uuids(within), tc.within)
			}
			if within[0].Placements[0] != tc.wantFirst {
				t.Fatalf("WithinPolicy: first placement %v, want %v", within[0].Placements[0], tc.wantFirst)
			}
			if first := Rank(tc.idle, "1g.10gb", tc.gpus, IdleFirst); !reflect.DeepEqual(uuids(first), tc.first) {
				t.Fatalf("IdleFirst: %v, want %v", uuids(first), tc.first)
			}
		})
	}
}

func TestParsePreference(t *testing.T) {
	for value, want := range map[string]Preference{"": WithinPolicy, "policy": WithinPolicy, "idle-first": IdleFirst} {
		if got, err := ParsePreference(value); got != want || err != nil {
			t.Fatalf("%q: %v, %v", value, got, err)
		}
	}
	if got, err := ParsePreference("binpack"); got != WithinPolicy || err == nil {
		t.Fatalf("an unknown value: %v, %v", got, err)
	}
}

func TestDecodeIdle(t *testing.T) {
	for _, tc := range []struct {
		name, value string
		want        Idle
		fails       bool
	}{
		{name: "no annotation", value: ""},
		{name: "none idle", value: "{}", want: Idle{}},
		{name: "one GPU", value: `{"GPU-a":[{"profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"MIG-x"}]}`,
			want: Idle{"GPU-a": {{Profile: "1g.10gb", Placement: Placement{Start: 3, Size: 1}, MigUUID: "MIG-x"}}}},
		{name: "a broken value", value: `{"GPU-a":[{"profile":`, fails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeIdle(tc.value)
			if (err != nil) != tc.fails || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("DecodeIdle(%q) = %v, %v", tc.value, got, err)
			}
		})
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

func TestAPreferenceIsCheckedWhereTheConfigIsDecoded(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		want       Preference
		fails      bool
	}{
		{name: "unset", json: `{}`, want: ""},
		{name: "policy", json: `{"migIdlePreference":"policy"}`, want: WithinPolicy},
		{name: "idle-first", json: `{"migIdlePreference":"idle-first"}`, want: IdleFirst},
		{name: "misspelt", json: `{"migIdlePreference":"idle-frist"}`, fails: true},
		{name: "not a string", json: `{"migIdlePreference":3}`, fails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg struct {
				Pref Preference `json:"migIdlePreference"`
			}
			err := json.Unmarshal([]byte(tc.json), &cfg)
			if (err != nil) != tc.fails || cfg.Pref != tc.want {
				t.Fatalf("%s: %q, %v", tc.json, cfg.Pref, err)
			}
			if tc.fails && tc.name == "misspelt" && !strings.Contains(err.Error(), PreferenceKey) {
				t.Fatalf("the error does not name the key: %v", err)
			}
			if tc.json == `{}` {
				return
			}
			var viaYAML Preference // as gopkg.in/yaml's decoder calls it, with the raw value
			raw := json.RawMessage(strings.TrimSuffix(strings.TrimPrefix(tc.json, `{"migIdlePreference":`), "}"))
			err = viaYAML.UnmarshalYAML(func(v any) error { return json.Unmarshal(raw, v) })
			if (err != nil) != tc.fails || viaYAML != tc.want {
				t.Fatalf("UnmarshalYAML %s: %q, %v", raw, viaYAML, err)
			}
		})
	}
}

func TestCheapestLastReturnsTheSameSliceWhenEveryDeviceCostsTheSame(t *testing.T) {
	devices := []string{"a", "b", "c"}
	for _, pref := range []Preference{WithinPolicy, IdleFirst} {
		got := CheapestLast(devices, pref, func(string) int { return 0 }, func(string) uint32 { return 1 })
		if &got[0] != &devices[0] || !reflect.DeepEqual(got, []string{"a", "b", "c"}) {
			t.Fatalf("%s: %v, a new slice or a new order", pref, got)
		}
		if n := testing.AllocsPerRun(100, func() {
			CheapestLast(devices, pref, func(string) int { return 0 }, func(string) uint32 { return 1 })
		}); n != 0 {
			t.Fatalf("%s: %v allocations per call", pref, n)
		}
	}
}
