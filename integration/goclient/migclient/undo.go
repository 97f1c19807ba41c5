package migclient

import (
	"context"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// UndoResult is what an UndoAllocate changed: instances the undone Allocate created, now
// destroyed, and those it reused, back to IDLE.
type UndoResult struct {
	Destroyed []InstanceRef
	Idled     []InstanceRef
}

// UndoAllocate rolls back an Allocate that succeeded when a later plugin step failed (the
// runtime-identity annotation patch, the answer to kubelet). Unlike Release, it destroys what
// that Allocate created instead of caching it, so a failed admission leaves the GPU as it found
// it. It is idempotent and runs under AllocateTimeout, since it sits on kubelet's Allocate path;
// an unknown key answers OK with nothing changed.
func (c *Client) UndoAllocate(ctx context.Context, podUID string, containerIndex uint32) (UndoResult, error) {
	const op = "UndoAllocate"
	if podUID == "" {
		return UndoResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "pod UID is empty", nil)
	}
	req := &pb.UndoAllocateRequest{PodUid: podUID, ContainerIndex: containerIndex}
	var resp *pb.UndoAllocateResponse
	err := c.withRecovery(ctx, op, c.opts.AllocateTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.UndoAllocate(ctx, req)
		return err
	})
	if err != nil {
		return UndoResult{}, err
	}
	return UndoResult{Destroyed: instanceRefsFromPB(resp.GetDestroyed()), Idled: instanceRefsFromPB(resp.GetIdled())}, nil
}
