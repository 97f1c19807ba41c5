package migclient

import (
	"context"
	"fmt"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// PlacementCost is what an Allocate at a placement would cost, best first.
type PlacementCost int

const (
	// CostUnspecified is the zero value: the sidecar gave no cost.
	CostUnspecified PlacementCost = iota
	// CostReuse means an IDLE instance of exactly this profile sits there; no NVML create at all.
	CostReuse
	// CostFree means nothing overlaps; one create.
	CostFree
	// CostReclaim means only IDLE instances overlap; destroy them, then create.
	CostReclaim
	// CostBlocked means an ACTIVE, ERROR, in-flight or foreign instance overlaps; Allocate would fail.
	CostBlocked
)

func (c PlacementCost) String() string {
	switch c {
	case CostReuse:
		return "REUSE"
	case CostFree:
		return "FREE"
	case CostReclaim:
		return "RECLAIM"
	case CostBlocked:
		return "BLOCKED"
	default:
		return "UNSPECIFIED"
	}
}

// MarshalText writes the contract's name, for logs and JSON output.
func (c PlacementCost) MarshalText() ([]byte, error) { return []byte(c.String()), nil }

// RankedPlacement is one legal placement of a profile with its cost.
type RankedPlacement struct {
	Placement       Placement
	Cost            PlacementCost
	IdleMigUUID     string        // with CostReuse
	Reclaim         []InstanceRef // with CostReclaim
	FreeSlicesAfter uint32
	Blocker         string // with CostBlocked
}

// RankPlacements returns every legal placement of profile on one GPU, best first (REUSE, FREE,
// RECLAIM, BLOCKED; ties by the free region left). It is read-only and cheap, meant for each
// registration loop of the plugin (see the register package).
func (c *Client) RankPlacements(ctx context.Context, gpuUUID, profile string) ([]RankedPlacement, error) {
	const op = "RankPlacements"
	if gpuUUID == "" || profile == "" {
		return nil, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "GPU UUID and profile are required")
	}
	req := &pb.RankPlacementsRequest{GpuUuid: gpuUUID, Profile: profile}
	var resp *pb.RankPlacementsResponse
	err := c.withRecovery(ctx, op, c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.RankPlacements(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]RankedPlacement, 0, len(resp.GetPlacements()))
	for _, p := range resp.GetPlacements() {
		rp := RankedPlacement{
			Placement: placementFromPB(p.GetPlacement()), Cost: costFromPB(p.GetCost()), IdleMigUUID: p.GetIdleMigUuid(),
			Reclaim: instanceRefsFromPB(p.GetReclaim()), FreeSlicesAfter: p.GetFreeSlicesAfter(), Blocker: p.GetBlocker(),
		}
		if rp.Cost == CostUnspecified || rp.Placement.Size == 0 {
			// An advice the client cannot read must not reorder anything.
			return nil, newError(op, codes.Internal, ReasonInvalidResponse,
				fmt.Sprintf("placement %s of %s on %s has no cost or size", rp.Placement, profile, gpuUUID))
		}
		out = append(out, rp)
	}
	return out, nil
}

func costFromPB(c pb.PlacementCost) PlacementCost {
	switch c {
	case pb.PlacementCost_REUSE:
		return CostReuse
	case pb.PlacementCost_FREE:
		return CostFree
	case pb.PlacementCost_RECLAIM:
		return CostReclaim
	case pb.PlacementCost_BLOCKED:
		return CostBlocked
	default:
		return CostUnspecified
	}
}

// NextPlacement is a placement the client's scheduler takes next for Profile on the GPU, for a
// request that finds no IDLE instance of it.
type NextPlacement struct {
	GPUUUID   string
	Profile   string
	Placement Placement
}

// KeepFree names the placements the client's scheduler takes next, at most one per (GPU,
// profile): the sidecar's background trim destroys the IDLE instances over them, so the request
// that comes there creates without waiting for destroys. Each call replaces the last one's set;
// the sidecar keeps it in memory only, so a client names it again after the sidecar restarted.
// A sidecar that predates the call answers codes.Unimplemented.
//
// gpus are the GPUs the client's scheduler allocates: their IDLE instances are the client's to
// keep or free through next, and the sidecar's own reserve (--idle-reserve) trims nothing there. A
// sidecar that predates them ignores them.
func (c *Client) KeepFree(ctx context.Context, next []NextPlacement, gpus ...string) error {
	const op = "KeepFree"
	req := &pb.KeepFreeRequest{Next: make([]*pb.NextPlacement, 0, len(next)), GpuUuids: gpus}
	for _, n := range next {
		req.Next = append(req.Next, &pb.NextPlacement{GpuUuid: n.GPUUUID, Profile: n.Profile,
			Placement: &pb.Placement{Start: n.Placement.Start, Size: n.Placement.Size}})
	}
	return c.withRecovery(ctx, op, c.opts.CallTimeout, func(ctx context.Context) error {
		_, err := c.rpc.KeepFree(ctx, req)
		return err
	})
}
