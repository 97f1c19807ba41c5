// Package annotation parses and writes the pod annotation hami.io/vgpu-mig-allocations, in which
// HAMi's scheduler records each container's MIG reservations and the device plugin adds the
// runtime identity the sidecar returned.
//
// The value is a JSON array:
//
//	[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-…","profile":"1g.10gb",
//	  "placement":{"start":6,"size":1},
//	  "migUUID":"MIG-…","gpuInstanceID":13,"computeInstanceID":0}]
//
// The runtime fields (migUUID, gpuInstanceID, computeInstanceID) are absent until the plugin
// allocated the container, and then all three are present: GI and CI IDs of 0 are real IDs, so
// presence, not value, is what counts. The parser fails closed: a malformed annotation must
// stop a release rather than be read as "this pod holds nothing".
package annotation

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Key is the pod annotation holding the MIG reservations.
const Key = "hami.io/vgpu-mig-allocations"

// Placement is the scheduler's memory-slice range.
type Placement struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

// Allocation is one entry of the annotation: a reservation, plus its runtime identity once the
// device was allocated.
type Allocation struct {
	ContainerIndex    uint32     `json:"containerIndex"`
	DeviceIndex       uint32     `json:"deviceIndex"`
	GPUUUID           string     `json:"gpuUUID"`
	Profile           string     `json:"profile"`
	Placement         *Placement `json:"placement"`
	MigUUID           string     `json:"migUUID,omitempty"`
	GPUInstanceID     *uint32    `json:"gpuInstanceID,omitempty"`
	ComputeInstanceID *uint32    `json:"computeInstanceID,omitempty"`
}

// HasRuntimeIdentity reports whether the entry has been allocated (all three runtime fields).
func (a Allocation) HasRuntimeIdentity() bool {
	return a.MigUUID != "" && a.GPUInstanceID != nil && a.ComputeInstanceID != nil
}

// Pod is what the plugin knows of a pod: its identity, its containers' names in HAMi's order
// (init containers first) and its parsed annotation.
type Pod struct {
	UID            string
	Namespace      string
	Name           string
	ContainerNames []string
	Allocations    []Allocation
}

// ErrInvalid marks every validation failure, so callers can tell a bad annotation from an I/O
// problem with errors.Is.
var ErrInvalid = errors.New("invalid " + Key + " annotation")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// Parse decodes and validates an annotation value. An empty value means no reservations.
// Unknown fields are ignored (newer schedulers may add some); everything the sidecar relies on
// is checked.
func Parse(value string) ([]Allocation, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	var raw []json.RawMessage
	if err := json.Unmarshal([]byte(value), &raw); err != nil {
		return nil, invalid("not a JSON array: %v", err)
	}
	out := make([]Allocation, 0, len(raw))
	seen := make(map[[2]uint32]bool, len(raw))
	for i, r := range raw {
		if bytes.Equal(bytes.TrimSpace(r), []byte("null")) {
			return nil, invalid("entry %d is null", i)
		}
		var a Allocation
		if err := json.Unmarshal(r, &a); err != nil {
			return nil, invalid("entry %d: %v", i, err)
		}
		if err := a.validate(); err != nil {
			return nil, invalid("entry %d (container %d, device %d): %v", i, a.ContainerIndex, a.DeviceIndex, err)
		}
		k := [2]uint32{a.ContainerIndex, a.DeviceIndex}
		if seen[k] {
			return nil, invalid("container %d device %d appears twice", a.ContainerIndex, a.DeviceIndex)
		}
		seen[k] = true
		out = append(out, a)
	}
	return out, nil
}

func (a Allocation) validate() error {
	switch {
	case a.GPUUUID == "":
		return errors.New("gpuUUID is empty")
	case a.Profile == "":
		return errors.New("profile is empty")
	case a.Placement == nil:
		return errors.New("placement is missing")
	case a.Placement.Size == 0:
		return errors.New("placement size is 0")
	}
	n := 0
	if a.MigUUID != "" {
		n++
	}
	if a.GPUInstanceID != nil {
		n++
	}
	if a.ComputeInstanceID != nil {
		n++
	}
	if n != 0 && n != 3 {
		return errors.New("migUUID, gpuInstanceID and computeInstanceID must be all present or all absent")
	}
	if a.MigUUID != "" && !strings.HasPrefix(a.MigUUID, "MIG-") {
		return fmt.Errorf("migUUID %q is not a MIG UUID", a.MigUUID)
	}
	return nil
}

// Encode writes allocations back in a stable order (container, then device).
func Encode(allocs []Allocation) (string, error) {
	sorted := append([]Allocation(nil), allocs...)
	sortAllocations(sorted)
	for i, a := range sorted {
		if err := a.validate(); err != nil {
			return "", invalid("entry %d: %v", i, err)
		}
	}
	b, err := json.Marshal(sorted)
	if err != nil {
		return "", fmt.Errorf("encode %s: %w", Key, err)
	}
	return string(b), nil
}

func sortAllocations(a []Allocation) {
	sort.SliceStable(a, func(i, j int) bool {
		if a[i].ContainerIndex != a[j].ContainerIndex {
			return a[i].ContainerIndex < a[j].ContainerIndex
		}
		return a[i].DeviceIndex < a[j].DeviceIndex
	})
}

// ForContainer returns the container's reservations sorted by device index, the order in which
// the plugin asks the sidecar for them.
func ForContainer(allocs []Allocation, containerIndex uint32) []Allocation {
	var out []Allocation
	for _, a := range allocs {
		if a.ContainerIndex == containerIndex {
			out = append(out, a)
		}
	}
	sortAllocations(out)
	return out
}

// Identity is the runtime identity of one allocated device.
type Identity struct {
	DeviceIndex       uint32
	MigUUID           string
	GPUInstanceID     uint32
	ComputeInstanceID uint32
}

// WithRuntimeIdentity returns a copy of allocs in which the container's entries carry the given
// identities. Every identity must match an entry of that container and every entry of that
// container must get one: a half-annotated container would be adopted wrongly after a restart.
func WithRuntimeIdentity(allocs []Allocation, containerIndex uint32, ids []Identity) ([]Allocation, error) {
	byDev := make(map[uint32]Identity, len(ids))
	for _, id := range ids {
		if id.MigUUID == "" {
			return nil, invalid("device %d: empty MIG UUID", id.DeviceIndex)
		}
		byDev[id.DeviceIndex] = id
	}
	out := append([]Allocation(nil), allocs...)
	used := 0
	for i, a := range out {
		if a.ContainerIndex != containerIndex {
			continue
		}
		id, ok := byDev[a.DeviceIndex]
		if !ok {
			return nil, invalid("container %d device %d: no runtime identity", containerIndex, a.DeviceIndex)
		}
		gi, ci := id.GPUInstanceID, id.ComputeInstanceID
		out[i].MigUUID, out[i].GPUInstanceID, out[i].ComputeInstanceID = id.MigUUID, &gi, &ci
		used++
	}
	if used != len(byDev) {
		return nil, invalid("container %d: %d identities for %d reservations", containerIndex, len(byDev), used)
	}
	return out, nil
}

// ActiveAllocations converts the pod's annotation into the entries the sidecar receives in
// Recover and SyncActive. An entry without runtime identity is a pending reservation (scheduled,
// not yet allocated): it protects its placement from reclaim and the reconciler, so callers pass
// includePending true. False drops them, only for a sidecar older than the 4.1 contract, whose
// Recover refuses entries it cannot verify.
func (p Pod) ActiveAllocations(includePending bool) ([]*pb.ActiveAllocation, error) {
	var out []*pb.ActiveAllocation
	for _, a := range p.Allocations {
		if !a.HasRuntimeIdentity() && !includePending {
			continue
		}
		if int(a.ContainerIndex) >= len(p.ContainerNames) {
			return nil, invalid("pod %s/%s: container index %d but the pod has %d containers",
				p.Namespace, p.Name, a.ContainerIndex, len(p.ContainerNames))
		}
		e := &pb.ActiveAllocation{
			Pod:            &pb.PodRef{Uid: p.UID, Namespace: p.Namespace, Name: p.Name},
			ContainerName:  p.ContainerNames[a.ContainerIndex],
			ContainerIndex: a.ContainerIndex,
			DeviceIndex:    a.DeviceIndex,
			GpuUuid:        a.GPUUUID,
			Profile:        a.Profile,
			Placement:      &pb.Placement{Start: a.Placement.Start, Size: a.Placement.Size},
		}
		if a.HasRuntimeIdentity() {
			e.MigUuid, e.GpuInstanceId, e.ComputeInstanceId = a.MigUUID, *a.GPUInstanceID, *a.ComputeInstanceID
		}
		out = append(out, e)
	}
	return out, nil
}
