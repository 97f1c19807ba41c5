package migclient

import (
	"fmt"
	"time"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Placement is a range of memory slices [Start, Start+Size) chosen by the scheduler.
type Placement struct {
	Start uint32
	Size  uint32
}

func (p Placement) String() string { return fmt.Sprintf("%d:%d", p.Start, p.Size) }

// Overlaps reports whether p and q share a memory slice (two GPU instances never may).
func (p Placement) Overlaps(q Placement) bool {
	return p.Start < q.Start+q.Size && q.Start < p.Start+p.Size
}

// PodRef names the pod that holds an allocation.
type PodRef struct {
	UID       string
	Namespace string
	Name      string
}

// ClaimRef names the DRA ResourceClaim that holds an allocation (a DRA kubelet plugin's owner).
type ClaimRef struct {
	UID       string
	Namespace string
	Name      string
}

// DeviceRequest is one scheduler reservation of a container: exactly this GPU, profile and
// placement, or nothing.
type DeviceRequest struct {
	DeviceIndex uint32
	GPUUUID     string
	Profile     string
	Placement   Placement
	// Request is, with AllocateRequest.Claim, the claim's request this device answers, as the
	// allocation result names it ("gpu", or "gpu/small" for a firstAvailable subrequest).
	Request string
}

// AllocateRequest asks for every device of one container, or of one claim. The allocation key
// of each device is (Pod.UID, ContainerIndex, DeviceIndex), or (Claim.UID, DeviceIndex) when
// Claim is set; repeating the request converges on the same instances.
type AllocateRequest struct {
	Pod            PodRef
	ContainerName  string
	ContainerIndex uint32
	Devices        []DeviceRequest
	// Claim, set instead of Pod (and ContainerName, ContainerIndex), makes the claim the owner:
	// a DRA kubelet plugin's Allocate. A pod's release never touches its instances.
	Claim *ClaimRef
}

// Outcome says how the sidecar satisfied one device.
type Outcome int

const (
	// OutcomeUnspecified is the zero value: the sidecar gave no outcome.
	OutcomeUnspecified Outcome = iota
	// OutcomeCreated means a new GI/CI was created.
	OutcomeCreated
	// OutcomeReused means an IDLE instance with exactly this reservation became ACTIVE again.
	OutcomeReused
	// OutcomeAlreadyAllocated means the key was already ACTIVE with this reservation (a retry).
	OutcomeAlreadyAllocated
)

func (o Outcome) String() string {
	switch o {
	case OutcomeCreated:
		return "CREATED"
	case OutcomeReused:
		return "REUSED"
	case OutcomeAlreadyAllocated:
		return "ALREADY_ALLOCATED"
	default:
		return "UNSPECIFIED"
	}
}

// AllocatedDevice is the runtime identity of one allocated device. MigUUID, GPUInstanceID and
// ComputeInstanceID go into the pod annotation; CDIDevice (empty with CDI disabled) or MigUUID
// go into the container.
type AllocatedDevice struct {
	DeviceIndex       uint32
	GPUUUID           string
	Profile           string
	Placement         Placement
	MigUUID           string
	GPUInstanceID     uint32
	ComputeInstanceID uint32
	CDIDevice         string
	Outcome           Outcome
}

// InstanceRef identifies one instance: what should exist and what does.
type InstanceRef struct {
	GPUUUID           string
	Profile           string
	Placement         Placement
	MigUUID           string
	GPUInstanceID     uint32
	ComputeInstanceID uint32
}

// AllocateResult is a complete answer: one device per requested device, in request order.
type AllocateResult struct {
	Devices []AllocatedDevice
	// Reclaimed lists IDLE instances destroyed because they overlapped a requested placement.
	Reclaimed []InstanceRef
	// DriverCDIDevices are the CDI names the container needs once beside the devices' CDIDevice:
	// the node's driver (libraries, binaries, control device nodes, hooks). Empty when the sidecar
	// publishes no driver spec (CDI disabled, or a sidecar that predates it).
	DriverCDIDevices []string
}

// SyncResult reports what a SyncActive changed.
type SyncResult struct {
	Generation  uint64
	Idled       []InstanceRef
	Reactivated []InstanceRef
}

// RecoverReport is the sidecar's account of a startup recovery.
type RecoverReport struct {
	AdoptedActive       []InstanceRef
	RestoredIdle        []InstanceRef
	PreservedForeign    []InstanceRef
	AdoptedForeign      []InstanceRef
	RemovedOrphanGIs    []InstanceRef
	DroppedStaleRecords []string
	Errors              []string
}

// Info is the identity and state of the running sidecar.
type Info struct {
	APIVersion     string
	SidecarVersion string
	Backend        string
	BootID         string
	Recovered      bool
	CDIEnabled     bool
	AdoptExisting  bool
	Generation     uint64
	// Revision moves with every change of the owned instances, those that move no Generation
	// included (a trim, a ReclaimIdle, the reconciler's destroys, an Xid fault); 0 from a sidecar
	// that predates it. It restarts with the sidecar.
	Revision  uint64
	StartedAt time.Time
}

// incarnation identifies one run of the sidecar process: a new boot or a new start time means
// the sidecar restarted and lost everything it held only in memory.
type incarnation struct {
	bootID    string
	startedAt time.Time
}

func (i Info) incarnation() incarnation { return incarnation{bootID: i.BootID, startedAt: i.StartedAt} }

// MigMode is a GPU's MIG mode; Pending differs from Current until the GPU is reset.
type MigMode struct {
	Current bool
	Pending bool
}

// GPU is one physical GPU of the node.
type GPU struct {
	Index    uint32
	UUID     string
	Minor    uint32
	Model    string
	MemoryMB uint64
	MigMode  MigMode
	Busy     bool
}

// Profile is one GPU instance profile as HAMi publishes it in hami.io/node-nvidia-register.
type Profile struct {
	Name          string
	GIProfileID   uint32
	CIProfileID   uint32
	SliceCount    uint32
	MemoryMB      uint64
	CorePercent   uint32
	InstanceCount uint32
	Placements    []Placement
}

// SetMigModeResult is the MIG mode after a SetMigMode call.
type SetMigModeResult struct {
	MigMode    MigMode
	NeedsReset bool
}

func placementFromPB(p *pb.Placement) Placement {
	return Placement{Start: p.GetStart(), Size: p.GetSize()}
}

func (p Placement) toPB() *pb.Placement { return &pb.Placement{Start: p.Start, Size: p.Size} }

func instanceRefsFromPB(refs []*pb.InstanceRef) []InstanceRef {
	out := make([]InstanceRef, 0, len(refs))
	for _, r := range refs {
		out = append(out, InstanceRef{
			GPUUUID:           r.GetGpuUuid(),
			Profile:           r.GetProfile(),
			Placement:         placementFromPB(r.GetPlacement()),
			MigUUID:           r.GetMigUuid(),
			GPUInstanceID:     r.GetGpuInstanceId(),
			ComputeInstanceID: r.GetComputeInstanceId(),
		})
	}
	return out
}

func (r AllocateRequest) toPB() *pb.AllocateRequest {
	devs := make([]*pb.DeviceRequest, 0, len(r.Devices))
	for _, d := range r.Devices {
		devs = append(devs, &pb.DeviceRequest{
			DeviceIndex: d.DeviceIndex,
			GpuUuid:     d.GPUUUID,
			Profile:     d.Profile,
			Placement:   d.Placement.toPB(),
			Request:     d.Request,
		})
	}
	if r.Claim != nil {
		return &pb.AllocateRequest{
			Claim:   &pb.ClaimRef{Uid: r.Claim.UID, Namespace: r.Claim.Namespace, Name: r.Claim.Name},
			Devices: devs,
		}
	}
	return &pb.AllocateRequest{
		Pod:            &pb.PodRef{Uid: r.Pod.UID, Namespace: r.Pod.Namespace, Name: r.Pod.Name},
		ContainerName:  r.ContainerName,
		ContainerIndex: r.ContainerIndex,
		Devices:        devs,
	}
}

func outcomeFromPB(o pb.Outcome) Outcome {
	switch o {
	case pb.Outcome_CREATED:
		return OutcomeCreated
	case pb.Outcome_REUSED:
		return OutcomeReused
	case pb.Outcome_ALREADY_ALLOCATED:
		return OutcomeAlreadyAllocated
	default:
		return OutcomeUnspecified
	}
}

func infoFromPB(r *pb.GetInfoResponse) Info {
	var started time.Time
	if r.GetStartedAt() != nil {
		started = r.GetStartedAt().AsTime()
	}
	return Info{
		APIVersion:     r.GetApiVersion(),
		SidecarVersion: r.GetSidecarVersion(),
		Backend:        r.GetBackend(),
		BootID:         r.GetBootId(),
		Recovered:      r.GetRecovered(),
		CDIEnabled:     r.GetCdiEnabled(),
		AdoptExisting:  r.GetAdoptExisting(),
		Generation:     r.GetGeneration(),
		Revision:       r.GetRevision(),
		StartedAt:      started,
	}
}

func recoverReportFromPB(r *pb.RecoverResponse) RecoverReport {
	return RecoverReport{
		AdoptedActive:       instanceRefsFromPB(r.GetAdoptedActive()),
		RestoredIdle:        instanceRefsFromPB(r.GetRestoredIdle()),
		PreservedForeign:    instanceRefsFromPB(r.GetPreservedForeign()),
		AdoptedForeign:      instanceRefsFromPB(r.GetAdoptedForeign()),
		RemovedOrphanGIs:    instanceRefsFromPB(r.GetRemovedOrphanGis()),
		DroppedStaleRecords: r.GetDroppedStaleRecords(),
		Errors:              r.GetErrors(),
	}
}

func migModeFromPB(m *pb.MigMode) MigMode {
	return MigMode{Current: m.GetCurrent(), Pending: m.GetPending()}
}

// MarshalText writes the contract's name (CREATED, REUSED, ...), for logs and JSON output.
func (o Outcome) MarshalText() ([]byte, error) { return []byte(o.String()), nil }
