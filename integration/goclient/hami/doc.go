// Package hami gives HAMi's NVIDIA device plugin the method set of its in-process MIG manager
// (MigInstanceManager in pkg/device-plugin/nvidiadevice/nvinternal/plugin) on top of the
// sidecar, so that porting the plugin is a swap of the manager's type plus the few extra
// arguments the sidecar needs (the pod and container an allocation belongs to, a context).
//
// HAMi's types are mirrored here (Placement, AllocationResult, RuntimeInfo, ...) rather than
// imported: its module is not published where this one is built. Each method's comment names
// the HAMi call site it replaces and what changes there.
//
// The one rule every call site must keep: the container gets the CDI device name the sidecar
// returned (AllocationResult.CDIDevice), never one the plugin builds itself. The sidecar wrote
// that spec; a name derived by the plugin may point at a file that does not exist, or at one
// the sidecar no longer owns.
package hami
