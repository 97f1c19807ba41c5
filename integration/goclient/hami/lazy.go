package hami

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// Lazy stands in for HAMi's manager after the lazy-lifecycle rewrite (PR #3128, see
// LazyPluginManager). It is a separate type because EnsureAllocation's result differs from v2.10's
// and ResetIdleGPUs is gone; it shares Manager's connection and behaviour otherwise.
type Lazy struct {
	m *Manager
}

// NewLazy is New for the lazy method set.
func NewLazy(ctx context.Context, c *migclient.Client, list migclient.ListActiveFunc) (*Lazy, error) {
	m, err := New(ctx, c, list)
	if err != nil {
		return nil, err
	}
	return &Lazy{m: m}, nil
}

// DialLazy is Dial for the lazy method set.
func DialLazy(ctx context.Context, socket string, opts migclient.Options) (*Lazy, error) {
	m, err := Dial(ctx, socket, opts)
	if err != nil {
		return nil, err
	}
	return &Lazy{m: m}, nil
}

// LazyOver is the lazy method set over an existing adapter (and its connection).
func LazyOver(m *Manager) *Lazy { return &Lazy{m: m} }

// Manager is the v2.10 adapter over the same connection.
func (l *Lazy) Manager() *Manager { return l.m }

// EnsureAllocation answers what the sidecar did: Created, Reused (an IDLE instance at that
// placement), or neither (the owner already held it), and the IDLE instances it destroyed to
// make room. The sidecar removes their records and CDI specs, so HAMi's
// removeReclaimedMIGArtifacts has nothing left to do for them.
func (l *Lazy) EnsureAllocation(owner Owner, gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (AllocationResult, error) {
	d, reclaimed, err := l.m.allocate(owner, gpuIndex, profile, placement)
	if err != nil {
		return AllocationResult{}, err
	}
	return AllocationResult{MigUUID: d.MigUUID, Created: d.Outcome == migclient.OutcomeCreated,
		Reused: d.Outcome == migclient.OutcomeReused, Reclaimed: reclaimed}, nil
}

// MarkIdle is the rollback of a reused instance: Release, which undoes exactly that device for
// owner, the owner EnsureAllocation was given (a reused one goes back IDLE), and nothing when that
// owner no longer holds it. HAMi's MarkIdle returns nothing; a failed undo leaves the instance
// ACTIVE for the failed pod until the reconciler sees the pod's reservation go.
func (l *Lazy) MarkIdle(owner Owner, migUUID string) { _ = l.m.Release(owner, migUUID) }

// Release is Manager.Release.
func (l *Lazy) Release(owner Owner, migUUID string) error { return l.m.Release(owner, migUUID) }

// AllocationRuntimeInfo is Manager.AllocationRuntimeInfo.
func (l *Lazy) AllocationRuntimeInfo(gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (RuntimeInfo, bool) {
	return l.m.AllocationRuntimeInfo(gpuIndex, profile, placement)
}

// AdoptAllocation is Manager.AdoptAllocation.
func (l *Lazy) AdoptAllocation(gpuIndex int, profile, migUUID string, placement nvml.GpuInstancePlacement, gpuInstanceID, computeInstanceID uint32) error {
	return l.m.AdoptAllocation(gpuIndex, profile, migUUID, placement, gpuInstanceID, computeInstanceID)
}

// ReconcileActiveAllocations is Manager.ReconcileActiveAllocations (released instances go
// IDLE, as in the lazy lifecycle; an IDLE one whose pod is back is ACTIVE again).
func (l *Lazy) ReconcileActiveAllocations(active map[AllocationKey]struct{}) error {
	return l.m.ReconcileActiveAllocations(active)
}

// ReconcileNodePods is Manager.ReconcileNodePods.
func (l *Lazy) ReconcileNodePods() error { return l.m.ReconcileNodePods() }

// RetryErrorAllocations reports nothing and changes nothing: the sidecar's own reconciler
// retries the destroy of ERROR instances no live reservation guards, and an Allocate that one
// is in the way of retries it inline.
func (l *Lazy) RetryErrorAllocations(map[AllocationKey]struct{}) ([]string, error) {
	if err := l.m.live(); err != nil {
		return nil, err
	}
	return nil, nil
}

// RestoreAllocations is the startup recovery: the sidecar recovers from the pod list given at
// construction (adopting annotated allocations, restoring its own records IDLE, taking over
// HAMi's ownership records and CDI specs), then MIG mode is enabled on the GPUs not in use.
// owned is not needed: the sidecar reads HAMi's records from the state directory itself.
// adoptExisting is the sidecar's own setting (--adopt-existing); a value different from the
// sidecar's is refused, since unowned instances would be treated otherwise than configured.
func (l *Lazy) RestoreAllocations(deviceCount int, inUse map[int]struct{}, _ map[string]OwnershipRecord, adoptExisting bool) error {
	if err := l.m.live(); err != nil {
		return err
	}
	info, err := l.m.c.EnsureRecovered(l.m.ctx)
	if err != nil {
		return err
	}
	if info.AdoptExisting != adoptExisting {
		return fmt.Errorf("adoptExistingMIGInstances is %t but the sidecar runs with adopt-existing %t: set both alike", adoptExisting, info.AdoptExisting)
	}
	_, err = l.m.enableIdle(deviceCount, inUse)
	return err
}

// DisableIdleGPUs is hami-core mode's startup: MIG off on every GPU not in use, after the
// sidecar destroyed its IDLE instances there (SetMigMode with reclaim_idle). A GPU in use that
// is still in MIG mode fails the pass, as in HAMi; so does one the sidecar refuses (ACTIVE,
// ERROR or foreign instances, processes). A disable that waits for a reset fails it with an
// error wrapping ErrNeedsReset. It returns the GPUs now out of MIG mode, sorted.
func (l *Lazy) DisableIdleGPUs(deviceCount int, inUse map[int]struct{}) ([]int, error) {
	m := l.m
	if err := m.refresh(); err != nil {
		return nil, err
	}
	disabled := []int{}
	for i := 0; i < deviceCount; i++ {
		g, err := m.gpu(i)
		if err != nil {
			return disabled, err
		}
		on := g.MigMode.Current || g.MigMode.Pending
		if _, busy := inUse[i]; busy {
			if on {
				return disabled, fmt.Errorf("gpu %d is in use; cannot disable MIG", i)
			}
			continue
		}
		if on {
			res, err := m.c.SetMigMode(m.ctx, g.UUID, false, migclient.ReclaimIdle())
			if err != nil {
				return disabled, err
			}
			if err := m.refresh(); err != nil {
				return disabled, err
			}
			if g, err = m.gpu(i); err != nil {
				return disabled, err
			}
			switch {
			case !g.MigMode.Current && !g.MigMode.Pending:
			case g.MigMode.Current && !g.MigMode.Pending && res.NeedsReset:
				return disabled, fmt.Errorf("gpu %d: %w", i, ErrNeedsReset)
			default:
				return disabled, fmt.Errorf("gpu %d: MIG mode after disabling it is current=%t pending=%t (the answer said current=%t pending=%t needs_reset=%t)",
					i, g.MigMode.Current, g.MigMode.Pending, res.MigMode.Current, res.MigMode.Pending, res.NeedsReset)
			}
		}
		disabled = append(disabled, i)
	}
	return disabled, nil
}

// DriverCDIDevices is Manager.DriverCDIDevices.
func (l *Lazy) DriverCDIDevices() []string { return l.m.DriverCDIDevices() }

// CDIDevice is Manager.CDIDevice.
func (l *Lazy) CDIDevice(migUUID string) (string, bool) { return l.m.CDIDevice(migUUID) }

// Shutdown is Manager.Shutdown.
func (l *Lazy) Shutdown() { l.m.Shutdown() }
