package migclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
)

// call runs fn under one deadline of its own, retrying UNAVAILABLE with backoff. fn must send
// the same request every time: that is what makes a retried Allocate converge on the same
// instance.
func (c *Client) call(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
}

// retry runs fn within ctx until it succeeds, fails with anything but UNAVAILABLE, reaches
// maxAttempts (0: no cap) or runs out of time. Before each attempt it makes sure the backend
// of the sidecar behind the socket has been checked (GetInfo itself excepted).
func (c *Client) retry(ctx context.Context, op string, timeout time.Duration, maxAttempts int, fn func(context.Context) error) error {
	var last *Error // the last UNAVAILABLE answer that carried a reason (INSTANCE_IN_USE, ...)
	attempt := 0
	for {
		attempt++
		var err error
		if op != opGetInfo {
			err = c.checkBackend(ctx, op)
		}
		if err == nil {
			err = fn(ctx)
		}
		if err == nil {
			return nil
		}
		var stop *stopRetry
		if errors.As(err, &stop) {
			return err
		}
		e := fromRPC(op, err, attempt)
		switch {
		case e.Reason == ReasonNotRecovered || e.Code == codes.Unavailable && e.Reason == "":
			// A restarted sidecar, or a lost connection: maybe another process from now on.
			c.forgetBackend()
		case e.Code == codes.Unavailable && e.Reason != ReasonSidecarUnreachable:
			last = e
		}
		if e.Code != codes.Unavailable || maxAttempts > 0 && attempt >= maxAttempts {
			return c.finalError(ctx, op, timeout, e, attempt, last)
		}
		if !c.pause(ctx, attempt) {
			return c.finalError(ctx, op, timeout, e, attempt, last)
		}
	}
}

// finalError turns the last error of a call into the error the caller sees.
//
// When time ran out, the sidecar's last reason wins over a bare deadline: a plugin that logs
// "INSTANCE_IN_USE after 60s" knows that a pod in its grace period still holds the instance,
// not that the sidecar hung. Failing that, a call that ran out of time while the connection was
// not ready is SIDECAR_UNREACHABLE, so the plugin can tell "the sidecar is down" from "the
// sidecar said no". A call the caller cancelled is neither: see cancelledError.
func (c *Client) finalError(ctx context.Context, op string, timeout time.Duration, e *Error, attempts int, last *Error) error {
	e.Attempts = attempts
	if ctx.Err() == nil && e.Code != codes.DeadlineExceeded {
		if e.Code == codes.Unavailable && e.Reason == "" {
			return c.attemptsRanOut(op, e, attempts, last)
		}
		return e
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return cancelledError(ctx, op, e, attempts, last)
	}
	// gRPC can answer DEADLINE_EXCEEDED (the server's timer, from the grpc-timeout header)
	// a moment before ctx's own timer fires; either way the call's deadline is what ended it.
	// Such an answer came from the sidecar, so the sidecar is reachable whatever state the
	// connection shows (gRPC hands a ready connection to calls a moment before GetState
	// reports it READY).
	timeUp := ctx.Err()
	answered := timeUp == nil
	if timeUp == nil {
		timeUp = context.DeadlineExceeded
	}
	if last != nil {
		out := *last
		out.Op, out.Attempts = op, attempts
		out.Metadata = maps.Clone(last.Metadata)
		out.Message = fmt.Sprintf("%s (still the answer when the deadline of %s ran out; the same request may succeed later)",
			last.Message, timeout)
		causes := []error{last.cause}
		if e.cause != last.cause { //nolint:errorlint // the same error value, not a match: it is not joined twice
			causes = append(causes, e.cause)
		}
		out.cause = errors.Join(append(causes, timeUp)...)
		return &out
	}
	if e.Code == codes.Unavailable && e.Reason != "" {
		return e
	}
	if state := c.conn.GetState(); state != connectivity.Ready && !answered {
		return &Error{
			Op: op, Code: codes.Unavailable, Reason: ReasonSidecarUnreachable, Attempts: attempts, cause: e.cause,
			Message: fmt.Sprintf("no sidecar answered on %s within %s (connection %s); nothing was changed by this call",
				c.target, timeout, state),
		}
	}
	e.Code = codes.DeadlineExceeded
	e.Message = fmt.Sprintf("sidecar did not answer within %s: %s; retry with the same request", timeout, e.Message)
	if !errors.Is(e.cause, timeUp) {
		e.cause = errors.Join(e.cause, timeUp)
	}
	return e
}

// attemptsRanOut is the error of a call whose MaxAttempts ran out on an UNAVAILABLE answer
// without a reason: gRPC's own, for a connection lost or refused, or a sidecar shutting down.
// As when time runs out, the sidecar's last reason wins; failing that, the sidecar never gave
// one and is SIDECAR_UNREACHABLE, so the plugin can tell "the sidecar is down" from "the
// sidecar said no" whichever limit ended the retries.
func (c *Client) attemptsRanOut(op string, e *Error, attempts int, last *Error) *Error {
	if last != nil {
		out := *last
		out.Op, out.Attempts = op, attempts
		out.Metadata = maps.Clone(last.Metadata)
		out.Message = fmt.Sprintf("%s (the sidecar's last reason; the attempts ran out on %s)", last.Message, e.detail())
		out.cause = errors.Join(last.cause, e.cause)
		return &out
	}
	return &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonSidecarUnreachable, Attempts: attempts, cause: e.cause,
		Message: fmt.Sprintf("the sidecar on %s answered UNAVAILABLE without a reason until the attempts ran out "+
			"(connection lost or refused, or the sidecar shutting down): %s; the same request may succeed later", c.target, e.Message),
	}
}

// cancelledError is the error of a call its caller cancelled: CANCELLED, which satisfies
// errors.Is(err, context.Canceled). The sidecar neither failed to answer nor refused, so the
// error carries no reason (a reason would say the sidecar refused this call); the sidecar's last
// answer, if there was one, is named in the message and kept in the chain.
func cancelledError(ctx context.Context, op string, e *Error, attempts int, last *Error) *Error {
	if last == nil && e.Code == codes.Canceled && errors.Is(e.cause, context.Canceled) {
		return e // already made here, by the backend check's GetInfo under the same context
	}
	msg := "cancelled by the caller before the sidecar answered"
	causes := []error{}
	switch {
	case last != nil:
		msg = "cancelled by the caller; the sidecar's last answer was " + last.detail()
		causes = append(causes, last.cause)
	case e.Code != codes.Canceled && e.Code != codes.DeadlineExceeded:
		msg = "cancelled by the caller; the last attempt ended with " + e.detail()
	}
	if last == nil || e.cause != last.cause { //nolint:errorlint // the same error value, not a match: it is not joined twice
		causes = append(causes, e.cause)
	}
	causes = append(causes, contextErrors(ctx)...)
	return &Error{Op: op, Code: codes.Canceled, Message: msg, Attempts: attempts, cause: errors.Join(causes...)}
}

// contextErrors is why ctx ended: its Err, and the cause given to its cancel function if that
// is another error.
func contextErrors(ctx context.Context) []error {
	errs := []error{ctx.Err()}
	if cause := context.Cause(ctx); cause != nil && cause != ctx.Err() { //nolint:errorlint // the same error value, not a match: it is not listed twice
		errs = append(errs, cause)
	}
	return errs
}

// pause waits out the backoff after the given attempt; false when ctx ended first.
func (c *Client) pause(ctx context.Context, attempt int) bool {
	if ctx.Err() != nil {
		return false // a select below would pick at random between a done ctx and a fired timer
	}
	t := time.NewTimer(c.delay(attempt))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (c *Client) delay(attempt int) time.Duration {
	d := c.opts.Backoff.Initial << min(attempt-1, 20)
	if d <= 0 || d > c.opts.Backoff.Max {
		d = c.opts.Backoff.Max
	}
	return d/2 + rand.N(d/2+1)
}

// stopRetry carries an UNAVAILABLE answer out of retry without repeating the call.
type stopRetry struct{ err error }

func (s *stopRetry) Error() string { return s.err.Error() }
func (s *stopRetry) Unwrap() error { return s.err }
