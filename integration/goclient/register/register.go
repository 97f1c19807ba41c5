// Package register orders the placements HAMi's plugin publishes per MIG profile in the node
// annotation hami.io/node-nvidia-register by the sidecar's RankPlacements advice, and writes an
// idle-inventory annotation of this project's own.
//
// The order is the sidecar's advice, cheapest first (an IDLE instance to reuse, then a free range,
// then one that needs a reclaim). It does not by itself steer HAMi's scheduler: HAMi counts only
// pods' reservations as occupied and re-sorts or scores the published placements with its own
// order (v2.10's orderedMigPlacements sorts them by start), so the scheduler change of package
// schedule, which reads IdleKey, is what sends requests onto cached instances.
//
// The MIG part of each DeviceInfo entry of hami.io/node-nvidia-register is, per profile:
//
//	{"name":"2g.20gb","memoryMB":20096,"core":28,"sliceCount":2,
//	 "placements":[{"start":0,"size":2},{"start":2,"size":2},{"start":4,"size":2}]}
//
// MigProfile mirrors that shape; the rest of DeviceInfo is the plugin's and is not touched here.
package register

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/schedule"
)

// Placement is HAMi's {start,size}. It is schedule.Placement, the scheduler's type of the idle
// annotation's placements, so that the plugin side writes exactly what the scheduler decodes.
type Placement = schedule.Placement

// MigProfile is one profile of a GPU as HAMi publishes it.
type MigProfile struct {
	Name       string      `json:"name"`
	MemoryMB   uint64      `json:"memoryMB"`
	Core       uint32      `json:"core"`
	SliceCount uint32      `json:"sliceCount"`
	Placements []Placement `json:"placements"`
}

// Blocked says what to do with a placement the sidecar ranks BLOCKED.
type Blocked int

const (
	// BlockedLast keeps blocked placements, after every other one: the advice is a snapshot, and
	// a placement blocked now may be free when the scheduler gets to it.
	BlockedLast Blocked = iota
	// BlockedDrop removes them, so the scheduler never picks a placement Allocate would refuse.
	BlockedDrop
)

// Order returns placements sorted by the advice: REUSE, FREE, RECLAIM, then BLOCKED (last or
// dropped), in the advice's order within a cost. A published placement the advice does not
// rank keeps its relative order and goes after every ranked one but before blocked ones: the
// sidecar lists every legal placement, so such a one is a disagreement to log, not to hide.
func Order(placements []Placement, advice []migclient.RankedPlacement, blocked Blocked) []Placement {
	rank := make(map[Placement]int, len(advice))
	cost := make(map[Placement]migclient.PlacementCost, len(advice))
	for i, a := range advice {
		p := Placement{Start: a.Placement.Start, Size: a.Placement.Size}
		if _, seen := rank[p]; !seen {
			rank[p], cost[p] = i, a.Cost
		}
	}
	bucket := func(p Placement) int {
		c, ok := cost[p]
		switch {
		case !ok:
			return int(migclient.CostReclaim)*2 + 1 // after RECLAIM, before BLOCKED
		default:
			return int(c) * 2
		}
	}
	out := make([]Placement, 0, len(placements))
	for _, p := range placements {
		if blocked == BlockedDrop && cost[p] == migclient.CostBlocked {
			continue
		}
		out = append(out, p)
	}
	sort.SliceStable(out, func(i, j int) bool {
		bi, bj := bucket(out[i]), bucket(out[j])
		if bi != bj {
			return bi < bj
		}
		ri, iok := rank[out[i]]
		rj, jok := rank[out[j]]
		return iok && jok && ri < rj
	})
	return out
}

// Ranker is the one client call Order needs; *migclient.Client implements it.
type Ranker interface {
	RankPlacements(ctx context.Context, gpuUUID, profile string) ([]migclient.RankedPlacement, error)
}

// OrderProfiles reorders the placements of each of one GPU's profiles by RankPlacements. A
// profile whose advice fails keeps the order it had and the first error is returned with the
// result, so one failure never stops the plugin from registering the GPU.
func OrderProfiles(ctx context.Context, r Ranker, gpuUUID string, profiles []MigProfile, blocked Blocked) ([]MigProfile, error) {
	out := make([]MigProfile, len(profiles))
	var first error
	for i, p := range profiles {
		out[i] = p
		advice, err := r.RankPlacements(ctx, gpuUUID, p.Name)
		if err != nil {
			if first == nil {
				first = fmt.Errorf("rank placements of %s on %s: %w", p.Name, gpuUUID, err)
			}
			continue
		}
		out[i].Placements = Order(p.Placements, advice, blocked)
	}
	return out, first
}

// IdleKey is schedule.IdleKey, the idle inventory annotation, kept here for the plugin side.
const IdleKey = schedule.IdleKey

// IdleInstance is schedule.IdleInstance, one entry of IdleKey.
type IdleInstance = schedule.IdleInstance

// EncodeIdle writes the IdleKey value, each GPU's entries sorted by placement start so that an
// unchanged inventory yields an unchanged annotation (no needless node patch).
func EncodeIdle(idle map[string][]IdleInstance) (string, error) {
	out := make(map[string][]IdleInstance, len(idle))
	for gpu, list := range idle {
		if len(list) == 0 {
			continue
		}
		sorted := append([]IdleInstance(nil), list...)
		sort.Slice(sorted, func(i, j int) bool { return sorted[i].Placement.Start < sorted[j].Placement.Start })
		out[gpu] = sorted
	}
	b, err := json.Marshal(out) // map keys are written sorted
	if err != nil {
		return "", fmt.Errorf("encode %s: %w", IdleKey, err)
	}
	return string(b), nil
}

// IdleFromState collects the IDLE instances of a GetState answer for EncodeIdle.
func IdleFromState(st *pb.GetStateResponse) map[string][]IdleInstance {
	out := map[string][]IdleInstance{}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if in.GetState() != pb.InstanceState_IDLE {
				continue
			}
			uuid := g.GetGpu().GetUuid()
			out[uuid] = append(out[uuid], IdleInstance{Profile: in.GetProfile(), MigUUID: in.GetMigUuid(),
				Placement: Placement{Start: in.GetPlacement().GetStart(), Size: in.GetPlacement().GetSize()}})
		}
	}
	return out
}
