package hami

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// Manager stands in for HAMi v2.10's MigInstanceManager (see PluginManager). It keeps no allocation
// state of its own: the sidecar holds it, so a new Manager over the same sidecar (a restarted
// plugin) answers exactly as the old one would, and a restarted sidecar recovers from the pod
// list given at construction. GPU indexes (HAMi's) are mapped to UUIDs (the sidecar's) through
// ListGpus.
type Manager struct {
	ctx    context.Context
	c      *migclient.Client
	list   migclient.ListActiveFunc
	closes bool // Shutdown closes c (Dial made it)

	mu       sync.Mutex
	gpus     []migclient.GPU
	cdi      map[string]string // MIG UUID -> CDI device name, from the Allocate answers
	driver   []string          // the driver's CDI names, from the last Allocate answer
	seq      uint64
	realized map[AllocationKey]realized
	shutdown bool
	release  func() // called once by Shutdown (NewShared)
}

// realized is the runtime identity one of this adapter's Allocate answers gave for a reservation,
// with the seq of that answer.
type realized struct {
	info RuntimeInfo
	seq  uint64
}

// New builds the adapter over a client. ctx bounds every call the adapter makes (HAMi passes
// the plugin's context); list is the node's fresh pod list as the sidecar's active allocations
// (kube.NodeAllocations builds it from HAMi's pod client), the same callback the client should
// carry as Options.ListActive so that a restarted sidecar recovers. Shutdown leaves c open.
func New(ctx context.Context, c *migclient.Client, list migclient.ListActiveFunc) (*Manager, error) {
	gpus, err := c.ListGpus(ctx)
	if err != nil {
		return nil, err
	}
	return &Manager{ctx: ctx, c: c, list: list, gpus: gpus, cdi: map[string]string{}, realized: map[AllocationKey]realized{}}, nil
}

// NewShared is New for a client other adapters share (kube.Dial keeps one per socket, so a plugin
// restarted in the same process reuses the connection instead of leaking one): Shutdown calls
// release once instead of closing c.
func NewShared(ctx context.Context, c *migclient.Client, list migclient.ListActiveFunc, release func()) (*Manager, error) {
	m, err := New(ctx, c, list)
	if err != nil {
		return nil, err
	}
	m.release = release
	return m, nil
}

// Dial connects to the sidecar at socket and builds the adapter; opts.ListActive is the pod
// list (see New). Shutdown closes the connection.
func Dial(ctx context.Context, socket string, opts migclient.Options) (*Manager, error) {
	c, err := migclient.New(ctx, socket, opts)
	if err != nil {
		return nil, err
	}
	m, err := New(ctx, c, opts.ListActive)
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	m.closes = true
	return m, nil
}

// Client is the sidecar client under the adapter, for what HAMi's method set does not cover.
func (m *Manager) Client() *migclient.Client { return m.c }

func (m *Manager) live() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.shutdown {
		return ErrShutdown
	}
	return nil
}

// gpu maps HAMi's GPU index to the sidecar's GPU, listing the GPUs again when the index is not
// known (a MIG mode change may renumber them).
func (m *Manager) gpu(index int) (migclient.GPU, error) {
	if err := m.live(); err != nil {
		return migclient.GPU{}, err
	}
	for attempt := 0; ; attempt++ {
		m.mu.Lock()
		gpus := m.gpus
		m.mu.Unlock()
		for _, g := range gpus {
			if int(g.Index) == index {
				return g, nil
			}
		}
		if attempt == 1 {
			return migclient.GPU{}, fmt.Errorf("the sidecar lists no GPU with index %d", index)
		}
		fresh, err := m.c.ListGpus(m.ctx)
		if err != nil {
			return migclient.GPU{}, err
		}
		m.mu.Lock()
		m.gpus = fresh
		m.mu.Unlock()
	}
}

func index32(what string, v int) (uint32, error) {
	if v < 0 || v > math.MaxUint32 {
		return 0, fmt.Errorf("%s %d is out of range", what, v)
	}
	return uint32(v), nil
}

// allocate sends one device of the owner's container; the sidecar keys it by (pod, container
// index, device index), so each of HAMi's per-device calls is its own all-or-nothing Allocate.
func (m *Manager) allocate(owner Owner, gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (migclient.AllocatedDevice, []string, error) {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return migclient.AllocatedDevice{}, nil, err
	}
	key, err := deviceOwner(owner)
	if err != nil {
		return migclient.AllocatedDevice{}, nil, err
	}
	res, err := m.c.Allocate(m.ctx, migclient.AllocateRequest{
		Pod:           migclient.PodRef{UID: owner.PodUID, Namespace: owner.PodNamespace, Name: owner.PodName},
		ContainerName: owner.ContainerName, ContainerIndex: key.ContainerIndex,
		Devices: []migclient.DeviceRequest{{DeviceIndex: key.DeviceIndex, GPUUUID: g.UUID, Profile: profile,
			Placement: migclient.Placement{Start: placement.Start, Size: placement.Size}}},
	})
	if err != nil {
		return migclient.AllocatedDevice{}, nil, err
	}
	if len(res.Devices) != 1 {
		return migclient.AllocatedDevice{}, nil, fmt.Errorf("the sidecar answered %d devices for one", len(res.Devices))
	}
	d := res.Devices[0]
	for _, r := range res.Reclaimed {
		m.unrealized(r.MigUUID)
		m.forget(r.MigUUID)
	}
	reservation := AllocationKey{GPUIndex: gpuIndex, Profile: profile, Start: placement.Start, Size: placement.Size}
	m.mu.Lock()
	m.cdi[d.MigUUID] = d.CDIDevice
	m.driver = res.DriverCDIDevices
	m.seq++
	m.realized[reservation] = realized{info: RuntimeInfo{MigUUID: d.MigUUID, Profile: d.Profile, Placement: placement,
		GIID: d.GPUInstanceID, CIID: d.ComputeInstanceID}, seq: m.seq}
	m.mu.Unlock()
	reclaimed := make([]string, 0, len(res.Reclaimed))
	for _, r := range res.Reclaimed {
		reclaimed = append(reclaimed, r.MigUUID)
	}
	return d, reclaimed, nil
}

// forget drops what this adapter keeps of an instance that is gone (destroyed, reclaimed): a
// MIG UUID is never given to another instance.
func (m *Manager) forget(migUUID string) {
	m.mu.Lock()
	delete(m.cdi, migUUID)
	m.mu.Unlock()
}

// unrealized drops the runtime identity this adapter cached for migUUID: the instance is no
// longer the realized reservation of the owner it was handed to (undone, released, reclaimed).
func (m *Manager) unrealized(migUUID string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, r := range m.realized {
		if r.info.MigUUID == migUUID {
			delete(m.realized, k)
		}
	}
}

// EnsureAllocation is MigInstanceManager.EnsureAllocation with the owner added: it realizes
// exactly the reserved profile and placement for that owner and returns the MIG UUID and
// whether this call took the instance, which tells HAMi's deferred rollback to Release it.
// That is true for an instance the sidecar created and for an IDLE one it reused (the rollback
// gives a reused instance back IDLE rather than destroying it); false when the owner already
// held it (a repeated Allocate), so a retry never undoes an allocation that succeeded before.
// Idle instances in the way are reclaimed inside the call.
func (m *Manager) EnsureAllocation(owner Owner, gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (string, bool, error) {
	d, _, err := m.allocate(owner, gpuIndex, profile, placement)
	if err != nil {
		return "", false, err
	}
	return d.MigUUID, d.Outcome != migclient.OutcomeAlreadyAllocated, nil
}

// state is the sidecar's full view, recovered first (a restarted sidecar answers from its
// records only after Recover).
func (m *Manager) state() (*pb.GetStateResponse, error) {
	if err := m.live(); err != nil {
		return nil, err
	}
	if _, err := m.c.EnsureRecovered(m.ctx); err != nil {
		return nil, err
	}
	return m.c.GetState(m.ctx)
}

// find returns the first instance match accepts, nil when none does.
func (m *Manager) find(match func(*pb.Instance) bool) (*pb.Instance, error) {
	st, err := m.state()
	if err != nil {
		return nil, err
	}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if match(in) {
				return in, nil
			}
		}
	}
	return nil, nil
}

// deviceOwner is the sidecar's key of the owner's device: pod UID, container index, device index.
func deviceOwner(owner Owner) (migclient.DeviceOwner, error) {
	container, err := index32("container index", owner.ContainerIndex)
	if err != nil {
		return migclient.DeviceOwner{}, err
	}
	device, err := index32("device index", owner.DeviceIndex)
	if err != nil {
		return migclient.DeviceOwner{}, err
	}
	return migclient.DeviceOwner{PodUID: owner.PodUID, ContainerIndex: container, DeviceIndex: device}, nil
}

// Release is the rollback of an EnsureAllocation that took migUUID for owner, the same owner
// that call was given: it undoes that one device (created: destroyed; reused: IDLE again) only
// while owner still holds it, a guard the sidecar applies under its own locks (UndoDevice). The
// container's other devices stay as they are.
//
// The caller names what it undoes, so the answer never depends on what this adapter, or any
// other, handed out since: a late or repeated Release, after the instance went IDLE and back out
// to another pod, finds that pod holding it and changes nothing; so does one for an instance that
// is IDLE, gone or never known. The adapter keeps no memory of hand-outs to consult. Only the same
// owner's own later hand-out of the same MIG UUID cannot be told apart, and HAMi's deferred
// rollback runs inside the failed Allocate, before kubelet can retry it.
func (m *Manager) Release(owner Owner, migUUID string) error {
	if err := m.live(); err != nil {
		return err
	}
	key, err := deviceOwner(owner)
	if err != nil {
		return err
	}
	done, err := m.c.UndoDevice(m.ctx, migUUID, key)
	if err != nil {
		return err
	}
	if done.Destroyed != nil || done.Idled != nil {
		m.unrealized(migUUID)
	}
	if done.Destroyed != nil {
		m.forget(migUUID)
	}
	return nil
}

func atKey(gpuUUID, profile string, placement nvml.GpuInstancePlacement) func(*pb.Instance) bool {
	return func(in *pb.Instance) bool {
		return in.GetGpuUuid() == gpuUUID && in.GetState() == pb.InstanceState_ACTIVE && in.GetProfile() == profile &&
			in.GetPlacement().GetStart() == placement.Start && in.GetPlacement().GetSize() == placement.Size
	}
}

// WatchFaults calls fn with the MIG UUID and Xid of every owned instance a critical Xid faulted:
// those faulted now first, then each new fault as the sidecar records it, until the adapter's
// context is done (nil) or the stream fails (the error; watch again, and the opening updates
// repeat the faults that stand, so fn may see a MIG UUID twice but misses none). HAMi's health
// loop marks the kubelet device of that MIG UUID unhealthy; the sidecar itself never hands the
// instance out again and destroys it at its release.
func (m *Manager) WatchFaults(fn func(migUUID string, xid uint32)) error {
	if err := m.live(); err != nil {
		return err
	}
	return m.c.WatchHealth(m.ctx, true, func(u migclient.HealthUpdate) {
		if u.Faulted {
			fn(u.MigUUID, u.Xid)
		}
	})
}

// AllocationRuntimeInfo is the ACTIVE instance at exactly that reservation, as the sidecar
// holds it. An error reading it answers false, so annotateMigRuntimeInfo writes nothing it has
// not seen.
func (m *Manager) AllocationRuntimeInfo(gpuIndex int, profile string, placement nvml.GpuInstancePlacement) (RuntimeInfo, bool) {
	key := AllocationKey{GPUIndex: gpuIndex, Profile: profile, Start: placement.Start, Size: placement.Size}
	m.mu.Lock()
	r, ok := m.realized[key]
	m.mu.Unlock()
	if ok {
		return r.info, true
	}
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return RuntimeInfo{}, false
	}
	in, err := m.find(atKey(g.UUID, profile, placement))
	if err != nil || in == nil {
		return RuntimeInfo{}, false
	}
	return RuntimeInfo{MigUUID: in.GetMigUuid(), Profile: in.GetProfile(), Placement: placement,
		GIID: in.GetGpuInstanceId(), CIID: in.GetComputeInstanceId()}, true
}

// AdoptAllocation is the startup check of one annotated allocation. The sidecar adopted the
// node's annotated allocations when it recovered from the pod list; this recovers it if it has
// not yet and checks that it holds exactly that identity ACTIVE (ErrNotLive otherwise).
func (m *Manager) AdoptAllocation(gpuIndex int, profile, migUUID string, placement nvml.GpuInstancePlacement, gpuInstanceID, computeInstanceID uint32) error {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return err
	}
	in, err := m.find(func(in *pb.Instance) bool { return in.GetMigUuid() == migUUID })
	if err != nil {
		return err
	}
	if in == nil || !atKey(g.UUID, profile, placement)(in) || in.GetGpuInstanceId() != gpuInstanceID || in.GetComputeInstanceId() != computeInstanceID {
		return fmt.Errorf("%w: %s profile=%s placement=%d:%d gi=%d ci=%d", ErrNotLive, migUUID, profile, placement.Start, placement.Size, gpuInstanceID, computeInstanceID)
	}
	return nil
}

// ReconcileActiveAllocations releases what no live pod holds. The sidecar needs each
// allocation's owner, which HAMi's key set lacks, so the allocations come from the pod list
// given at construction; active itself is not needed (HAMi calls ReconcileNodePods instead,
// without listing the pods itself). Released instances go IDLE (the sidecar caches them for
// reuse and reclaims them under placement pressure). The pass is fenced by a generation the
// sidecar answered with before the list was taken (migclient.ReleaseWithKnownGeneration), so an
// Allocate racing it is never released, and costs one SyncActive in the steady state.
func (m *Manager) ReconcileActiveAllocations(map[AllocationKey]struct{}) error {
	if err := m.live(); err != nil {
		return err
	}
	if m.list == nil {
		return fmt.Errorf("the MIG sidecar adapter was built without a pod list: nothing released")
	}
	var listed map[string]bool // MIG UUIDs the pods' annotations name, nil until a list succeeded
	var before uint64          // the answers up to this one came before the list
	list := func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		m.mu.Lock()
		before = m.seq
		m.mu.Unlock()
		active, err := m.list(ctx)
		if err == nil {
			listed = map[string]bool{}
			for _, a := range active {
				listed[a.GetMigUuid()] = a.GetMigUuid() != ""
			}
		}
		return active, err
	}
	res, err := m.c.ReleaseWithKnownGeneration(m.ctx, list)
	for _, r := range res.Idled {
		m.unrealized(r.MigUUID)
	}
	if err == nil && listed != nil {
		// Another client (an older plugin's adapter in this process, still reconciling) may have
		// released an instance this adapter allocated without telling it: keep only the runtime
		// identities a live pod's annotation names, or that were answered after the list.
		m.mu.Lock()
		for k, r := range m.realized {
			if r.seq <= before && !listed[r.info.MigUUID] {
				delete(m.realized, k)
			}
		}
		m.mu.Unlock()
	}
	return err
}

// ReconcileNodePods is what HAMi's reconcileActiveMigAllocations calls in place of its own pod
// list when the manager is this adapter: the one list of the node's pods per pass is the
// adapter's (the pod list given at construction), which it needs anyway for the pods' identity,
// so HAMi's API server sees one LIST per pass, as with the in-process manager. The pass is a
// SyncActive fenced by the last generation the sidecar answered with, read before the list: in
// the steady state one sidecar call. See ReconcileActiveAllocations.
func (m *Manager) ReconcileNodePods() error { return m.ReconcileActiveAllocations(nil) }

// ResetIdleGPUs prepares the GPUs no pod and no process uses for on-demand instances: MIG mode
// on, as HAMi's does. Unlike HAMi's, it destroys nothing: the instances on those GPUs are the
// sidecar's IDLE cache (reused by the next matching reservation, reclaimed when one needs the
// slices) or foreign ones it leaves alone, and the sidecar's records, not a fresh start, keep
// them from leaking. A mode change that waits for a GPU reset stops the pass with an error
// wrapping ErrNeedsReset. It returns the prepared GPUs' indexes, sorted.
func (m *Manager) ResetIdleGPUs(deviceCount int, inUse map[int]struct{}) ([]int, error) {
	return m.enableIdle(deviceCount, inUse)
}

func (m *Manager) enableIdle(deviceCount int, inUse map[int]struct{}) ([]int, error) {
	if err := m.live(); err != nil {
		return nil, err
	}
	if err := m.refresh(); err != nil { // the modes now, not those seen at New
		return nil, err
	}
	reset := []int{}
	for i := 0; i < deviceCount; i++ {
		if _, busy := inUse[i]; busy {
			continue
		}
		g, err := m.gpu(i)
		if err != nil {
			return reset, err
		}
		if !g.MigMode.Current || !g.MigMode.Pending {
			res, err := m.c.SetMigMode(m.ctx, g.UUID, true)
			if err != nil {
				return reset, err
			}
			if res.NeedsReset || !res.MigMode.Current || !res.MigMode.Pending {
				return reset, fmt.Errorf("GPU %d: MIG mode current=%t pending=%t: %w", i, res.MigMode.Current, res.MigMode.Pending, ErrNeedsReset)
			}
			if err := m.refresh(); err != nil {
				return reset, err
			}
		}
		reset = append(reset, i)
	}
	sort.Ints(reset)
	return reset, nil
}

func (m *Manager) refresh() error {
	fresh, err := m.c.ListGpus(m.ctx)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.gpus = fresh
	m.mu.Unlock()
	return nil
}

// DriverCDIDevices are the CDI names of the node's driver (its libraries, nvidia-smi, control
// device nodes and hooks) that a container given any of the sidecar's devices needs once beside
// their CDIDevice names: an instance's spec holds its device nodes only, and HAMi's mig mode under
// a CDI strategy returns before any mount or env strategy. They come with every Allocate answer, so
// the EnsureAllocation calls of HAMi's Allocate have brought them before updateResponseForCDI asks.
// Empty from a sidecar that publishes no driver spec; the in-process manager answers nil.
func (m *Manager) DriverCDIDevices() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.driver)
}

// CDIDevice is the CDI device name the sidecar wrote for migUUID, for the container under the
// CDI device-list strategies in place of the name HAMi would build (cdiHandler.QualifiedName),
// which names no spec the sidecar wrote. The in-process manager answers ("", false).
func (m *Manager) CDIDevice(migUUID string) (string, bool) {
	m.mu.Lock()
	name, ok := m.cdi[migUUID]
	m.mu.Unlock()
	if ok && name != "" {
		return name, true
	}
	in, err := m.find(func(in *pb.Instance) bool { return in.GetMigUuid() == migUUID })
	if err != nil || in == nil || in.GetCdiDevice() == "" {
		return "", false
	}
	return in.GetCdiDevice(), true
}

// Shutdown ends the adapter: later calls fail with ErrShutdown, and the connection is closed
// when Dial opened it. Nothing on the GPUs changes: the sidecar keeps every instance, which is
// what lets the next plugin find them.
func (m *Manager) Shutdown() {
	m.mu.Lock()
	already := m.shutdown
	m.shutdown = true
	m.mu.Unlock()
	if already {
		return
	}
	if m.release != nil {
		m.release()
	}
	if m.closes {
		_ = m.c.Close()
	}
}

// DiscoverProfiles is not part of HAMi's manager (its discoverMigProfiles asks NVML itself):
// the profiles to publish in hami.io/node-nvidia-register, placements ordered by
// register.OrderProfiles (reuse first), and the largest instance count.
func (m *Manager) DiscoverProfiles(gpuIndex int, allowed []string) ([]register.MigProfile, uint32, error) {
	g, err := m.gpu(gpuIndex)
	if err != nil {
		return nil, 0, err
	}
	profiles, err := m.c.DiscoverProfiles(m.ctx, g.UUID, allowed)
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
	ordered, _ := register.OrderProfiles(m.ctx, m.c, g.UUID, out, register.BlockedLast)
	return ordered, count, nil
}
