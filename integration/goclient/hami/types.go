package hami

import (
	"context"
	"errors"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// AllocationKey is HAMi's migAllocationKey: the scheduler's reservation of one MIG device, by
// the parent GPU's NVML index, the full profile name ("1g.10gb") and the placement. HAMi makes
// its own name an alias of this type (type migAllocationKey = hami.AllocationKey), so that the
// same map it builds from pod annotations is the argument of ReconcileActiveAllocations on both
// managers. The field names and types are HAMi's, so its composite literals stay as they are.
type AllocationKey struct {
	GPUIndex int
	Profile  string
	Start    uint32
	Size     uint32
}

// RuntimeInfo is HAMi's migAllocationRuntimeInfo: the identity of a realized reservation, which
// annotateMigRuntimeInfo writes back into the pod (migUUID, gpuInstanceID, computeInstanceID).
// HAMi aliases it as it does AllocationKey.
type RuntimeInfo struct {
	MigUUID   string
	Profile   string
	Placement nvml.GpuInstancePlacement
	GIID      uint32
	CIID      uint32
}

// AllocationResult is migAllocationResult of HAMi's lazy lifecycle (after PR #3128): what one
// EnsureAllocation did. Created and Reused tell the caller's rollback what to undo (Release for
// the first, MarkIdle for the second); Reclaimed lists the MIG UUIDs of idle instances destroyed
// to make room, oldest first. The sidecar removes their records and CDI specs itself.
type AllocationResult struct {
	MigUUID   string
	Created   bool
	Reused    bool
	Reclaimed []string
}

// Owner is the one thing HAMi's manager is not told and the sidecar needs: whose allocation it
// is. The values are HAMi's, as GetContainerDeviceStrArray has them: the pending pod, the
// container's name and index (init containers first), the reservation's device index. Build
// it with kube.Owner from the pod, or directly.
type Owner struct {
	PodUID         string
	PodNamespace   string
	PodName        string
	ContainerName  string
	ContainerIndex int
	DeviceIndex    int
}

// OwnershipPlacement and OwnershipRecord mirror migOwnershipPlacement and migOwnershipRecord of
// HAMi's lazy lifecycle, the record it keeps per instance under /var/run/hami/dynamic-mig-state,
// so that HAMi can alias them and keep the argument list of RestoreAllocations. With the sidecar
// these files are no longer HAMi's to keep: the sidecar takes them over at its recovery (see
// docs/porting-hami.md, "Switching a node from the in-process lifecycle") and writes its own.
type OwnershipPlacement struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

// OwnershipRecord is migOwnershipRecord; see OwnershipPlacement.
type OwnershipRecord struct {
	Version           int                `json:"version"`
	MIGUUID           string             `json:"migUUID"`
	ParentGPUUUID     string             `json:"parentGPUUUID"`
	Profile           string             `json:"profile"`
	Placement         OwnershipPlacement `json:"placement"`
	GPUInstanceID     uint32             `json:"gpuInstanceID"`
	ComputeInstanceID uint32             `json:"computeInstanceID"`
}

// PluginManager is the method set HAMi v2.10's device plugin calls on its MIG manager
// (MigInstanceManager in pkg/device-plugin/nvidiadevice/nvinternal/plugin, release-v2.10), with
// three additions: EnsureAllocation's first argument, the owner, CDIDevice, which the in-process
// manager answers with ("", false), and DriverCDIDevices, which it answers with nil. HAMi declares the same interface over its own
// names (which are aliases of the types above), so Manager and MigInstanceManager both satisfy
// it; docs/porting-hami.md shows it.
type PluginManager interface {
	EnsureAllocation(owner Owner, gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (string, bool, error)
	Release(owner Owner, migUUID string) error
	AllocationRuntimeInfo(gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (RuntimeInfo, bool)
	AdoptAllocation(gpuIndex int, profile, migUUID string, placement nvml.GpuInstancePlacement, gpuInstanceID, computeInstanceID uint32) error
	ReconcileActiveAllocations(active map[AllocationKey]struct{}) error
	ResetIdleGPUs(deviceCount int, inUse map[int]struct{}) ([]int, error)
	CDIDevice(migUUID string) (string, bool)
	DriverCDIDevices() []string
	Shutdown()
}

// LazyPluginManager is the method set of HAMi's manager after the lazy-lifecycle rewrite (PR #3128):
// EnsureAllocation answers an AllocationResult, a failed allocation gives reused instances back
// with MarkIdle, the reconciler also calls RetryErrorAllocations, startup calls
// RestoreAllocations (and DisableIdleGPUs in hami-core mode) instead of ResetIdleGPUs. The
// owner, CDIDevice and DriverCDIDevices are added as in PluginManager. Lazy satisfies it.
type LazyPluginManager interface {
	EnsureAllocation(owner Owner, gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (AllocationResult, error)
	MarkIdle(owner Owner, migUUID string)
	Release(owner Owner, migUUID string) error
	AllocationRuntimeInfo(gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (RuntimeInfo, bool)
	AdoptAllocation(gpuIndex int, profile, migUUID string, placement nvml.GpuInstancePlacement, gpuInstanceID, computeInstanceID uint32) error
	ReconcileActiveAllocations(active map[AllocationKey]struct{}) error
	RetryErrorAllocations(active map[AllocationKey]struct{}) ([]string, error)
	RestoreAllocations(deviceCount int, inUse map[int]struct{}, owned map[string]OwnershipRecord, adoptExisting bool) error
	DisableIdleGPUs(deviceCount int, inUse map[int]struct{}) ([]int, error)
	CDIDevice(migUUID string) (string, bool)
	DriverCDIDevices() []string
	Shutdown()
}

// NodePodsReconciler is the capability HAMi's reconcileActiveMigAllocations asks its manager for
// by name: a manager that has it lists the node's pods itself (it needs their identity), and HAMi
// skips its own list. Manager and Lazy have it; HAMi's in-process manager does not.
type NodePodsReconciler interface {
	ReconcileNodePods() error
}

// IdlePublisher is the capability HAMi's Start asks its manager for by name: a manager that has it
// publishes the node's idle inventory annotation (schedule.IdleKey) for the scheduler while ctx
// lasts, with patch, and removes it when ctx ends. Manager and Lazy have it.
type IdlePublisher interface {
	PublishIdle(ctx context.Context, patch PatchFunc, onError func(error))
}

// The adapters are held to the method sets and capabilities they claim.
var (
	_ PluginManager      = (*Manager)(nil)
	_ LazyPluginManager  = (*Lazy)(nil)
	_ NodePodsReconciler = (*Manager)(nil)
	_ NodePodsReconciler = (*Lazy)(nil)
	_ IdlePublisher      = (*Manager)(nil)
	_ IdlePublisher      = (*Lazy)(nil)
)

// ErrNeedsReset marks a MIG mode change that waits for a GPU reset (HAMi's errMigModeNeedsReset).
var ErrNeedsReset = errors.New("MIG mode change pending: reset the GPU (nvidia-smi --gpu-reset) or reboot the VM")

// ErrNotLive is AdoptAllocation's "annotated MIG allocation is not live".
var ErrNotLive = errors.New("annotated MIG allocation is not live")

// ErrShutdown answers every call after Shutdown.
var ErrShutdown = errors.New("the MIG sidecar adapter is shut down")
