package migclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sort"
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the google.rpc.ErrorInfo domain the sidecar puts on every error it raises itself.
const ErrorDomain = "migsidecar.hami.io"

// Reasons the sidecar reports in google.rpc.ErrorInfo (the contract's error table), plus the
// reasons this client raises itself when the sidecar cannot be trusted or reached.
const (
	ReasonInvalidRequest    = "INVALID_REQUEST"
	ReasonUnknownProfile    = "UNKNOWN_PROFILE"
	ReasonIllegalPlacement  = "ILLEGAL_PLACEMENT"
	ReasonUnknownGPU        = "UNKNOWN_GPU"
	ReasonNotRecovered      = "NOT_RECOVERED"
	ReasonPlacementBusy     = "PLACEMENT_BUSY"
	ReasonKeyConflict       = "KEY_CONFLICT"
	ReasonMigDisabled       = "MIG_DISABLED"
	ReasonInstanceInUse     = "INSTANCE_IN_USE"
	ReasonNvmlError         = "NVML_ERROR"
	ReasonStateWriteFailed  = "STATE_WRITE_FAILED"
	ReasonUnverifiableState = "UNVERIFIABLE_STATE"
	// ReasonNotIdle: ReclaimIdle named an instance that is not IDLE (ACTIVE, ERROR, in flight).
	ReasonNotIdle = "NOT_IDLE"
	// ReasonUnknownInstance: ReclaimIdle named a MIG UUID the sidecar does not hold on that GPU.
	ReasonUnknownInstance = "UNKNOWN_INSTANCE"
	// ReasonReserved: ReclaimIdle named an IDLE instance a pending reservation keeps, or a MIG
	// disable met a pending reservation on its GPU (metadata guarded_by names it); force overrides.
	ReasonReserved = "RESERVED"
	// ReasonRequestTooLarge: the request was larger than the sidecar's receive limit (the largest
	// valid request), so gRPC refused it with RESOURCE_EXHAUSTED before the sidecar saw it, without
	// an ErrorInfo. Not retried: the same request is refused again. See ErrRequestTooLarge.
	ReasonRequestTooLarge = "REQUEST_TOO_LARGE"
	// ReasonInternal: a bug in the sidecar (code INTERNAL; the sidecar logs its traceback).
	// Not retried: the same request would meet the same bug.
	ReasonInternal = "INTERNAL"

	// ReasonInvalidResponse: the sidecar answered, but the answer does not cover the request
	// exactly (a device missing, an identity incomplete). The client refuses partial success.
	ReasonInvalidResponse = "INVALID_RESPONSE"
	// ReasonRecoveryFailed: the sidecar needed Recover, and each pod list taken for it was
	// spoiled by a restart (or a moved generation) while it was taken; no Recover was sent with a
	// list that could be stale, and the original call was not retried. A Recover the sidecar
	// refused keeps the sidecar's reason (e.g. UNVERIFIABLE_STATE); one it answered UNAVAILABLE
	// until the deadline or MaxAttempts ended the recovery keeps its last reason (e.g.
	// NVML_ERROR), as any call does.
	ReasonRecoveryFailed = "RECOVERY_FAILED"
	// ReasonSidecarRestarted: ReleaseByPodList gave up because the sidecar restarted during
	// each of its passes; nothing was released, the next pass tries again.
	ReasonSidecarRestarted = "SIDECAR_RESTARTED"
	// ReasonSimulatedBackend: the sidecar reports the simulated NVML backend and the client was
	// not built with Options.AllowSimulatedBackend. Not retried: it is a deployment error.
	ReasonSimulatedBackend = "SIMULATED_BACKEND"
	// ReasonPodListFailed: the caller's pod-list callback failed; nothing was sent.
	ReasonPodListFailed = "POD_LIST_FAILED"
	// ReasonSidecarUnreachable: the sidecar gave no reason before the call's retries ended: no
	// answer within the call's deadline while the connection was not ready (the sidecar is
	// down), or only UNAVAILABLE answers without a reason (gRPC's, for a connection lost or
	// refused, or a sidecar shutting down) until MaxAttempts ran out. Code UNAVAILABLE: the
	// same request may succeed later.
	ReasonSidecarUnreachable = "SIDECAR_UNREACHABLE"
)

// ErrRequestTooLarge is matched (errors.Is) by every *Error with ReasonRequestTooLarge: a request
// above the sidecar's receive limit, refused by the transport (RESOURCE_EXHAUSTED, no ErrorInfo).
var ErrRequestTooLarge = errors.New("migsidecar: request larger than the sidecar accepts")

// Error is every error this package returns for a call to the sidecar. It carries the gRPC code
// and the ErrorInfo reason and metadata so that a device plugin can branch on the reason (for
// instance report PLACEMENT_BUSY back to the scheduler) without parsing messages.
//
// Errors from the sidecar keep its code and reason; errors raised here (unreachable sidecar,
// invalid response, failed recovery) use the Reason* constants above. Use errors.As or the
// helpers IsReason, ReasonOf and CodeOf.
//
// Two errors describe the call rather than an answer. A call whose deadline ran out while it
// waited for a recovery another call had under way is DEADLINE_EXCEEDED with reason
// NOT_RECOVERED. A call its caller cancelled is CANCELLED with no reason (the sidecar's last
// answer, if any, is named in the message) and satisfies errors.Is(err, context.Canceled); it
// is never SIDECAR_UNREACHABLE nor DEADLINE_EXCEEDED, since it says nothing about the sidecar.
type Error struct {
	// Op is the RPC (or helper) that failed, e.g. "Allocate".
	Op string
	// Code is the gRPC status code.
	Code codes.Code
	// Reason is the ErrorInfo reason, empty when the status carried none.
	Reason string
	// Metadata is the ErrorInfo metadata (e.g. which instance blocks a placement).
	Metadata map[string]string
	// Message is the status message.
	Message string
	// Attempts counts the calls made, retries included.
	Attempts int

	cause error
}

func (e *Error) Error() string {
	s := "migsidecar " + e.Op + ": " + e.detail()
	if e.Attempts > 1 {
		s += fmt.Sprintf(" (after %d attempts)", e.Attempts)
	}
	return s
}

// detail is the code, reason, message and metadata, as Error shows them after the op.
func (e *Error) detail() string {
	var b strings.Builder
	b.WriteString(e.Code.String())
	if e.Reason != "" {
		fmt.Fprintf(&b, " %s", e.Reason)
	}
	if e.Message != "" {
		fmt.Fprintf(&b, ": %s", e.Message)
	}
	if len(e.Metadata) > 0 {
		keys := make([]string, 0, len(e.Metadata))
		for k := range e.Metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, 0, len(keys))
		for _, k := range keys {
			parts = append(parts, k+"="+e.Metadata[k])
		}
		fmt.Fprintf(&b, " [%s]", strings.Join(parts, " "))
	}
	return b.String()
}

// Is makes errors.Is(err, ErrRequestTooLarge) true for a request the transport refused as too large.
func (e *Error) Is(target error) bool {
	return target == ErrRequestTooLarge && e.Reason == ReasonRequestTooLarge
}

// Unwrap exposes the underlying cause (a gRPC status error, a context error or the callback's
// error) so errors.Is(err, context.DeadlineExceeded) keeps working.
func (e *Error) Unwrap() error { return e.cause }

// GRPCStatus lets status.FromError and status.Code read the code through this wrapper.
func (e *Error) GRPCStatus() *status.Status {
	if st, ok := status.FromError(e.cause); ok && st.Code() == e.Code {
		return st
	}
	return status.New(e.Code, e.Error())
}

// Retryable reports whether the contract allows repeating the same call: UNAVAILABLE only.
func (e *Error) Retryable() bool { return e.Code == codes.Unavailable }

// IsReason reports whether err is (or wraps) an *Error with the given reason.
func IsReason(err error, reason string) bool {
	return ReasonOf(err) == reason
}

// ReasonOf returns the ErrorInfo reason of err, or "" when err carries none.
func ReasonOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	if st, ok := status.FromError(err); ok {
		r, _ := errorInfo(st)
		return r
	}
	return ""
}

// CodeOf returns the gRPC code of err (codes.OK for nil, codes.Unknown for foreign errors).
func CodeOf(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return status.Code(err)
}

// errorInfo extracts reason and metadata from the status' google.rpc.ErrorInfo detail. A detail
// from another domain is ignored: its reasons are not ours to interpret.
func errorInfo(st *status.Status) (string, map[string]string) {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && (info.GetDomain() == ErrorDomain || info.GetDomain() == "") {
			return info.GetReason(), maps.Clone(info.GetMetadata())
		}
	}
	return "", nil
}

// fromRPC converts an error returned by a generated stub into an *Error.
func fromRPC(op string, err error, attempts int) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	st, ok := status.FromError(err)
	if !ok {
		// Context errors raised before the stub ran, or anything foreign.
		code := codes.Unknown
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			code = codes.DeadlineExceeded
		case errors.Is(err, context.Canceled):
			code = codes.Canceled
		}
		return &Error{Op: op, Code: code, Message: err.Error(), Attempts: attempts, cause: err}
	}
	reason, md := errorInfo(st)
	if reason == "" && st.Code() == codes.ResourceExhausted {
		// The transport's own refusal of a body above the receive limit: it carries no ErrorInfo.
		reason = ReasonRequestTooLarge
	}
	return &Error{Op: op, Code: st.Code(), Reason: reason, Metadata: md, Message: st.Message(), Attempts: attempts, cause: err}
}

func newError(op string, code codes.Code, reason, message string) *Error {
	return &Error{Op: op, Code: code, Reason: reason, Message: message, Attempts: 1}
}
