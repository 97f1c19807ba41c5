package migclient

import (
	"context"
	"fmt"

	"google.golang.org/grpc/codes"
)

// noteGeneration keeps the largest generation an answer carried (0: a sidecar that predates the
// field, which teaches nothing).
func (c *Client) noteGeneration(g uint64) {
	c.mu.Lock()
	c.known = max(c.known, g)
	c.mu.Unlock()
}

// knownGeneration is the fence a pod list taken now may use, and whether there is one: a
// generation read from the process behind the connection, which was checked since it came up.
func (c *Client) knownGeneration() (uint64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.known, c.backendOK && c.seen != nil
}

// ReleaseWithKnownGeneration is ReleaseByPodList without the GetInfo calls around the pod list:
// the fence is the largest generation an earlier answer carried (GetInfo, Allocate, SyncActive,
// UndoDevice), read before the list is taken. That is at or below the generation the sidecar had
// when the list began, since generations only grow (across restarts too), so every allocation the
// list may miss has a later one and stays ACTIVE, as with ReleaseByPodList. A fence lower than
// ReleaseByPodList's only delays a release to the next pass: each answer moves it up.
//
// When no generation is known (a new connection, or the sidecar behind it changed), or the
// sidecar refuses the fence or has not recovered, it falls back to ReleaseByPodList, recovering
// the sidecar first where needed. In the steady state it is one SyncActive and one pod list.
func (c *Client) ReleaseWithKnownGeneration(ctx context.Context, listActive ListActiveFunc) (SyncResult, error) {
	const op = "ReleaseWithKnownGeneration"
	if listActive == nil {
		return SyncResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "no pod-list callback")
	}
	gen, ok := c.knownGeneration()
	if !ok {
		return c.ReleaseByPodList(ctx, listActive)
	}
	active, err := listActive(ctx)
	if err != nil {
		return SyncResult{}, &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
			Message: fmt.Sprintf("pod list failed, nothing released: %v", err),
		}
	}
	res, err := c.SyncActive(ctx, gen, active)
	switch {
	case err == nil:
		return res, nil
	case IsReason(err, ReasonNotRecovered), IsReason(err, ReasonInvalidRequest):
		// A restarted sidecar (the list is still good, the fence must be read from the process
		// that answers), or a fence it refuses: the full pass, with a fresh generation and list.
		return c.ReleaseByPodList(ctx, listActive)
	default:
		return SyncResult{}, err
	}
}
