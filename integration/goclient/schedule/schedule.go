// Package schedule lets HAMi's scheduler send a MIG request to the IDLE instance the sidecar
// caches for it, from the node's idle-inventory annotation (register.IdleKey).
//
// Why it is needed: HAMi's scheduler counts as occupied only the slices of pods' reservations
// (hami.io/vgpu-mig-allocations), so an IDLE instance looks free to it, and it chooses by its own
// order whatever the plugin publishes: v2.10 re-sorts a profile's placements by start
// (orderedMigPlacements: 1g and 3g from the top, the others from the bottom), HAMi master scores
// them (#2855). Neither ever lands on a cached instance except by chance, so a request that could
// reuse one in a few milliseconds creates a new one (about a second) and often destroys an idle one
// first. The order the register helper publishes does not survive that re-sort.
//
// What it changes: two keys in front of HAMi's own order, and nothing else.
//
//   - placement key, on a GPU: the exact IDLE placement of the requested profile first, then the
//     placements that overwrite the fewest IDLE slices, a free one overwriting none (Cost,
//     Placements);
//   - GPU key: the same key of each GPU's best placement, so a GPU holding an IDLE instance of the
//     requested profile at a placement HAMi found free goes first, then a GPU with a free
//     placement, then the others by the fewest IDLE slices overwritten (Rank, CheapestLast).
//
// The GPU key's second level (free before overwriting) is what keeps IDLE instances from being
// destroyed inside an Allocate while another GPU has room: with only its first level (the GPU
// holding the instance first, HAMi's order for the rest), HAMi's spread order still sends requests
// onto GPUs that are full of IDLE instances, and an Allocate that destroys one first takes about
// 1.6 times a plain create (bench/README.md, "trace.py").
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
package schedule

import (
	"encoding/json"
	"fmt"
	"sort"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// Idle is the decoded register.IdleKey annotation: per GPU UUID, its IDLE instances.
type Idle map[string][]register.IdleInstance

// DecodeIdle reads a register.IdleKey value. The empty string (no annotation) is no inventory
// and no error; a value that does not decode answers nil with the error, which a scheduler logs
// and otherwise ignores: without the inventory it keeps HAMi's order.
func DecodeIdle(value string) (Idle, error) {
	if value == "" {
		return nil, nil
	}
	var idle Idle
	if err := json.Unmarshal([]byte(value), &idle); err != nil {
		return nil, fmt.Errorf("decode %s: %w", register.IdleKey, err)
	}
	return idle, nil
}

// Placement is any type with register.Placement's fields and tags, HAMi's device.MigPlacement
// among them, so that HAMi passes and gets back its own slices with no conversion code.
type Placement interface {
	~struct {
		Start uint32 `json:"start"`
		Size  uint32 `json:"size"`
	}
}

func overlaps(a, b register.Placement) bool {
	return a.Start < b.Start+b.Size && b.Start < a.Start+a.Size
}

// cost is the placement key of one candidate: 0 for the exact IDLE instance of profile, else 1
// plus the IDLE slices the candidate overwrites (each IDLE instance under it is destroyed whole).
func cost(idle []register.IdleInstance, profile string, p register.Placement) uint32 {
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
func Cost[P Placement](idle []register.IdleInstance, profile string, p P) uint32 {
	return cost(idle, profile, register.Placement(p))
}

// Reuses reports whether p is exactly where an IDLE instance of profile sits (Cost 0).
func Reuses[P Placement](idle []register.IdleInstance, profile string, p P) bool {
	return Cost(idle, profile, p) == 0
}

// Placements re-ranks one GPU's placements, given in HAMi's order, by the placement key: the exact
// IDLE instance of profile first, then by the fewest IDLE slices overwritten, HAMi's order on ties.
// idle is that GPU's entry of the annotation (nil keeps the order). The result is a new slice with
// the same elements; HAMi's conflict check can run before or after it, as the order is stable.
func Placements[P Placement](idle []register.IdleInstance, profile string, placements []P) []P {
	out := append([]P(nil), placements...)
	if len(idle) == 0 {
		return out
	}
	costs := make(map[register.Placement]uint32, len(out))
	for _, p := range out {
		costs[register.Placement(p)] = cost(idle, profile, register.Placement(p))
	}
	sort.SliceStable(out, func(i, j int) bool {
		return costs[register.Placement(out[i])] < costs[register.Placement(out[j])]
	})
	return out
}

// GPU is one of HAMi's candidates: a GPU that fits the request and the placements on it that do,
// in HAMi's order.
type GPU struct {
	UUID       string
	Placements []register.Placement
}

// noCandidate is the GPU key of a GPU without a candidate placement: after every other.
const noCandidate = ^uint32(0)

// Rank re-ranks HAMi's candidates for a request of profile, given GPUs in HAMi's policy order
// (binpack, spread...) and each GPU's placements in HAMi's order: each GPU's placements by
// Placements, then the GPUs by the Cost of their best placement (the GPUs holding an IDLE
// instance of profile at a candidate placement first, then those with a free one), HAMi's order
// breaking ties. An annotation entry naming a placement that is not a candidate (an instance gone,
// or slices a reservation now holds) gives its GPU no preference.
func Rank(idle Idle, profile string, gpus []GPU) []GPU {
	out := make([]GPU, len(gpus))
	key := make([]uint32, len(gpus))
	for i, g := range gpus {
		ranked := Placements(idle[g.UUID], profile, g.Placements)
		out[i] = GPU{UUID: g.UUID, Placements: ranked}
		key[i] = noCandidate
		if len(ranked) > 0 {
			key[i] = Cost(idle[g.UUID], profile, ranked[0])
		}
	}
	order := make([]int, len(out))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return key[order[a]] < key[order[b]] })
	ranked := make([]GPU, len(out))
	for i, idx := range order {
		ranked[i] = out[idx]
	}
	return ranked
}

// CheapestLast is the GPU key for a scheduler that walks its device list from the end, as HAMi's
// NVIDIA Fit does: the devices sorted by cost, highest first, equal costs keeping their order, so
// the walk meets the cheapest first and, among equal costs, in HAMi's order. cost answers the Cost
// of the placement HAMi's own selection, with the placement key, would take on a device (any
// value at least as high as every other for a device it would not use); Fit still checks every
// device it meets.
func CheapestLast[D any](devices []D, cost func(D) uint32) []D {
	keys := make([]uint32, len(devices))
	order := make([]int, len(devices))
	for i, d := range devices {
		keys[i], order[i] = cost(d), i
	}
	sort.SliceStable(order, func(a, b int) bool { return keys[order[a]] > keys[order[b]] })
	sorted := make([]D, len(devices))
	for i, idx := range order {
		sorted[i] = devices[idx]
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
func IdleOf(info map[string]any) []register.IdleInstance {
	list, _ := info[InfoKey].([]register.IdleInstance)
	return list
}
