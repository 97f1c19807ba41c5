package migclient

import (
	"context"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// ListGpus returns the node's GPUs with their MIG mode.
func (c *Client) ListGpus(ctx context.Context) ([]GPU, error) {
	var resp *pb.ListGpusResponse
	err := c.call(ctx, "ListGpus", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.ListGpus(ctx, &pb.ListGpusRequest{})
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]GPU, 0, len(resp.GetGpus()))
	for _, g := range resp.GetGpus() {
		out = append(out, GPU{
			Index: g.GetIndex(), UUID: g.GetUuid(), Minor: g.GetMinor(), Model: g.GetModel(),
			MemoryMB: g.GetMemoryMb(), MigMode: migModeFromPB(g.GetMigMode()), Busy: g.GetBusy(),
		})
	}
	return out, nil
}

// DiscoverProfiles returns the profiles of one GPU (allowed names only; nil = all).
func (c *Client) DiscoverProfiles(ctx context.Context, gpuUUID string, allowed []string) ([]Profile, error) {
	req := &pb.DiscoverProfilesRequest{GpuUuid: gpuUUID, AllowedProfiles: allowed}
	var resp *pb.DiscoverProfilesResponse
	err := c.call(ctx, "DiscoverProfiles", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.DiscoverProfiles(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]Profile, 0, len(resp.GetProfiles()))
	for _, p := range resp.GetProfiles() {
		pls := make([]Placement, 0, len(p.GetPlacements()))
		for _, pl := range p.GetPlacements() {
			pls = append(pls, placementFromPB(pl))
		}
		out = append(out, Profile{
			Name: p.GetName(), GIProfileID: p.GetGiProfileId(), CIProfileID: p.GetCiProfileId(),
			SliceCount: p.GetSliceCount(), MemoryMB: p.GetMemoryMb(), CorePercent: p.GetCorePercent(),
			InstanceCount: p.GetInstanceCount(), Placements: pls,
		})
	}
	return out, nil
}

// GetState returns the sidecar's full view for operators. It passes the contract message
// through unchanged: it is read by tools, not by allocation logic.
func (c *Client) GetState(ctx context.Context) (*pb.GetStateResponse, error) {
	var resp *pb.GetStateResponse
	err := c.call(ctx, "GetState", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.GetState(ctx, &pb.GetStateRequest{})
		return err
	})
	return resp, err
}
