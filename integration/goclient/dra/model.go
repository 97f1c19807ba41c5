package dra

import (
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// The slice model: what the plugin publishes for each GPU it serves, and how it reads an
// allocation result back.
//
// One pool per GPU, named PoolName(node, index), of two slices: the first holds only the shared
// counters of counter set "gpu<index>" (the API server refuses counters and devices in one
// slice), one counter per memory slice ("memory-slice-<k>", value 1; names may not hold dots),
// plus one for the profiles NVML allows fewer instances of than they have placements
// (instanceCounter). The slices after it hold one device per (profile, placement) DiscoverProfiles
// lists, named DeviceName(index, profile, start), each consuming the memory slices its placement
// covers (and its profile's instance counter) in one consumesCounters entry: two devices whose
// placements overlap can never both be allocated, which is exactly NVML's rule, so the scheduler
// never hands out a placement the sidecar must refuse. At most MaxDevicesPerSlice devices per
// slice, the server's limit for devices that consume counters.
//
// Warm devices come first: the scheduler takes the first device that fits, in slice order and
// then device order, so a claim lands on a cached IDLE instance (REUSE: no create) whenever one
// of its profile is free on the GPU it tries. Then the cold devices no IDLE instance overlaps,
// then those over one (rank), so a claim missing the cache does not destroy a cached instance
// while a free placement is left. It tries the pools by name, one GPU after the other
// (gpu0 before gpu1), so the order alone prefers a warm device only within one GPU: a claim that
// should take a warm instance on any GPU before a cold one on the first asks for it with a
// firstAvailable list whose first subrequest selects the attribute "warm". A device is warm when
// an IDLE, healthy instance of exactly its profile sits exactly at its placement (WarmFromState);
// a FAULTED instance is never warm (the sidecar turns a faulted IDLE instance ERROR and destroys
// it), so no slice invites a claim onto it.

// MaxDevicesPerSlice is the API server's limit on counter-consuming devices in one ResourceSlice
// (resource.k8s.io/v1 ResourceSliceMaxDevicesWithAdvancedFeatures).
const MaxDevicesPerSlice = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures

// The attributes (in the driver's domain) and the capacity of every device.
const (
	AttrProfile        = "profile"
	AttrGPUUUID        = "gpuUUID"
	AttrPlacementStart = "placementStart"
	AttrPlacementSize  = "placementSize"
	AttrWarm           = "warm"
	CapacityMemory     = "memory"
)

// GPU is one GPU the plugin serves: its index and UUID as the sidecar lists them and the
// profiles DiscoverProfiles answered for it.
type GPU struct {
	Index    uint32
	UUID     string
	Profiles []migclient.Profile
}

// Device is one (GPU, profile, placement) the plugin publishes.
type Device struct {
	Pool, Name  string
	GPUIndex    uint32
	GPUUUID     string
	Profile     string
	Placement   migclient.Placement
	MemoryBytes uint64
	Warm        bool
	counters    []string // the counters of the GPU's set it consumes
}

// Placed is a profile at a placement on one GPU, the key of the warm set.
type Placed struct {
	GPUUUID   string
	Profile   string
	Placement migclient.Placement
}

// Model is the published view of the GPUs: the pools and devices in publishing order, and the
// lookup of an allocation result's (pool, device) pair.
type Model struct {
	node    string
	pools   map[string][]Device // by pool name, in rank order (warm first)
	sets    map[string]resourceapi.CounterSet
	byName  map[[2]string]Device
	gpuByID map[string]uint32 // GPU UUID -> index
}

// PoolName is the pool of one GPU of a node.
func PoolName(node string, gpuIndex uint32) string { return fmt.Sprintf("%s-gpu%d", node, gpuIndex) }

// DeviceName is the device of a profile at a placement start on GPU gpuIndex: "." and "+" of
// the profile become "-" (a device name is a DNS label), e.g. gpu0-1g-10gb-me-at3.
func DeviceName(gpuIndex uint32, profile string, start uint32) string {
	return fmt.Sprintf("gpu%d-%s-at%d", gpuIndex, labelOf(profile), start)
}

func labelOf(profile string) string { return strings.NewReplacer(".", "-", "+", "-").Replace(profile) }

// instanceCounter is the counter that bounds a profile NVML allows fewer instances of than it
// has placements: "media-extensions" for every profile with media extensions ("+me", one per GPU
// whichever profile holds them: an A30 lists 1g.6gb+me and 2g.12gb+me, one instance each, which
// share them), "<profile>-instances" for any other; "" when the placements alone bound it.
func instanceCounter(p migclient.Profile) string {
	switch {
	case int(p.InstanceCount) >= len(p.Placements):
		return ""
	case strings.Contains(p.Name, "+me"):
		return "media-extensions"
	}
	return labelOf(p.Name) + "-instances"
}

func counterSetName(gpuIndex uint32) string { return fmt.Sprintf("gpu%d", gpuIndex) }

// idlePlacements are the placements of the IDLE instances on one GPU (every key of the warm set is one).
func idlePlacements(gpuUUID string, warm map[Placed]bool) []migclient.Placement {
	var out []migclient.Placement
	for p, ok := range warm {
		if ok && p.GPUUUID == gpuUUID {
			out = append(out, p.Placement)
		}
	}
	return out
}

// rank orders a GPU's devices by what preparing a claim on one costs the sidecar: 0 warm (a reuse,
// no create), 1 cold on memory slices no IDLE instance holds (one create), then cold over n IDLE
// instances, 1+n (the sidecar destroys each inline before it creates: the slowest prepares, and
// the cache loses them). The order of RankPlacements' REUSE, FREE and RECLAIM, so that a claim
// missing the cache takes a free placement while one is left, and else the one in the fewest
// cached instances' way.
func rank(d Device, idle []migclient.Placement) int {
	if d.Warm {
		return 0
	}
	r := 1
	for _, p := range idle {
		if d.Placement.Start < p.Start+p.Size && p.Start < d.Placement.Start+d.Placement.Size {
			r++
		}
	}
	return r
}

// WarmFromState is the warm set of a GetState answer: every IDLE, healthy instance.
func WarmFromState(st *pb.GetStateResponse) map[Placed]bool {
	warm := map[Placed]bool{}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if in.GetState() == pb.InstanceState_IDLE && in.GetHealth() != pb.InstanceHealth_FAULTED {
				warm[Placed{in.GetGpuUuid(), in.GetProfile(),
					migclient.Placement{Start: in.GetPlacement().GetStart(), Size: in.GetPlacement().GetSize()}}] = true
			}
		}
	}
	return warm
}

// NewModel builds the pools of node's GPUs with the warm set.
func NewModel(node string, gpus []GPU, warm map[Placed]bool) *Model {
	m := &Model{node: node, pools: map[string][]Device{}, sets: map[string]resourceapi.CounterSet{}, byName: map[[2]string]Device{},
		gpuByID: map[string]uint32{}}
	for _, g := range gpus {
		pool := PoolName(node, g.Index)
		set := resourceapi.CounterSet{Name: counterSetName(g.Index), Counters: map[string]resourceapi.Counter{}}
		var devices []Device
		for _, p := range g.Profiles {
			instances := instanceCounter(p)
			if instances != "" {
				set.Counters[instances] = resourceapi.Counter{Value: *resource.NewQuantity(int64(p.InstanceCount), resource.DecimalSI)}
			}
			for _, pl := range p.Placements {
				d := Device{Pool: pool, Name: DeviceName(g.Index, p.Name, pl.Start), GPUIndex: g.Index, GPUUUID: g.UUID,
					Profile: p.Name, Placement: pl, MemoryBytes: p.MemoryMB << 20, Warm: warm[Placed{g.UUID, p.Name, pl}]}
				for k := pl.Start; k < pl.Start+pl.Size; k++ {
					name := fmt.Sprintf("memory-slice-%d", k)
					set.Counters[name] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
					d.counters = append(d.counters, name)
				}
				if instances != "" {
					d.counters = append(d.counters, instances)
				}
				devices = append(devices, d)
			}
		}
		idle := idlePlacements(g.UUID, warm)
		slices.SortStableFunc(devices, func(a, b Device) int { return rank(a, idle) - rank(b, idle) })
		m.pools[pool], m.sets[pool], m.gpuByID[g.UUID] = devices, set, g.Index
		for _, d := range devices {
			m.byName[[2]string{pool, d.Name}] = d
		}
	}
	return m
}

// Lookup finds the device an allocation result names.
func (m *Model) Lookup(pool, device string) (Device, bool) {
	d, ok := m.byName[[2]string{pool, device}]
	return d, ok
}

// Resolve names the published device of an instance (its GPU, profile and placement start),
// for the health service; ok is false for an instance on a GPU or at a placement not published.
func (m *Model) Resolve(gpuUUID, profile string, start uint32) (pool, device string, ok bool) {
	index, known := m.gpuByID[gpuUUID]
	if !known {
		return "", "", false
	}
	for _, d := range m.pools[PoolName(m.node, index)] {
		if d.Profile == profile && d.Placement.Start == start {
			return d.Pool, d.Name, true
		}
	}
	return "", "", false
}

// Resources is the model as the kubeletplugin helper publishes it: per pool, the counter slice,
// then the device slices, MaxDevicesPerSlice devices each.
func (m *Model) Resources() resourceslice.DriverResources {
	out := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{}}
	for pool, devices := range m.pools {
		set := m.sets[pool]
		p := resourceslice.Pool{Slices: []resourceslice.Slice{{SharedCounters: []resourceapi.CounterSet{set}}}}
		for chunk := range slices.Chunk(devices, MaxDevicesPerSlice) {
			s := resourceslice.Slice{Devices: make([]resourceapi.Device, 0, len(chunk))}
			for _, d := range chunk {
				s.Devices = append(s.Devices, d.api(set.Name))
			}
			p.Slices = append(p.Slices, s)
		}
		out.Pools[pool] = p
	}
	return out
}

func (d Device) api(counterSet string) resourceapi.Device {
	counters := make(map[string]resourceapi.Counter, len(d.counters))
	for _, c := range d.counters {
		counters[c] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
	}
	return resourceapi.Device{
		Name: d.Name,
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			AttrProfile:        {StringValue: ptr.To(d.Profile)},
			AttrGPUUUID:        {StringValue: ptr.To(d.GPUUUID)},
			AttrPlacementStart: {IntValue: ptr.To(int64(d.Placement.Start))},
			AttrPlacementSize:  {IntValue: ptr.To(int64(d.Placement.Size))},
			AttrWarm:           {BoolValue: ptr.To(d.Warm)},
		},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			CapacityMemory: {Value: *resource.NewQuantity(int64(d.MemoryBytes), resource.BinarySI)},
		},
		ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: counterSet, Counters: counters}},
	}
}
