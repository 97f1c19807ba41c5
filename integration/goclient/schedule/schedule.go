// Package schedule lets HAMi's scheduler send a MIG request to the IDLE instance the sidecar
// caches for it, from the node's idle-inventory annotation (IdleKey).
//
// Why it is needed: HAMi's scheduler counts as occupied only the slices of pods' reservations
// (hami.io/vgpu-mig-allocations), so an IDLE instance looks free to it, and it chooses by its own
// order whatever the plugin publishes: v2.10 re-sorts a profile's placements by start
// (orderedMigPlacements: 1g and 3g from the top, the others from the bottom), HAMi master scores
// them (#2855). Neither ever lands on a cached instance except by chance, so a request that could
// reuse one in a few milliseconds creates a new one (about a second) and often destroys an idle one
// first. The order the register helper publishes does not survive that re-sort.
//
// What it changes: two keys on HAMi's own order, and nothing else.
//
//   - placement key, on a GPU: the exact IDLE placement of the requested profile first, then the
//     placements that overwrite the fewest IDLE slices, a free one overwriting none (Cost,
//     Placements). HAMi's placement order is its own packing rule, not the user's policy; this
//     key applies on whichever GPU is chosen;
//   - GPU key: the same key of each GPU's best placement, so a GPU holding an IDLE instance of the
//     requested profile at a placement HAMi found free goes first, then a GPU with a free
//     placement, then the others by the fewest IDLE slices overwritten (Rank, CheapestLast). How
//     far it may move a request against the user's GPU policy (binpack, spread) is a Preference:
//     by default (WithinPolicy) only among the GPUs the policy ranks equal, so the policy chooses
//     the GPU exactly as without the helper; IdleFirst, set explicitly, puts the key before it.
//     The node policy is never touched: HAMi scores a node by its devices' total use, which no
//     choice inside the node changes.
//
// What each preference keeps of the saving, under binpack and spread, is in bench/README.md
// ("trace.py"). The GPU key's second level (free before overwriting) is what keeps IDLE
// instances from being destroyed inside an Allocate while another GPU has room: an Allocate that
// destroys one first takes about 1.6 times a plain create.
//
// HAMi's order breaks every tie, and only candidates HAMi already found fit are ever returned:
// the keys re-rank, they never add a GPU or a placement, so HAMi's filters (health, quota,
// memory, overlap with reservations) stay the only judges of what fits. Without the annotation
// (a node without the sidecar, a plugin that has not published yet, a value that does not decode)
// every function returns HAMi's order unchanged.
//
// The annotation is advice. The plugin publishes it from its registration loop when the
// inventory changed and soon after a release or a reclaim (hami.Publisher), and the scheduler
// reads it when it refreshes the node; between the two it can be stale. A stale entry costs at
// most a create: an instance it names that is gone sends the request to a placement that is then
// created (as without the annotation), and one it misses is only not preferred. Correctness never
// depends on it: the sidecar creates exactly the GPU and placement the scheduler chose, reusing
// an IDLE instance only when it is exactly there.
//
// docs/porting-hami.md, "The scheduler", shows where HAMi calls these functions.
//
// The package is all HAMi's scheduler imports of this repository: the annotation's key, its
// types and its decoder live here, with the keys, and it imports nothing but the standard
// library (no gRPC, no client). The plugin side (package register, hami.Publisher) writes the
// annotation with these same types.
package schedule

import (
	"encoding/json"
	"fmt"
	"sort"
)

// IdleKey is the node annotation, this project's own, that lists the idle instances the sidecar
// caches, for HAMi's scheduler (this package reads it; hami.Publisher writes it, and removes it
// when it stops). Its value is a JSON object from GPU UUID to that GPU's idle instances:
//
//	{"GPU-…":[{"profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"MIG-…"}]}
//
// A GPU without idle instances is absent; an empty object means none anywhere.
const IdleKey = "hami.io/mig-sidecar-idle-instances"

// Placement is HAMi's {start,size} of a MIG placement.
type Placement struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

// IdleInstance is one entry of IdleKey.
type IdleInstance struct {
	Profile   string    `json:"profile"`
	Placement Placement `json:"placement"`
	MigUUID   string    `json:"migUUID"`
}

// Idle is the decoded IdleKey annotation: per GPU UUID, its IDLE instances.
type Idle map[string][]IdleInstance

// DecodeIdle reads an IdleKey value. The empty string (no annotation) is no inventory and no
// error; a value that does not decode answers nil with the error, which a scheduler logs and
// otherwise ignores: without the inventory it keeps HAMi's order.
func DecodeIdle(value string) (Idle, error) {
	if value == "" {
		return nil, nil
	}
	var idle Idle
	if err := json.Unmarshal([]byte(value), &idle); err != nil {
		return nil, fmt.Errorf("decode %s: %w", IdleKey, err)
	}
	return idle, nil
}

// AnyPlacement is any type with Placement's fields and tags, HAMi's device.MigPlacement among
// them, so that HAMi passes and gets back its own slices with no conversion code.
type AnyPlacement interface {
	~struct {
		Start uint32 `json:"start"`
		Size  uint32 `json:"size"`
	}
}

func overlaps(a, b Placement) bool {
	return a.Start < b.Start+b.Size && b.Start < a.Start+a.Size
}

// cost is the placement key of one candidate: 0 for the exact IDLE instance of profile, else 1
// plus the IDLE slices the candidate overwrites (each IDLE instance under it is destroyed whole).
func cost(idle []IdleInstance, profile string, p Placement) uint32 {
	var overwritten uint32
	for _, in := range idle {
		if in.Placement == p && in.Profile == profile {
			return 0
		}
		if overlaps(in.Placement, p) {
			overwritten += in.Placement.Size
		}
	}
	return 1 + overwritten
}

// Cost is the placement key of p for a request of profile on a GPU whose IDLE instances are idle:
// 0 when an IDLE instance of profile sits exactly at p, 1 when p overwrites no IDLE slice, else 1
// plus the IDLE slices it overwrites (each IDLE instance under p is destroyed whole). Lower is
// better.
func Cost[P AnyPlacement](idle []IdleInstance, profile string, p P) uint32 {
	return cost(idle, profile, Placement(p))
}

// Reuses reports whether p is exactly where an IDLE instance of profile sits (Cost 0).
func Reuses[P AnyPlacement](idle []IdleInstance, profile string, p P) bool {
	return Cost(idle, profile, p) == 0
}

// Placements re-ranks one GPU's placements, given in HAMi's order, by the placement key: the exact
// IDLE instance of profile first, then by the fewest IDLE slices overwritten, HAMi's order on ties.
// idle is that GPU's entry of the annotation (nil keeps the order). The result is a new slice with
// the same elements; HAMi's conflict check can run before or after it, as the order is stable.
func Placements[P AnyPlacement](idle []IdleInstance, profile string, placements []P) []P {
	out := append([]P(nil), placements...)
	if len(idle) == 0 {
		return out
	}
	costs := make(map[Placement]uint32, len(out))
	for _, p := range out {
		costs[Placement(p)] = cost(idle, profile, Placement(p))
	}
	sort.SliceStable(out, func(i, j int) bool {
		return costs[Placement(out[i])] < costs[Placement(out[j])]
	})
	return out
}

// Preference says how far the GPU key may move a request against HAMi's GPU policy (binpack,
// spread, their chains with numa): the placement key applies on whichever GPU is chosen either way.
type Preference string

const (
	// WithinPolicy is the default (and what any value other than IdleFirst means): the GPU key only
	// orders GPUs the policy ranks equal, so the GPU the policy would choose keeps its rank and an
	// IDLE instance on another GPU is taken only when that GPU ties with it. What the policy
	// promises (binpack fills the busiest GPU, spread the least busy) holds as without the helper.
	WithinPolicy Preference = "policy"
	// IdleFirst puts the GPU key before the policy, the policy's order on ties. A request goes to the
	// GPU holding an IDLE instance of its profile even when binpack would fill a busier one or
	// spread an emptier one: the most creations saved, the policy kept only among equals.
	IdleFirst Preference = "idle-first"
)

// PreferenceKey is the setting's name in HAMi's NVIDIA device config, which errors name.
const PreferenceKey = "migIdlePreference"

// UnmarshalYAML refuses a value ParsePreference refuses, so that HAMi's config decode (gopkg.in/yaml
// v2 or v3) fails on a misspelt preference with an error naming the key, as a test can see,
// instead of a later fatal check.
func (p *Preference) UnmarshalYAML(unmarshal func(any) error) error {
	var value string
	if err := unmarshal(&value); err != nil {
		return fmt.Errorf("%s: %w", PreferenceKey, err)
	}
	return p.UnmarshalText([]byte(value))
}

// UnmarshalText is UnmarshalYAML for decoders of text (encoding/json, sigs.k8s.io/yaml).
func (p *Preference) UnmarshalText(text []byte) error {
	parsed, err := ParsePreference(string(text))
	if err != nil {
		return fmt.Errorf("%s: %w", PreferenceKey, err)
	}
	*p = parsed
	return nil
}

// ParsePreference reads a configured value: "" and "policy" are WithinPolicy, "idle-first" is
// IdleFirst; anything else is an error naming the values.
func ParsePreference(value string) (Preference, error) {
	switch Preference(value) {
	case "", WithinPolicy:
		return WithinPolicy, nil
	case IdleFirst:
		return IdleFirst, nil
	}
	return WithinPolicy, fmt.Errorf("MIG idle preference %q: want %q (default) or %q", value, WithinPolicy, IdleFirst)
}

// byKey is the order of n items given in the policy's order, cheapest key first: under IdleFirst
// over all of them, under WithinPolicy only within each run of neighbours that tie (tie(i, i+1));
// equal keys keep the given order.
func byKey(n int, pref Preference, tie func(i, j int) bool, key func(i int) uint32) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	less := func(a, b int) bool { return key(a) < key(b) }
	if pref == IdleFirst {
		sort.SliceStable(order, func(a, b int) bool { return less(order[a], order[b]) })
		return order
	}
	for lo := 0; lo < n; {
		hi := lo + 1
		for hi < n && tie(hi-1, hi) {
			hi++
		}
		run := order[lo:hi]
		sort.SliceStable(run, func(a, b int) bool { return less(run[a], run[b]) })
		lo = hi
	}
	return order
}

// GPU is one of HAMi's candidates: a GPU that fits the request and the placements on it that do,
// in HAMi's order. Level is what the policy ranks it by (equal levels are the policy's ties).
type GPU struct {
	UUID       string
	Level      float64
	Placements []Placement
}

// noCandidate is the GPU key of a GPU without a candidate placement: after every other.
const noCandidate = ^uint32(0)

// Rank re-ranks HAMi's candidates for a request of profile, given GPUs in HAMi's policy order
// (binpack, spread...) and each GPU's placements in HAMi's order: each GPU's placements by
// Placements, then the GPUs by the Cost of their best placement (the GPUs holding an IDLE
// instance of profile at a candidate placement first, then those with a free one), as far as pref
// lets the key move them, HAMi's order breaking ties. An annotation entry naming a placement that
// is not a candidate (an instance gone, or slices a reservation now holds) gives its GPU no
// preference.
func Rank(idle Idle, profile string, gpus []GPU, pref Preference) []GPU {
	out := make([]GPU, len(gpus))
	key := make([]uint32, len(gpus))
	for i, g := range gpus {
		ranked := Placements(idle[g.UUID], profile, g.Placements)
		out[i] = GPU{UUID: g.UUID, Level: g.Level, Placements: ranked}
		key[i] = noCandidate
		if len(ranked) > 0 {
			key[i] = Cost(idle[g.UUID], profile, ranked[0])
		}
	}
	order := byKey(len(out), pref, func(i, j int) bool { return gpus[i].Level == gpus[j].Level },
		func(i int) uint32 { return key[i] })
	ranked := make([]GPU, len(out))
	for i, idx := range order {
		ranked[i] = out[idx]
	}
	return ranked
}

// CheapestLast is the GPU key for a scheduler that walks its device list, sorted by its policy,
// from the end, as HAMi's NVIDIA Fit does: the devices by cost, as far as pref lets it move them,
// so that the walk meets the cheapest first and, among equal costs, in HAMi's order. level is what
// the policy sorts a device by (two neighbours with equal levels tie; only they are reordered under
// WithinPolicy). cost answers the Cost of the placement HAMi's own selection, with the placement
// key, would take on a device (any value at least as high as every other for a device it would
// not use); Fit still checks every device it meets.
//
// When every device costs the same (no annotation on the node, or none that a device's choice
// touches), devices is returned as it is, with no allocation: the hot path of a node without the
// sidecar is one cost call per device.
func CheapestLast[D any, L comparable](devices []D, pref Preference, level func(D) L, cost func(D) uint32) []D {
	n := len(devices)
	if n < 2 {
		return devices
	}
	first, same := cost(devices[0]), true
	for _, d := range devices[1:] {
		if cost(d) != first {
			same = false
			break
		}
	}
	if same {
		return devices
	}
	keys := make([]uint32, n)
	levels := make([]L, n)
	for i, d := range devices {
		keys[n-1-i], levels[n-1-i] = cost(d), level(d) // the walk's order: from the end
	}
	order := byKey(n, pref, func(i, j int) bool { return levels[i] == levels[j] },
		func(i int) uint32 { return keys[i] })
	sorted := make([]D, n)
	for i, idx := range order {
		sorted[n-1-i] = devices[n-1-idx]
	}
	return sorted
}

// InfoKey is the key under which Attach keeps a GPU's IDLE instances in HAMi's per-device
// CustomInfo map, which HAMi copies from the node's device list into each scheduling pass.
const InfoKey = "hami-mig-sidecar.idle"

// Attach returns info with uuid's IDLE instances of idle under InfoKey (a new map when info is
// nil and there are some; info unchanged when there are none).
func Attach(info map[string]any, idle Idle, uuid string) map[string]any {
	list := idle[uuid]
	if len(list) == 0 {
		return info
	}
	if info == nil {
		info = map[string]any{}
	}
	info[InfoKey] = list
	return info
}

// IdleOf is what Attach kept in info: the GPU's IDLE instances, nil when none.
func IdleOf(info map[string]any) []IdleInstance {
	list, _ := info[InfoKey].([]IdleInstance)
	return list
}
