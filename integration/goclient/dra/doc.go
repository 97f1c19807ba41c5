// Package dra is the DRA kubelet plugin of hami-mig-sidecar (command cmd/hami-mig-dra): Kubernetes'
// Dynamic Resource Allocation served by the same sidecar that serves HAMi's device plugin, so a
// ResourceClaim gets a warm (IDLE, cached) MIG instance as a pod of HAMi's does, where NVIDIA's DRA
// driver creates one per claim and destroys it at unprepare.
//
// It is built on k8s.io/dynamic-resource-allocation's kubeletplugin helper, which registers with
// kubelet, serves NodePrepareResources and NodeUnprepareResources on dra.sock, fetches each claim
// (refusing one not allocated or replaced) and publishes the ResourceSlices the plugin hands it.
// What the plugin adds:
//
//   - the slices (model.go): one pool per node, counters for each GPU's memory slices, one device
//     per (profile, placement), warm devices of every GPU first, those prepare must refuse tainted;
//   - prepare: one sidecar Allocate per claim, owned by the claim (OWNER_KIND_CLAIM, keyed by its
//     UID), one device per allocation result of this driver; the answer is the CDI device the
//     sidecar wrote. A repeat is ALREADY_ALLOCATED and answers the same. The allocation result
//     names a device of the plugin's own model, which gives the GPU, profile and placement: the
//     device name is never parsed;
//   - unprepare: Release of the claim's UID (kubelet gives no more than UID, namespace and name),
//     which IDLEs its instances for the next claim; with DestroyAtUnprepare they are destroyed
//     (ReclaimIdle of exactly those), NVIDIA's behaviour, for comparison;
//   - recovery (RecoverClaims), at start and after the sidecar restarted: a claim's ACTIVE
//     instance whose claim is gone, replaced or no longer allocated on this node is released. No
//     pod annotation is involved: the sidecar's records name the claim and the API server says
//     whether it still stands. Also when a prepare finds its placement held by another claim's
//     instance (PLACEMENT_BUSY naming a claim): that claim may be gone without its unprepare, and
//     the prepare tries once more after the recovery;
//   - republishing (publish.go) when the sidecar's instances change, at a bounded rate.
//
// One sidecar, two clients. The sidecar's owner kinds keep HAMi's device plugin and this plugin
// apart: HAMi's level-triggered release (SyncActive with its pod list), its Recover and its undo
// see pod owners only, and a claim's Release only that claim's instances, so neither releases the
// other's. An IDLE instance belongs to neither. Two things stay the operator's: the GPUs this plugin
// serves (Options.GPUs) must be left out of HAMi's (its filterdevices setting), since neither
// scheduler sees the other's allocations; and only one client recovers the sidecar after its
// restart: HAMi's plugin, with its pods' allocations, when it runs; this plugin (RecoverSidecar,
// an empty pod list) only when it is the sidecar's only client. Otherwise it waits for the
// recovery.
//
// Health: a critical Xid faults an instance; the sidecar never hands it out again (a faulted IDLE
// instance goes ERROR and is destroyed, a faulted ACTIVE one is destroyed at its release), so its
// device is never warm in the slices. Kubelet reads the device's health from the health service
// (health.go), which the Driver embeds, resolving an instance to its device with ResolveHealth.
package dra
