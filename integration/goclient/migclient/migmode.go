package migclient

import (
	"context"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// MigModeOption changes how SetMigMode asks for the mode change.
type MigModeOption func(*pb.SetMigModeRequest)

// ReclaimIdle makes a disable destroy the GPU's IDLE instances first (as ReclaimIdle does), so
// a GPU the sidecar only caches instances on can leave MIG mode. ACTIVE, ERROR or foreign
// instances and running processes still refuse it.
func ReclaimIdle() MigModeOption {
	return func(r *pb.SetMigModeRequest) { r.ReclaimIdle = true }
}

// Force is the operator's override of the pending-reservation guard: a disable is otherwise
// refused (RESERVED) while the scheduler has a pending reservation on the GPU, and ReclaimIdle()
// spares the IDLE instance such a reservation keeps.
func Force() MigModeOption {
	return func(r *pb.SetMigModeRequest) { r.Force = true }
}

// SetMigMode enables or disables MIG mode on one GPU.
func (c *Client) SetMigMode(ctx context.Context, gpuUUID string, enabled bool, opts ...MigModeOption) (SetMigModeResult, error) {
	req := &pb.SetMigModeRequest{GpuUuid: gpuUUID, Enabled: enabled}
	for _, o := range opts {
		o(req)
	}
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

// ReclaimIdle destroys IDLE instances the sidecar owns on one GPU: the named ones, or all of
// them when migUUIDs is empty. A named instance that is not IDLE fails with NOT_IDLE, an unknown
// one with UNKNOWN_INSTANCE, one a pending reservation keeps with RESERVED, and one running
// processes with INSTANCE_IN_USE (retried until the deadline, as for Allocate); in each case
// nothing is destroyed. A reclaim of all skips the instances a pending reservation keeps (see
// ReclaimIdleResult for them, and its force for the override).
func (c *Client) ReclaimIdle(ctx context.Context, gpuUUID string, migUUIDs ...string) ([]InstanceRef, error) {
	res, err := c.ReclaimIdleResult(ctx, gpuUUID, false, migUUIDs...)
	return res.Reclaimed, err
}

// ReclaimResult is what a ReclaimIdle did: the instances destroyed, and those a pending
// reservation kept (a reclaim of all without force only).
type ReclaimResult struct {
	Reclaimed []InstanceRef
	Kept      []InstanceRef
}

// ReclaimIdleResult is ReclaimIdle with the kept instances and the operator's override: with
// force, IDLE instances a pending reservation keeps are destroyed too (the pod the scheduler
// placed there will fail its Allocate).
func (c *Client) ReclaimIdleResult(ctx context.Context, gpuUUID string, force bool, migUUIDs ...string) (ReclaimResult, error) {
	const op = "ReclaimIdle"
	if gpuUUID == "" {
		return ReclaimResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "GPU UUID is empty")
	}
	req := &pb.ReclaimIdleRequest{GpuUuid: gpuUUID, MigUuids: migUUIDs, Force: force}
	var resp *pb.ReclaimIdleResponse
	err := c.withRecovery(ctx, op, c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.ReclaimIdle(ctx, req)
		return err
	})
	if err != nil {
		return ReclaimResult{}, err
	}
	return ReclaimResult{Reclaimed: instanceRefsFromPB(resp.GetReclaimed()), Kept: instanceRefsFromPB(resp.GetKept())}, nil
}
