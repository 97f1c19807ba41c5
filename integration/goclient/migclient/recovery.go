package migclient

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// withRecovery runs a mutating call; if the sidecar answers NOT_RECOVERED it recovers it (when
// a ListActive callback is configured) and repeats the call exactly once. One deadline covers
// the call, the recovery and the repeat: kubelet waits on Allocate as a whole.
func (c *Client) withRecovery(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
	if !IsReason(err, ReasonNotRecovered) {
		return err
	}
	if rerr := c.recoverFor(ctx, op, timeout, err); rerr != nil {
		return rerr
	}
	return c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
}

// recoverFor runs Recover on behalf of op, within ctx, whose deadline is timeout long. Only one
// Recover runs at a time; callers that waited for it find the sidecar recovered and skip their
// own. A caller waits only as long as ctx allows: one whose context ends first says it was
// waiting for that recovery rather than blaming the sidecar (recoveryWaitError).
//
// The pod list is fenced like a release: GetInfo before it and again after it. If the sidecar
// restarted or its generation moved in between, the list may miss allocations made meanwhile,
// so it is thrown away and the recovery starts over at once; after recoverTries such passes it
// fails with RECOVERY_FAILED. If someone else recovered the sidecar meanwhile, nothing is sent.
//
// Recover answered UNAVAILABLE (NVML_ERROR or STATE_WRITE_FAILED while the sidecar gathers or
// records, or a connection lost to a restart) may succeed later, as the contract says. It is
// never repeated with the same list: after a backoff the recovery starts over with a fresh one,
// until ctx ends (or MaxAttempts Recover calls were made). The error then keeps the sidecar's
// last answer, as finalError does for any call, so "NVML_ERROR after 60s" reaches the plugin.
func (c *Client) recoverFor(ctx context.Context, op string, timeout time.Duration, cause error) error {
	if c.opts.ListActive == nil {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonNotRecovered, Attempts: 1, cause: cause,
			Message: "the sidecar has not recovered and this client has no ListActive callback to recover it",
		}
	}
	select {
	case c.recovering <- struct{}{}:
	case <-ctx.Done():
		return recoveryWaitError(ctx, op, cause)
	}
	defer func() { <-c.recovering }()
	rop := "Recover (needed by " + op + ")"
	var (
		spoiled  error  // why the last pod list was thrown away
		passes   int    // pod lists thrown away
		attempts int    // Recover calls made
		lastE    *Error // Recover's last UNAVAILABLE answer
		last     *Error // the last of them that carried a reason
	)
	// gaveUp is the error of a step that failed: once Recover has answered UNAVAILABLE, a step
	// that failed because ctx ended reports that answer with the deadline, not the step.
	gaveUp := func(err error) error {
		if lastE == nil || ctx.Err() == nil {
			return err
		}
		return c.finalError(ctx, rop, timeout, lastE, attempts, last)
	}
	for passes < recoverTries {
		before, err := c.getInfo(ctx)
		if err != nil {
			return gaveUp(err)
		}
		if before.Recovered {
			return nil
		}
		active, err := c.opts.ListActive(ctx)
		if err != nil {
			if lastE != nil && ctx.Err() != nil {
				return gaveUp(err)
			}
			// Never a partial list: the sidecar would take a missing allocation for a released one.
			return &Error{
				Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
				Message: fmt.Sprintf("listing active allocations to recover the sidecar: %v; Recover not sent", err),
			}
		}
		after, err := c.getInfo(ctx)
		if err != nil {
			return gaveUp(err)
		}
		if after.Recovered {
			return nil
		}
		if after.incarnation() != before.incarnation() || after.Generation != before.Generation {
			spoiled = fmt.Errorf("the sidecar restarted or handed out generations while the pod list was taken "+
				"(boot %s generation %d -> boot %s generation %d)", before.BootID, before.Generation, after.BootID, after.Generation)
			passes++
			continue
		}
		req := &pb.RecoverRequest{Active: active}
		attempts++
		err = c.call(ctx, rop, c.opts.CallTimeout, func(ctx context.Context) error {
			_, err := c.rpc.Recover(ctx, req)
			if CodeOf(err) == codes.Unavailable {
				// Do not repeat this list on whatever answers next: start over instead.
				return &stopRetry{err}
			}
			return err
		})
		var stop *stopRetry
		if !errors.As(err, &stop) {
			return gaveUp(err) // nil once recovered
		}
		lastE = fromRPC(rop, stop.err, attempts)
		if lastE.Reason != "" {
			last = lastE
		}
		if c.opts.MaxAttempts > 0 && attempts >= c.opts.MaxAttempts {
			return c.finalError(ctx, rop, timeout, lastE, attempts, last)
		}
		if !c.pause(ctx, attempts) {
			return c.finalError(ctx, rop, timeout, lastE, attempts, last)
		}
	}
	return &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonRecoveryFailed, Attempts: recoverTries, cause: spoiled,
		Message: fmt.Sprintf("the sidecar could not be recovered: it restarted or handed out generations during each of %d pod lists, "+
			"and no Recover was sent with a list that could be stale: %v", recoverTries, spoiled),
	}
}

// recoveryWaitError is the error of a call whose context ended while another call's recovery
// held the token: the sidecar was not slow to answer this call, it has not recovered yet and
// the recovery under way (its pod list, or Recover) has not finished. cause is what showed the
// sidecar not recovered (the NOT_RECOVERED answer), nil when GetInfo showed it.
func recoveryWaitError(ctx context.Context, op string, cause error) *Error {
	attempts := 1
	var e *Error
	if errors.As(cause, &e) {
		attempts = e.Attempts
	}
	out := &Error{Op: op, Attempts: attempts, cause: errors.Join(append([]error{cause}, contextErrors(ctx)...)...)}
	if errors.Is(ctx.Err(), context.Canceled) {
		out.Code = codes.Canceled
		out.Message = "cancelled by the caller while waiting for the recovery another call has under way " +
			"(the sidecar has not recovered: " + ReasonNotRecovered + "); the call was not repeated"
		return out
	}
	out.Code, out.Reason = codes.DeadlineExceeded, ReasonNotRecovered
	out.Message = "the sidecar has not recovered, and the deadline ran out while this call waited for the recovery " +
		"another call has under way (its pod list or Recover); the call was not repeated and may succeed once the sidecar has recovered"
	return out
}

// GetInfo returns the sidecar's identity. When it shows a sidecar that has not recovered (a
// restart, or the first start of the node) and a ListActive callback is configured, the client
// recovers it first and returns the identity after recovery.
func (c *Client) GetInfo(ctx context.Context) (Info, error) {
	info, err := c.getInfo(ctx)
	if err != nil || info.Recovered || c.opts.ListActive == nil {
		return info, err
	}
	if err := c.recoverWithin(ctx, "GetInfo", nil); err != nil {
		return Info{}, err
	}
	return c.getInfo(ctx)
}

// recoverWithin runs a recovery that no deadline of its call bounds (GetInfo, ReleaseByPodList:
// their context may have none) under CallTimeout, as Release's and SetMigMode's recoveries are
// bounded by theirs, so that the pod list never runs without a deadline.
func (c *Client) recoverWithin(ctx context.Context, op string, cause error) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.CallTimeout)
	defer cancel()
	return c.recoverFor(ctx, op, c.opts.CallTimeout, cause)
}

// EnsureRecovered is what the plugin calls at startup before serving kubelet: it returns once
// the sidecar has recovered, recovering it with ListActive when needed.
func (c *Client) EnsureRecovered(ctx context.Context) (Info, error) {
	info, err := c.GetInfo(ctx)
	if err != nil {
		return Info{}, err
	}
	if !info.Recovered {
		return Info{}, newError("EnsureRecovered", codes.FailedPrecondition, ReasonNotRecovered,
			"the sidecar has not recovered and no ListActive callback is configured")
	}
	return info, nil
}

// Recover sends the plugin's active allocations for startup recovery. It is idempotent.
func (c *Client) Recover(ctx context.Context, active []*pb.ActiveAllocation) (RecoverReport, error) {
	req := &pb.RecoverRequest{Active: active}
	var resp *pb.RecoverResponse
	err := c.call(ctx, "Recover", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Recover(ctx, req)
		return err
	})
	if err != nil {
		return RecoverReport{}, err
	}
	return recoverReportFromPB(resp), nil
}
