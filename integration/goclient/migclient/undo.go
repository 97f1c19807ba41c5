package migclient

import (
	"context"
	"fmt"

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
		return UndoResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "pod UID is empty")
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

// DeviceOwner names who holds one MIG device: the allocation key of the Allocate that took it.
type DeviceOwner struct {
	PodUID         string
	ContainerIndex uint32
	DeviceIndex    uint32
}

// UndoSkip says why an UndoDevice changed nothing; UndoSkipNone when it did something.
type UndoSkip string

// The answers of an UndoDevice that changed nothing.
const (
	UndoSkipNone            UndoSkip = ""
	UndoSkipUnknownInstance UndoSkip = "UNKNOWN_INSTANCE" // no owned instance has that MIG UUID
	UndoSkipNotActive       UndoSkip = "NOT_ACTIVE"       // IDLE (released or undone before), ERROR, in flight
	UndoSkipOtherOwner      UndoSkip = "OTHER_OWNER"      // ACTIVE for another pod, container or device
)

// DeviceUndo is what an UndoDevice did: Destroyed (its Allocate created it), Idled (it reused
// it), or neither, with Skipped and the sidecar's Detail saying why.
type DeviceUndo struct {
	Destroyed *InstanceRef
	Idled     *InstanceRef
	Skipped   UndoSkip
	Detail    string
}

// UndoDevice undoes the Allocate of one MIG device, only while owner still holds it ACTIVE: the
// rollback of exactly the devices a failed plugin Allocate took. A repeated or late undo, one of
// an instance another pod holds now, or of another device of the same container, changes nothing
// and answers Skipped. The guard is the sidecar's record, so it holds across plugin restarts.
// A sidecar without the RPC answers UNIMPLEMENTED, and nothing changes: the container-level
// UndoAllocate is never used in its place.
func (c *Client) UndoDevice(ctx context.Context, migUUID string, owner DeviceOwner) (DeviceUndo, error) {
	const op = "UndoDevice"
	if migUUID == "" || owner.PodUID == "" {
		return DeviceUndo{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "MIG UUID or pod UID is empty")
	}
	req := &pb.UndoDeviceRequest{MigUuid: migUUID, PodUid: owner.PodUID, ContainerIndex: owner.ContainerIndex, DeviceIndex: owner.DeviceIndex}
	var resp *pb.UndoDeviceResponse
	err := c.withRecovery(ctx, op, c.opts.AllocateTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.UndoDevice(ctx, req)
		return err
	})
	if err != nil {
		return DeviceUndo{}, err
	}
	c.noteGeneration(resp.GetGeneration())
	out := DeviceUndo{Detail: resp.GetDetail()}
	if resp.GetDestroyed() != nil {
		r := instanceRefsFromPB([]*pb.InstanceRef{resp.GetDestroyed()})[0]
		out.Destroyed = &r
	}
	if resp.GetIdled() != nil {
		r := instanceRefsFromPB([]*pb.InstanceRef{resp.GetIdled()})[0]
		out.Idled = &r
	}
	switch resp.GetSkipped() {
	case pb.UndoSkip_UNDO_SKIP_UNSPECIFIED:
	case pb.UndoSkip_UNDO_SKIP_UNKNOWN_INSTANCE:
		out.Skipped = UndoSkipUnknownInstance
	case pb.UndoSkip_UNDO_SKIP_NOT_ACTIVE:
		out.Skipped = UndoSkipNotActive
	case pb.UndoSkip_UNDO_SKIP_OTHER_OWNER:
		out.Skipped = UndoSkipOtherOwner
	default:
		out.Skipped = UndoSkip(resp.GetSkipped().String())
	}
	if (out.Destroyed == nil && out.Idled == nil) == (out.Skipped == UndoSkipNone) {
		return DeviceUndo{}, newError(op, codes.Internal, ReasonInvalidResponse,
			fmt.Sprintf("the answer for %s neither did one thing nor said why it did nothing: %v", migUUID, resp))
	}
	return out, nil
}
