package hami

import (
	"context"
	"errors"
	"fmt"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// Placement mirrors nvml.GpuInstancePlacement as HAMi's manager takes it.
type Placement struct {
	Start uint32
	Size  uint32
}

// Owner is what HAMi's manager does not receive and the sidecar needs: the allocation key's
// pod and container. HAMi has it at Allocate time (getPendingPod, the container index with
// init containers first).
type Owner struct {
	PodUID         string
	Namespace      string
	Name           string
	ContainerName  string
	ContainerIndex uint32
}

// Reservation is one device of a container as the scheduler reserved it.
type Reservation struct {
	DeviceIndex uint32
	GPUIndex    int
	Profile     string
	Placement   Placement
}

// AllocationResult mirrors HAMi's migAllocationResult, plus the runtime identity and the CDI
// device name the sidecar returns.
type AllocationResult struct {
	MigUUID   string
	GIID      uint32
	CIID      uint32
	CDIDevice string // use this in the container; never build a name (see the package doc)
	Created   bool
	Reused    bool
	Reclaimed []string
}

// RuntimeInfo mirrors HAMi's migAllocationRuntimeInfo.
type RuntimeInfo struct {
	MigUUID   string
	Profile   string
	Placement Placement
	GIID      uint32
	CIID      uint32
}

// ErrNeedsReset marks a MIG mode change that waits for a GPU reset (HAMi's errMigModeNeedsReset).
var ErrNeedsReset = errors.New("MIG mode change pending: reset the GPU (nvidia-smi --gpu-reset) or reboot the VM")

// ErrNotLive is AdoptAllocation's "annotated MIG allocation is not live".
var ErrNotLive = errors.New("annotated MIG allocation is not live")

// Manager replaces MigInstanceManager. GPU indexes are resolved through ListGpus once, at New:
// HAMi's manager speaks indexes, the sidecar UUIDs.
type Manager struct {
	c    *migclient.Client
	gpus []migclient.GPU
}

// New replaces NewMigInstanceManager + Init. The client should carry Options.ListActive (the
// node's fresh pod list, pending reservations included) so that a restarted sidecar recovers.
func New(ctx context.Context, c *migclient.Client) (*Manager, error) {
	gpus, err := c.ListGpus(ctx)
	if err != nil {
		return nil, err
	}
	return &Manager{c: c, gpus: gpus}, nil
}

func (m *Manager) gpu(index int) (migclient.GPU, error) {
	for _, g := range m.gpus {
		if int(g.Index) == index {
			return g, nil
		}
	}
	return migclient.GPU{}, fmt.Errorf("no GPU with index %d", index)
}

// EnsureContainer replaces the per-device EnsureAllocation loop of GetContainerDeviceStrArray:
// one Allocate for every device of the container, all or nothing, so a failure on a later
// device leaves nothing of the earlier ones (HAMi's deferred rollback is not needed for it).
func (m *Manager) EnsureContainer(ctx context.Context, owner Owner, devices []Reservation) ([]AllocationResult, error) {
	req := migclient.AllocateRequest{
		Pod:           migclient.PodRef{UID: owner.PodUID, Namespace: owner.Namespace, Name: owner.Name},
		ContainerName: owner.ContainerName, ContainerIndex: owner.ContainerIndex,
	}
	for _, d := range devices {
		g, err := m.gpu(d.GPUIndex)
		if err != nil {
			return nil, err
		}
		req.Devices = append(req.Devices, migclient.DeviceRequest{DeviceIndex: d.DeviceIndex, GPUUUID: g.UUID,
			Profile: d.Profile, Placement: migclient.Placement{Start: d.Placement.Start, Size: d.Placement.Size}})
	}
	res, err := m.c.Allocate(ctx, req)
	if err != nil {
		return nil, err
	}
	reclaimed := make([]string, 0, len(res.Reclaimed))
	for _, r := range res.Reclaimed {
		reclaimed = append(reclaimed, r.MigUUID)
	}
	out := make([]AllocationResult, 0, len(res.Devices))
	for i, d := range res.Devices {
		r := AllocationResult{MigUUID: d.MigUUID, GIID: d.GPUInstanceID, CIID: d.ComputeInstanceID, CDIDevice: d.CDIDevice,
			Created: d.Outcome == migclient.OutcomeCreated, Reused: d.Outcome == migclient.OutcomeReused}
		if i == 0 {
			r.Reclaimed = reclaimed // the answer lists reclaims per request, not per device
		}
		out = append(out, r)
	}
	return out, nil
}

// EnsureAllocation replaces MigInstanceManager.EnsureAllocation(gpuIndex, profile, placement)
// for a container with one device; prefer EnsureContainer for several. Reclaims happen inside
// the sidecar; HAMi's removeReclaimedMIGArtifacts and persistMIGOwnership calls go away (the
// sidecar owns records and CDI specs), as does its EnsureDynamicMIGDevice call.
func (m *Manager) EnsureAllocation(ctx context.Context, owner Owner, deviceIndex uint32, gpuIndex int, profile string, placement Placement) (AllocationResult, error) {
	res, err := m.EnsureContainer(ctx, owner, []Reservation{{DeviceIndex: deviceIndex, GPUIndex: gpuIndex, Profile: profile, Placement: placement}})
	if err != nil {
		return AllocationResult{}, err
	}
	return res[0], nil
}

// UndoContainer replaces the deferred rollback of GetContainerDeviceStrArray after a later
// step failed (annotateMigRuntimeInfo, the kubelet answer): HAMi calls Release for what it
// created and MarkIdle for what it reused; the sidecar remembers which and does both in one
// UndoAllocate.
func (m *Manager) UndoContainer(ctx context.Context, owner Owner) (migclient.UndoResult, error) {
	return m.c.UndoAllocate(ctx, owner.PodUID, owner.ContainerIndex)
}

// MarkIdle replaces MigInstanceManager.MarkIdle(migUUID) in the rollback; it undoes the whole
// container (see UndoContainer), so calling it and Release for the same container is harmless.
func (m *Manager) MarkIdle(ctx context.Context, owner Owner) error {
	_, err := m.UndoContainer(ctx, owner)
	return err
}

// Release replaces MigInstanceManager.Release(migUUID) in the rollback (see MarkIdle).
func (m *Manager) Release(ctx context.Context, owner Owner) error {
	_, err := m.UndoContainer(ctx, owner)
	return err
}

// AllocationRuntimeInfo replaces MigInstanceManager.AllocationRuntimeInfo: the ACTIVE instance
// at exactly that reservation, from GetState.
func (m *Manager) AllocationRuntimeInfo(ctx context.Context, gpuIndex int, profile string, placement Placement) (RuntimeInfo, bool, error) {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return RuntimeInfo{}, false, err
	}
	in, err := m.find(ctx, g.UUID, func(in *pb.Instance) bool {
		return in.GetState() == pb.InstanceState_ACTIVE && in.GetProfile() == profile &&
			in.GetPlacement().GetStart() == placement.Start && in.GetPlacement().GetSize() == placement.Size
	})
	if err != nil || in == nil {
		return RuntimeInfo{}, false, err
	}
	return RuntimeInfo{MigUUID: in.GetMigUuid(), Profile: in.GetProfile(), Placement: placement,
		GIID: in.GetGpuInstanceId(), CIID: in.GetComputeInstanceId()}, true, nil
}

func (m *Manager) find(ctx context.Context, gpuUUID string, match func(*pb.Instance) bool) (*pb.Instance, error) {
	st, err := m.c.GetState(ctx)
	if err != nil {
		return nil, err
	}
	for _, g := range st.GetGpus() {
		if g.GetGpu().GetUuid() != gpuUUID {
			continue
		}
		for _, in := range g.GetInstances() {
			if match(in) {
				return in, nil
			}
		}
	}
	return nil, nil
}

// ReconcileActiveAllocations replaces the reconciler's ReconcileActiveAllocations(active): the
// generation-fenced release by pod list. list must return the node's fresh pod list, pending
// reservations included, and fail rather than return part of it.
func (m *Manager) ReconcileActiveAllocations(ctx context.Context, list migclient.ListActiveFunc) (migclient.SyncResult, error) {
	return m.c.ReleaseByPodList(ctx, list)
}

// RetryErrorAllocations replaces the reconciler's RetryErrorAllocations: a no-op, because the
// sidecar's own reconciler retries the destroy of ERROR instances, and an Allocate blocked by
// one retries it inline.
func (m *Manager) RetryErrorAllocations(context.Context) error { return nil }

// RestoreAllocations replaces the startup sequence primeMigManagerFromAnnotations +
// ownership.Load + RestoreAllocations + persistTrackedMIGOwnership + ReplaceDynamicMIGDevices:
// the sidecar's Recover does all of it with the client's ListActive, before Allocate is served.
func (m *Manager) RestoreAllocations(ctx context.Context) (migclient.Info, error) {
	return m.c.EnsureRecovered(ctx)
}

// AdoptAllocation replaces MigInstanceManager.AdoptAllocation for one annotated allocation:
// adoption itself happened in Recover, so this only checks that the sidecar holds that
// identity ACTIVE (ErrNotLive otherwise), which is what HAMi's startup relied on it to verify.
func (m *Manager) AdoptAllocation(ctx context.Context, gpuIndex int, profile, migUUID string, placement Placement, giID, ciID uint32) error {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return err
	}
	in, err := m.find(ctx, g.UUID, func(in *pb.Instance) bool { return in.GetMigUuid() == migUUID })
	if err != nil {
		return err
	}
	if in == nil || in.GetState() != pb.InstanceState_ACTIVE || in.GetProfile() != profile ||
		in.GetPlacement().GetStart() != placement.Start || in.GetPlacement().GetSize() != placement.Size ||
		in.GetGpuInstanceId() != giID || in.GetComputeInstanceId() != ciID {
		return fmt.Errorf("%w: %s profile=%s placement=%d:%d gi=%d ci=%d", ErrNotLive, migUUID, profile, placement.Start, placement.Size, giID, ciID)
	}
	return nil
}

// DisableIdleGPUs replaces applyStartupMigMode's DisableIdleGPUs in hami-core mode: for each GPU
// not in inUse whose MIG mode is on (or pending on), SetMigMode(enabled=false, reclaim_idle=true),
// then the GPU's mode read back from ListGpus. It returns the indexes of the GPUs whose MIG mode
// is now off. A GPU with ACTIVE, ERROR or foreign instances or processes is refused by the
// sidecar and stops the pass with its error. A disable that waits for a reset (pending off,
// needs_reset) stops it with an error wrapping ErrNeedsReset, as HAMi's errMigModeNeedsReset; a
// GPU whose mode reads back as anything else stops it with an error saying what it read.
func (m *Manager) DisableIdleGPUs(ctx context.Context, inUse map[int]struct{}) ([]int, error) {
	gpus, err := m.c.ListGpus(ctx) // the modes now, not those seen at New
	if err != nil {
		return nil, err
	}
	var done []int
	for _, g := range gpus {
		if _, busy := inUse[int(g.Index)]; busy || !g.MigMode.Current && !g.MigMode.Pending {
			continue
		}
		res, err := m.c.SetMigMode(ctx, g.UUID, false, migclient.ReclaimIdle())
		if err != nil {
			return done, err
		}
		mode, err := m.migMode(ctx, g.UUID)
		if err != nil {
			return done, err
		}
		switch {
		case !mode.Current && !mode.Pending:
			done = append(done, int(g.Index))
		case mode.Current && !mode.Pending && res.NeedsReset:
			return done, fmt.Errorf("GPU %d: %w", g.Index, ErrNeedsReset)
		default:
			return done, fmt.Errorf("GPU %d: MIG mode after disabling it is current=%t pending=%t (the answer said current=%t pending=%t needs_reset=%t)",
				g.Index, mode.Current, mode.Pending, res.MigMode.Current, res.MigMode.Pending, res.NeedsReset)
		}
	}
	return done, nil
}

// migMode reads one GPU's MIG mode back from ListGpus.
func (m *Manager) migMode(ctx context.Context, gpuUUID string) (migclient.MigMode, error) {
	gpus, err := m.c.ListGpus(ctx)
	if err != nil {
		return migclient.MigMode{}, err
	}
	for _, g := range gpus {
		if g.UUID == gpuUUID {
			return g.MigMode, nil
		}
	}
	return migclient.MigMode{}, fmt.Errorf("GPU %s is no longer listed by the sidecar", gpuUUID)
}

// EnsureMigModeEnabled replaces ensureMigModeEnabled(gpuIndex) before a create: the sidecar
// refuses an Allocate on a GPU with MIG off (MIG_DISABLED), so the plugin enables it at startup
// in mig mode with this instead of on every create.
func (m *Manager) EnsureMigModeEnabled(ctx context.Context, gpuIndex int) error {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return err
	}
	res, err := m.c.SetMigMode(ctx, g.UUID, true)
	if err != nil {
		return err
	}
	if res.NeedsReset || !res.MigMode.Current {
		return fmt.Errorf("GPU %d: %w", gpuIndex, ErrNeedsReset)
	}
	return nil
}

// DiscoverProfiles replaces discoverMigProfiles: the profiles to publish in
// hami.io/node-nvidia-register, with their placements ordered by RankPlacements (reuse first),
// and the instance count HAMi keeps plugin-side. A ranking that fails keeps the sidecar's order.
func (m *Manager) DiscoverProfiles(ctx context.Context, gpuIndex int, allowed []string) ([]register.MigProfile, uint32, error) {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return nil, 0, err
	}
	profiles, err := m.c.DiscoverProfiles(ctx, g.UUID, allowed)
	if err != nil {
		return nil, 0, err
	}
	out := make([]register.MigProfile, 0, len(profiles))
	var count uint32
	for _, p := range profiles {
		mp := register.MigProfile{Name: p.Name, MemoryMB: p.MemoryMB, Core: p.CorePercent, SliceCount: p.SliceCount}
		for _, pl := range p.Placements {
			mp.Placements = append(mp.Placements, register.Placement{Start: pl.Start, Size: pl.Size})
		}
		out = append(out, mp)
		count = max(count, p.InstanceCount)
	}
	ordered, _ := register.OrderProfiles(ctx, m.c, g.UUID, out, register.BlockedLast)
	return ordered, count, nil
}
