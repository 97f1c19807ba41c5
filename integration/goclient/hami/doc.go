// Package hami lets HAMi's NVIDIA device plugin hand its dynamic MIG lifecycle to the sidecar
// with no glue code: Manager has the method set the plugin calls on its in-process
// MigInstanceManager at HAMi v2.10 (PluginManager), and Lazy the set after the lazy-lifecycle rewrite,
// PR #3128 (LazyPluginManager). HAMi declares a small interface over that method set, keeps its
// in-process manager behind it and picks one of the two at startup; docs/porting-hami.md shows
// each changed line.
//
// The method set is HAMi's, names, arguments and results, with go-nvml's
// nvml.GpuInstancePlacement. HAMi's own key and runtime-identity types are unexported, so no
// type outside its package could satisfy an interface that names them; instead HAMi makes
// those names aliases of AllocationKey and RuntimeInfo here, which have its field names and
// types, and its code, the in-process manager's included, compiles unchanged. Two things are
// added: EnsureAllocation's first argument, the Owner of the allocation (the pod, container and
// device HAMi has at that call and the sidecar keys allocations by), and CDIDevice, the CDI
// device name the sidecar wrote for a MIG UUID, which the container must get under the CDI
// device-list strategies instead of one HAMi builds. Every conversion (GPU index to UUID,
// HAMi's values to the contract) happens here. The context is given once, at construction.
//
// Release undoes exactly the device this adapter handed out, with the owner it handed it to, only
// while that owner still holds it (the sidecar's UndoDevice guard), and once per MIG UUID. ReconcileNodePods is what
// HAMi's reconcile calls, through a type assertion, instead of listing the pods itself.
//
// Subpackage kube turns HAMi's pod list (hami.io/vgpu-mig-allocations) into the sidecar's
// active allocations; this package and migclient do not depend on Kubernetes.
//
// Publisher writes the node's idle inventory annotation (register.IdleKey) for HAMi's scheduler
// (package schedule): at the registration loop's period, and within a second of any change of the
// sidecar's instances (background destroys and Xid faults included), at most once a second per
// node. It is advice: stale, it costs at most a create. publish.go says why and how.
package hami
