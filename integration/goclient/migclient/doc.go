// Package migclient is the client HAMi's device plugin uses to drive hami-mig-sidecar over its
// Unix socket.
//
// The plugin decides placement and knows pods; the sidecar alone touches NVML. This package
// makes that split safe to use from kubelet callbacks:
//
//   - every RPC carries a deadline (kubelet gives Allocate none) and waits for the socket
//     within it, so a restarting sidecar delays a call instead of failing it;
//   - only UNAVAILABLE and RESOURCE_EXHAUSTED OVERLOADED (the sidecar held as many calls as it
//     admits, and did nothing) are retried, with backoff and the identical request, so a
//     retried Allocate keeps its allocation key and converges on the same instance;
//   - errors are *Error values exposing the sidecar's google.rpc.ErrorInfo reason
//     (PLACEMENT_BUSY, NOT_RECOVERED, ...), see IsReason;
//   - a sidecar that restarted answers NOT_RECOVERED; given Options.ListActive the client then
//     calls Recover with the plugin's active allocations and retries the call once;
//   - ReleaseByPodList implements the generation-fenced release (GetInfo, pod list, SyncActive);
//     ReleaseWithKnownGeneration is the same pass fenced by the last generation an answer
//     carried, one SyncActive in the steady state;
//   - UndoDevice undoes one MIG device only while the named owner holds it, and says why not;
//   - answers are checked: a call either returns a complete result or an error, never a
//     partial success;
//   - a sidecar on the simulated backend is refused (SIMULATED_BACKEND) unless
//     Options.AllowSimulatedBackend is set.
//
// # Deadlines and retries
//
// Allocate runs in kubelet's admission path, and HAMi serializes it node-wide, so its deadline
// is a trade between waiting out a transient refusal and stalling every admission on the node:
//
//   - AllocateTimeout, 60s by default, bounds the whole call: attempts, backoff, a recovery
//     after NOT_RECOVERED (GetInfo, the pod list, Recover) and the one repeat. Creating a GI/CI
//     pair takes about a second on real hardware, so a multi-device container with reclaims
//     fits in a few seconds; the rest is there for INSTANCE_IN_USE.
//   - INSTANCE_IN_USE (UNAVAILABLE) means the idle instance the scheduler picked still runs a
//     process of a pod in its termination grace period. It clears when that process exits: at
//     the latest terminationGracePeriodSeconds (30s by default) plus the kill. 60s is twice
//     the default grace period. Clusters with longer grace periods should raise
//     AllocateTimeout, or accept that such an Allocate fails and the pod is admitted again.
//   - MaxAttempts is 0 (no cap) by default: the deadline alone ends the retries, so a grace
//     period is waited out rather than cut short after a fixed number of attempts.
//   - Backoff starts at 100ms and doubles to 2s, with jitter: a restart or a transient NVML
//     error costs a fraction of a second, and a busy instance is polled every one to two
//     seconds (one NVML process query on the sidecar each), about 30 times a minute.
//   - CallTimeout, 10s, bounds every other RPC. They are answered from the sidecar's memory
//     except Recover, which reads every GPU's MIG layout; 10s also covers a sidecar restart.
//     It also bounds, as a whole, a recovery that GetInfo, EnsureRecovered or ReleaseByPodList
//     start, pod list included, as it bounds Release's: their context may carry no deadline.
//
// When the deadline runs out after UNAVAILABLE or OVERLOADED answers, the error keeps the sidecar's last code,
// reason and metadata (e.g. INSTANCE_IN_USE naming the instance), says that the deadline ran out,
// and satisfies errors.Is(err, context.DeadlineExceeded); the plugin can log "instance in use"
// rather than a bare deadline. Without any such answer it is SIDECAR_UNREACHABLE (the socket did
// not answer) or DEADLINE_EXCEEDED (the sidecar did not answer in time). When MaxAttempts ends
// the retries instead, the error is the last answer if it carried a reason, else the last one
// that did, else SIDECAR_UNREACHABLE (every answer was gRPC's UNAVAILABLE without a reason: a
// connection lost or refused, a sidecar shutting down).
//
// A call its caller cancels fails with CANCELLED and satisfies errors.Is(err, context.Canceled);
// it is never SIDECAR_UNREACHABLE or DEADLINE_EXCEEDED, since it says nothing about the sidecar.
// The sidecar's last answer, if there was one, is named in the message, not taken as the reason.
//
// # Restarts
//
// One Recover runs at a time; concurrent calls refused with NOT_RECOVERED wait for it and then
// repeat once. Each waits only within its own deadline: one whose deadline runs out first fails
// with DEADLINE_EXCEEDED and reason NOT_RECOVERED, saying it waited for the recovery under way
// (CANCELLED if its caller cancelled it). The pod list for Recover is fenced like a release:
// GetInfo before and after it, and if the sidecar restarted or handed out generations in
// between, the list is discarded and taken again; if another client recovered the sidecar
// meanwhile, nothing is sent. After three lists spoiled that way the call fails with
// RECOVERY_FAILED. A Recover answered UNAVAILABLE (an NVML error while the sidecar reads the
// layout, a failed record write, a restart during the call) may succeed later: it is repeated,
// with backoff and a fresh pod list each time, until the call's deadline (or MaxAttempts Recover
// calls); the error then keeps the sidecar's last reason, as above. A failed pod list is never
// sent, whatever part of it was read (POD_LIST_FAILED). ReleaseByPodList reads GetInfo again
// after its pod list too and starts over when the sidecar restarted (its boot id or start time
// changed), so a generation is only ever sent to the process that handed it out. Without
// ListActive nothing can recover the sidecar: ReleaseByPodList, like every mutating call, then
// fails with NOT_RECOVERED, before any pod list is taken.
//
// # Backend
//
// GetInfo reports the sidecar's backend, "nvml" or "simulated". The client checks it on first
// contact and again whenever the process behind the socket may have changed (the connection
// left READY, a connection-level UNAVAILABLE, NOT_RECOVERED), before sending anything else.
// A simulated sidecar creates no MIG instance; on a real node it is a deployment error, so it
// fails every call with FAILED_PRECONDITION SIMULATED_BACKEND, which is not retried.
package migclient
