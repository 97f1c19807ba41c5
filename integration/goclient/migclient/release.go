package migclient

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Release reports a confirmed release of a pod: its ACTIVE instances become IDLE. Prefer
// ReleaseByPodList, which is level-triggered and cannot lose a release.
func (c *Client) Release(ctx context.Context, podUID string) ([]InstanceRef, error) {
	if podUID == "" {
		return nil, newError("Release", codes.InvalidArgument, ReasonInvalidRequest, "pod UID is empty")
	}
	return c.release(ctx, &pb.ReleaseRequest{PodUid: podUID})
}

// ReleaseClaim is a DRA kubelet plugin's unprepare: the claim's ACTIVE instances become IDLE (a
// faulted one is destroyed instead). It touches no pod's instance, and a claim that holds none
// (already released, never prepared) answers an empty list: it is idempotent.
func (c *Client) ReleaseClaim(ctx context.Context, claimUID string) ([]InstanceRef, error) {
	if claimUID == "" {
		return nil, newError("Release", codes.InvalidArgument, ReasonInvalidRequest, "claim UID is empty")
	}
	return c.release(ctx, &pb.ReleaseRequest{ClaimUid: claimUID})
}

func (c *Client) release(ctx context.Context, req *pb.ReleaseRequest) ([]InstanceRef, error) {
	var resp *pb.ReleaseResponse
	err := c.withRecovery(ctx, "Release", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Release(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	return instanceRefsFromPB(resp.GetReleased()), nil
}

// SyncActive sends a pod list taken after generation was read from the same sidecar process.
// It is not retried after a recovery: a fence read from another run of the sidecar proves
// nothing about this one, so the caller must read the generation again (ReleaseByPodList does).
func (c *Client) SyncActive(ctx context.Context, generation uint64, active []*pb.ActiveAllocation) (SyncResult, error) {
	req := &pb.SyncActiveRequest{Generation: generation, Active: active}
	var resp *pb.SyncActiveResponse
	err := c.call(ctx, "SyncActive", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SyncActive(ctx, req)
		return err
	})
	if err != nil {
		return SyncResult{}, err
	}
	c.noteGeneration(resp.GetGeneration())
	return SyncResult{
		Generation:  generation,
		Idled:       instanceRefsFromPB(resp.GetIdled()),
		Reactivated: instanceRefsFromPB(resp.GetReactivated()),
	}, nil
}

// ReleaseByPodList is the plugin's release path: read the generation, then list pods, then
// SyncActive with that generation. Reading the generation first is the fence: an Allocate that
// completes while the list is being taken has a later generation, so the sidecar keeps it
// ACTIVE even though the list does not show it yet. A failed list sends nothing.
//
// A generation belongs to one sidecar process. GetInfo is read again after the list: if the
// sidecar restarted meanwhile (its boot id or start time changed), the pass starts over with a
// fresh generation and a fresh list instead of sending a fence from another run; so does a
// SyncActive answered NOT_RECOVERED (after recovering the sidecar), and a sidecar that restarted
// again right after the first GetInfo recovered it (no list is taken then). After recoverTries
// such restarts the pass fails with SIDECAR_RESTARTED and released nothing; the next pass
// retries. A sidecar that has not recovered, with no ListActive callback to recover it, fails
// the pass at once with NOT_RECOVERED before any pod list is taken.
func (c *Client) ReleaseByPodList(ctx context.Context, listActive ListActiveFunc) (SyncResult, error) {
	const op = "ReleaseByPodList"
	if listActive == nil {
		return SyncResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "no pod-list callback")
	}
	notRecovered := func(info Info, why string) error {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonNotRecovered, Attempts: 1,
			Message: fmt.Sprintf("nothing released: the sidecar (boot %s started %s) has not recovered, %s",
				info.BootID, info.StartedAt.Format(time.RFC3339Nano), why),
		}
	}
	var lastErr error
	for range recoverTries {
		before, err := c.GetInfo(ctx)
		if err != nil {
			return SyncResult{}, err
		}
		if !before.Recovered {
			if c.opts.ListActive == nil {
				return SyncResult{}, notRecovered(before, "and this client has no ListActive callback to recover it; no pod list was taken")
			}
			// GetInfo recovered the sidecar, and it restarted again before GetInfo read it back
			// (recover succeeded, so this is another process): start over and recover it again
			// rather than take a list that SyncActive would refuse.
			lastErr = fmt.Errorf("the sidecar restarted again right after its recovery (now boot %s started %s)",
				before.BootID, before.StartedAt.Format(time.RFC3339Nano))
			continue
		}
		active, err := listActive(ctx)
		if err != nil {
			return SyncResult{}, &Error{
				Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
				Message: fmt.Sprintf("pod list failed, nothing released: %v", err),
			}
		}
		after, err := c.getInfo(ctx)
		if err != nil {
			return SyncResult{}, err
		}
		if after.incarnation() != before.incarnation() {
			lastErr = fmt.Errorf("the sidecar restarted while the pod list was taken (boot %s started %s -> boot %s started %s, recovered=%t)",
				before.BootID, before.StartedAt.Format(time.RFC3339Nano), after.BootID, after.StartedAt.Format(time.RFC3339Nano), after.Recovered)
			continue
		}
		if !after.Recovered {
			// The same process no longer says it recovered: a sidecar that contradicts itself
			// gets nothing.
			return SyncResult{}, notRecovered(after, "although it had before the pod list was taken; the list was not sent")
		}
		res, err := c.SyncActive(ctx, before.Generation, active)
		if IsReason(err, ReasonNotRecovered) && c.opts.ListActive != nil {
			// The sidecar restarted between the second GetInfo and SyncActive: recover, then
			// start over with a fresh generation and a fresh list.
			if rerr := c.recoverWithin(ctx, op, err); rerr != nil {
				return SyncResult{}, rerr
			}
			lastErr = err
			continue
		}
		return res, err
	}
	return SyncResult{}, &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonSidecarRestarted, Attempts: recoverTries, cause: lastErr,
		Message: fmt.Sprintf("nothing released: the sidecar kept restarting during %d passes: %v", recoverTries, lastErr),
	}
}
