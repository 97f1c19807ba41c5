package migclient

import (
	"context"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// SetMigMode enables or disables MIG mode on one GPU.
func (c *Client) SetMigMode(ctx context.Context, gpuUUID string, enabled bool) (SetMigModeResult, error) {
	req := &pb.SetMigModeRequest{GpuUuid: gpuUUID, Enabled: enabled}
	var resp *pb.SetMigModeResponse
	err := c.withRecovery(ctx, "SetMigMode", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SetMigMode(ctx, req)
		return err
	})
	if err != nil {
		return SetMigModeResult{}, err
	}
	return SetMigModeResult{MigMode: migModeFromPB(resp.GetMigMode()), NeedsReset: resp.GetNeedsReset()}, nil
}
