package migclient

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Allocate realizes the reservations of one container, all or nothing. UNAVAILABLE answers
// (and a connection lost mid-call) are retried with the identical request, so the allocation
// key is the same and a call that already succeeded server-side answers ALREADY_ALLOCATED.
// The result always holds exactly one device per requested device, in request order; any
// other answer is an INVALID_RESPONSE error, never a partial success.
func (c *Client) Allocate(ctx context.Context, req AllocateRequest) (AllocateResult, error) {
	if err := validateAllocate(req); err != nil {
		return AllocateResult{}, err
	}
	pbReq := req.toPB()
	var resp *pb.AllocateResponse
	err := c.withRecovery(ctx, "Allocate", c.opts.AllocateTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Allocate(ctx, pbReq)
		return err
	})
	if err != nil {
		return AllocateResult{}, err
	}
	c.noteGeneration(resp.GetGeneration())
	return allocateResult(req, resp)
}

func validateAllocate(req AllocateRequest) error {
	bad := func(msg string, args ...any) error {
		return newError("Allocate", codes.InvalidArgument, ReasonInvalidRequest, fmt.Sprintf(msg, args...))
	}
	owner := fmt.Sprintf("pod %s container %d", req.Pod.UID, req.ContainerIndex)
	switch {
	case req.Claim != nil && (req.Pod != PodRef{} || req.ContainerName != "" || req.ContainerIndex != 0):
		return bad("both a claim and a pod (or container) are set: the owner is exactly one of them")
	case req.Claim != nil && req.Claim.UID == "":
		return bad("claim UID is empty")
	case req.Claim != nil:
		owner = "claim " + req.Claim.UID
	case req.Pod.UID == "":
		return bad("pod UID is empty")
	}
	if len(req.Devices) == 0 {
		return bad("no devices requested for %s", owner)
	}
	seen := make(map[uint32]bool, len(req.Devices))
	for _, d := range req.Devices {
		if seen[d.DeviceIndex] {
			return bad("device index %d requested twice", d.DeviceIndex)
		}
		seen[d.DeviceIndex] = true
		if d.GPUUUID == "" || d.Profile == "" || d.Placement.Size == 0 {
			return bad("device %d: GPU UUID, profile and a placement of size > 0 are required", d.DeviceIndex)
		}
	}
	return nil
}

// migUUIDPrefix starts every MIG UUID NVML hands out (MIG-<uuid>, and the legacy
// MIG-GPU-<uuid>/<gi>/<ci>), as hami.io/vgpu-mig-allocations requires.
const migUUIDPrefix = "MIG-"

// allocateResult checks that the answer covers every requested device with the requested
// reservation and a complete runtime identity whose MIG UUID is one.
func allocateResult(req AllocateRequest, resp *pb.AllocateResponse) (AllocateResult, error) {
	invalid := func(msg string, args ...any) (AllocateResult, error) {
		return AllocateResult{}, newError("Allocate", codes.Internal, ReasonInvalidResponse, fmt.Sprintf(msg, args...))
	}
	byIndex := make(map[uint32]*pb.AllocatedDevice, len(resp.GetDevices()))
	for _, d := range resp.GetDevices() {
		if _, dup := byIndex[d.GetDeviceIndex()]; dup {
			return invalid("device %d answered twice", d.GetDeviceIndex())
		}
		byIndex[d.GetDeviceIndex()] = d
	}
	if len(byIndex) != len(req.Devices) {
		return invalid("asked for %d devices, got %d", len(req.Devices), len(byIndex))
	}
	out := AllocateResult{Devices: make([]AllocatedDevice, 0, len(req.Devices)), Reclaimed: instanceRefsFromPB(resp.GetReclaimed()),
		DriverCDIDevices: resp.GetDriverCdiDevices()}
	for _, want := range req.Devices {
		got, ok := byIndex[want.DeviceIndex]
		if !ok {
			return invalid("device %d missing from the answer", want.DeviceIndex)
		}
		dev := AllocatedDevice{
			DeviceIndex:       got.GetDeviceIndex(),
			GPUUUID:           got.GetGpuUuid(),
			Profile:           got.GetProfile(),
			Placement:         placementFromPB(got.GetPlacement()),
			MigUUID:           got.GetMigUuid(),
			GPUInstanceID:     got.GetGpuInstanceId(),
			ComputeInstanceID: got.GetComputeInstanceId(),
			CDIDevice:         got.GetCdiDevice(),
			Outcome:           outcomeFromPB(got.GetOutcome()),
		}
		if dev.GPUUUID != want.GPUUUID || dev.Profile != want.Profile || dev.Placement != want.Placement {
			return invalid("device %d: asked for %s %s at %s, got %s %s at %s", want.DeviceIndex,
				want.GPUUUID, want.Profile, want.Placement, dev.GPUUUID, dev.Profile, dev.Placement)
		}
		if dev.MigUUID == "" || dev.Outcome == OutcomeUnspecified {
			return invalid("device %d: answer has no MIG UUID or no outcome", want.DeviceIndex)
		}
		if !strings.HasPrefix(dev.MigUUID, migUUIDPrefix) {
			// The sidecar hands out only MIG-<uuid> (it fails closed on anything else the driver
			// names a new instance); a GPU UUID here would give the container the whole GPU.
			return invalid("device %d: %q is not a MIG UUID (want %s...)", want.DeviceIndex, dev.MigUUID, migUUIDPrefix)
		}
		out.Devices = append(out.Devices, dev)
	}
	return out, nil
}
