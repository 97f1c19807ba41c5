package migclient

import (
	"context"
	"errors"
	"io"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// HealthUpdate is the health of one owned instance, from WatchHealth. Faulted means a critical
// Xid named the instance or its whole GPU: the plugin marks the kubelet device unhealthy; the
// sidecar never hands the instance out again and destroys it at its release.
type HealthUpdate struct {
	GPUUUID           string
	Profile           string
	Placement         Placement
	MigUUID           string
	GPUInstanceID     uint32
	ComputeInstanceID uint32
	Faulted           bool
	Xid               uint32 // 0 while healthy; 4294967295 for an Xid above it (xid64 in the contract)
	// Current is true on the updates that open the stream (the health as it stood), false on a
	// change that happened while watching.
	Current bool
}

// WatchHealth calls fn with the health of every owned instance as it stands and, with follow,
// then with every change, until ctx is done (nil is returned then), the stream ends or fails.
// A stream the sidecar refuses because as many follow as it admits (RESOURCE_EXHAUSTED
// OVERLOADED, sent before any update) is opened again with the calls' backoff until ctx is done;
// any other failure is not retried: a caller that follows watches again after an error, and its
// opening updates say the health as it stands then, so nothing is missed.
func (c *Client) WatchHealth(ctx context.Context, follow bool, fn func(HealthUpdate)) error {
	for attempt := 1; ; attempt++ {
		err := c.watchHealth(ctx, follow, fn)
		if !IsReason(err, ReasonOverloaded) {
			return err
		}
		if !c.pause(ctx, attempt) {
			return nil // the caller ended the watch while it waited for a place
		}
	}
}

func (c *Client) watchHealth(ctx context.Context, follow bool, fn func(HealthUpdate)) error {
	if err := c.checkBackend(ctx, "WatchHealth"); err != nil {
		return err
	}
	stream, err := c.rpc.WatchHealth(ctx, &pb.WatchHealthRequest{Follow: follow})
	if err != nil {
		return fromRPC("WatchHealth", err, 1)
	}
	for {
		u, err := stream.Recv()
		switch {
		case errors.Is(err, io.EOF):
			return nil
		case err != nil && ctx.Err() != nil:
			return nil //nolint:nilerr // the caller ended the watch: that is its normal end, as documented
		case err != nil:
			return fromRPC("WatchHealth", err, 1)
		}
		fn(HealthUpdate{
			GPUUUID: u.GetGpuUuid(), Profile: u.GetProfile(), Placement: placementFromPB(u.GetPlacement()),
			MigUUID: u.GetMigUuid(), GPUInstanceID: u.GetGpuInstanceId(), ComputeInstanceID: u.GetComputeInstanceId(),
			Faulted: u.GetHealth() == pb.InstanceHealth_FAULTED, Xid: u.GetXid(), Current: u.GetCurrent(),
		})
	}
}
