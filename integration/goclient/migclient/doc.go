// Package migclient is the client HAMi's device plugin uses to drive hami-mig-sidecar over its
// Unix socket.
//
// The plugin decides placement and knows pods; the sidecar alone touches NVML. This package
// makes that split safe to use from kubelet callbacks:
//
//   - every RPC carries a deadline (kubelet gives Allocate none) and waits for the socket
//     within it, so a restarting sidecar delays a call instead of failing it;
//   - only UNAVAILABLE is retried, with backoff and the identical request, so a retried
//     Allocate keeps its allocation key and converges on the same instance;
//   - errors are *Error values exposing the sidecar's google.rpc.ErrorInfo reason
//     (PLACEMENT_BUSY, NOT_RECOVERED, ...), see IsReason;
//   - a sidecar that restarted answers NOT_RECOVERED; given Options.ListActive the client then
//     calls Recover with the plugin's active allocations and retries the call once;
//   - ReleaseByPodList implements the generation-fenced release (GetInfo, pod list, SyncActive);
//   - answers are checked: a call either returns a complete result or an error, never a
//     partial success.
package migclient
