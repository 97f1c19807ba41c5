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

// The slice model: what the plugin publishes for the GPUs it serves, and how it reads an
// allocation result back.
//
// One pool per node, named PoolName(node): the scheduler's allocator (k8s.io/dynamic-resource-
// allocation's structured allocator) tries the pools of a node by name and, within one, the slices
// by name (the kubeletplugin helper names them by their index, zero-padded) and then the devices
// in order, taking the first that fits. Pools per GPU would make the pool names the order, gpu0
// before any warm device of gpu3 and gpu10 before gpu2; one pool lets the plugin order every
// device of the node by what preparing a claim on it costs (rank): the warm devices of every GPU
// first, then the free placements, then those over IDLE instances (fewest first), each tier by
// GPU index. So a plain claim lands warm wherever a warm device of its profile is on the node.
//
// The pool's first slices hold only shared counters (the API server refuses counters and devices
// in one slice), ResourceSliceMaxCounterSets counter sets each: one set per GPU, "gpu<index>", of
// one counter per memory slice ("memory-slice-<k>", value 1; names may not hold dots), plus one
// for the profiles NVML allows fewer instances of than they have placements (instanceCounter).
// The slices after them hold one device per (profile, placement) DiscoverProfiles lists, named
// DeviceName(index, profile, start), each consuming the memory slices its placement covers (and
// its profile's instance counter) of its GPU's set in one consumesCounters entry: two devices
// whose placements overlap can never both be allocated, which is exactly NVML's rule. At most
// MaxDevicesPerSlice devices per slice, the server's limit for devices that consume counters.
//
// The slices offer only what prepare can do (View, from GetState). Not published: a device whose
// placement overlaps anything not this plugin's to hand out, which the scheduler cannot see
// through the counters: a foreign GPU instance, an instance of HAMi's path (owned by a pod), a
// CREATING, DELETING or ERROR one, a FAULTED one; and every device of a GPU the sidecar could not
// read (GpuState.unreadable: lost, or its listing failed). A claim's ACTIVE instance hides the
// devices overlapping it but its own, which the claim holds (the scheduler counts its counters
// through it). Each comes back once that is gone, at the next republish. The model keeps every
// device for Lookup: a claim allocated before a device was hidden is still prepared (the sidecar
// answers what it can).
//
// A device is warm when an IDLE, healthy instance of exactly its profile sits exactly at its
// placement. A firstAvailable list whose first subrequest selects the attribute "warm" stays for
// claims that want a warm device or none of the first choice.

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

// Model is the published view of the GPUs: the node's pool with its devices in publishing order,
// and the lookup of an allocation result's (pool, device) pair.
type Model struct {
	node    string
	devices []Device // every device, in rank order (warm first); Offered says which are published
	offered map[string]bool
	held    map[string]bool          // devices a claim's ACTIVE instance holds (offered for its counters only)
	sets    []resourceapi.CounterSet // one per GPU, by index
	byName  map[string]Device
	gpuByID map[string]uint32 // GPU UUID -> index
}

// PoolName is the node's pool.
func PoolName(node string) string { return node }

// legacyPool reports whether pool is one of the per-GPU pools of earlier versions,
// "<node>-gpu<index>", which claims allocated before an upgrade name.
func legacyPool(node, pool string) bool {
	index, ok := strings.CutPrefix(pool, node+"-gpu")
	if !ok || index == "" {
		return false
	}
	return strings.Trim(index, "0123456789") == ""
}

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

// View is what GetState says of the GPUs beyond their profiles: the warm set, the IDLE
// placements by GPU, what blocks a placement, and the GPUs that could not be read.
type View struct {
	Warm map[Placed]bool
	// Idle are the placements of each GPU's IDLE, healthy instances (by GPU UUID).
	Idle map[string][]migclient.Placement
	// Blocked are the placements of each GPU no device overlapping may be offered for (by GPU UUID).
	Blocked map[string][]Block
	// Unreadable are the GPUs the sidecar could not read, with its reason (by GPU UUID).
	Unreadable map[string]string
}

// Block is a placement no offered device may overlap, but for Keep's own device when set (a
// claim's ACTIVE instance: its claim holds that device).
type Block struct {
	Placement migclient.Placement
	Why       string
	Keep      *Placed
}

func overlap(a, b migclient.Placement) bool {
	return a.Start < b.Start+b.Size && b.Start < a.Start+a.Size
}

// rank orders the devices by what preparing a claim on one costs the sidecar: 0 warm (a reuse,
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
		if overlap(d.Placement, p) {
			r++
		}
	}
	return r
}

// WarmFromState is the warm set of a GetState answer: every IDLE, healthy instance.
func WarmFromState(st *pb.GetStateResponse) map[Placed]bool { return ViewOf(st).Warm }

// ViewOf reads a GetState answer: IDLE, healthy instances are warm; foreign GIs, instances owned
// by a pod, CREATING, DELETING, ERROR and FAULTED ones block their placement; a claim's ACTIVE
// instance blocks its placement but for its own device.
func ViewOf(st *pb.GetStateResponse) View {
	v := View{Warm: map[Placed]bool{}, Idle: map[string][]migclient.Placement{}, Blocked: map[string][]Block{},
		Unreadable: map[string]string{}}
	for _, g := range st.GetGpus() {
		gpu := g.GetGpu().GetUuid()
		if why := g.GetUnreadable(); why != "" {
			v.Unreadable[gpu] = why
		}
		for _, f := range g.GetForeign() {
			v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: placementOf(f.GetPlacement()),
				Why: fmt.Sprintf("foreign GPU instance %d", f.GetGpuInstanceId())})
		}
		for _, in := range g.GetInstances() {
			at := placementOf(in.GetPlacement())
			healthy := in.GetHealth() != pb.InstanceHealth_FAULTED
			switch {
			case in.GetState() == pb.InstanceState_IDLE && healthy:
				v.Warm[Placed{gpu, in.GetProfile(), at}] = true
				v.Idle[gpu] = append(v.Idle[gpu], at)
			case in.GetState() == pb.InstanceState_ACTIVE && healthy && in.GetOwner().GetKind() == pb.OwnerKind_OWNER_KIND_CLAIM:
				v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: at, Why: "claim " + in.GetOwner().GetClaim().GetUid(),
					Keep: &Placed{gpu, in.GetProfile(), at}})
			default:
				v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: at,
					Why: fmt.Sprintf("%s instance %s (%s)", in.GetState(), in.GetMigUuid(), in.GetHealth())})
			}
		}
	}
	return v
}

func placementOf(p *pb.Placement) migclient.Placement {
	return migclient.Placement{Start: p.GetStart(), Size: p.GetSize()}
}

// holds reports whether a claim's ACTIVE instance holds d itself (Block.Keep).
func (v View) holds(d Device) bool {
	for _, b := range v.Blocked[d.GPUUUID] {
		if b.Keep != nil && *b.Keep == (Placed{d.GPUUUID, d.Profile, d.Placement}) {
			return true
		}
	}
	return false
}

// offered reports whether the view lets d be published: its GPU readable, and no block over it.
func (v View) offered(d Device) bool {
	if _, lost := v.Unreadable[d.GPUUUID]; lost {
		return false
	}
	for _, b := range v.Blocked[d.GPUUUID] {
		if overlap(d.Placement, b.Placement) && (b.Keep == nil || *b.Keep != Placed{d.GPUUUID, d.Profile, d.Placement}) {
			return false
		}
	}
	return true
}

// NewModel builds the node's pool of gpus with the view.
func NewModel(node string, gpus []GPU, view View) *Model {
	m := &Model{node: node, offered: map[string]bool{}, held: map[string]bool{}, byName: map[string]Device{}, gpuByID: map[string]uint32{}}
	pool := PoolName(node)
	ranks := map[string]int{}
	for _, g := range slices.SortedFunc(slices.Values(gpus), func(a, b GPU) int { return int(a.Index) - int(b.Index) }) {
		set := resourceapi.CounterSet{Name: counterSetName(g.Index), Counters: map[string]resourceapi.Counter{}}
		for _, p := range g.Profiles {
			instances := instanceCounter(p)
			if instances != "" {
				set.Counters[instances] = resourceapi.Counter{Value: *resource.NewQuantity(int64(p.InstanceCount), resource.DecimalSI)}
			}
			for _, pl := range p.Placements {
				d := Device{Pool: pool, Name: DeviceName(g.Index, p.Name, pl.Start), GPUIndex: g.Index, GPUUUID: g.UUID,
					Profile: p.Name, Placement: pl, MemoryBytes: p.MemoryMB << 20, Warm: view.Warm[Placed{g.UUID, p.Name, pl}]}
				for k := pl.Start; k < pl.Start+pl.Size; k++ {
					name := fmt.Sprintf("memory-slice-%d", k)
					set.Counters[name] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
					d.counters = append(d.counters, name)
				}
				if instances != "" {
					d.counters = append(d.counters, instances)
				}
				ranks[d.Name] = rank(d, view.Idle[g.UUID])
				m.devices = append(m.devices, d)
				m.offered[d.Name] = view.offered(d)
				m.held[d.Name] = view.holds(d)
				m.byName[d.Name] = d
			}
		}
		m.sets = append(m.sets, set)
		m.gpuByID[g.UUID] = g.Index
	}
	// Stable: within a rank, by GPU index, then in DiscoverProfiles' order.
	slices.SortStableFunc(m.devices, func(a, b Device) int { return ranks[a.Name] - ranks[b.Name] })
	return m
}

// Offered reports whether the device is published now.
func (m *Model) Offered(device string) bool { return m.offered[device] }

// Lookup finds the device an allocation result names, published now or not: in the node's pool,
// or in the per-GPU pool of an earlier version that held it ("<node>-gpu<index>").
func (m *Model) Lookup(pool, device string) (Device, bool) {
	d, ok := m.byName[device]
	if !ok || pool != PoolName(m.node) && pool != fmt.Sprintf("%s-gpu%d", m.node, d.GPUIndex) {
		return Device{}, false
	}
	return d, true
}

// Resolve names the published device of an instance (its GPU, profile and placement start),
// for the health service; ok is false for an instance on a GPU or at a placement not published.
func (m *Model) Resolve(gpuUUID, profile string, start uint32) (pool, device string, ok bool) {
	index, known := m.gpuByID[gpuUUID]
	if !known {
		return "", "", false
	}
	for _, d := range m.devices {
		if d.GPUIndex == index && d.Profile == profile && d.Placement.Start == start {
			return d.Pool, d.Name, true
		}
	}
	return "", "", false
}

// NextCold is, for each published profile, the device a claim for it that finds no warm one gets
// next: its first offered device that is not warm and no claim holds, in rank order (the
// allocator's first fit on a node without other claims in flight). The plugin names them to the sidecar (KeepFree), whose
// background trim destroys the IDLE instances over one, so that claim creates at once instead of
// waiting for those destroys; the slices republished then list it free (rank 1).
func (m *Model) NextCold() []Device {
	var out []Device
	seen := map[string]bool{}
	for _, d := range m.devices {
		if d.Warm || !m.offered[d.Name] || m.held[d.Name] || seen[d.Profile] {
			continue
		}
		seen[d.Profile] = true
		out = append(out, d)
	}
	return out
}

// Resources is the model as the kubeletplugin helper publishes it: the node's pool, its counter
// slices (ResourceSliceMaxCounterSets sets each), then the offered devices in rank order,
// MaxDevicesPerSlice each.
func (m *Model) Resources() resourceslice.DriverResources {
	var p resourceslice.Pool
	for sets := range slices.Chunk(m.sets, resourceapi.ResourceSliceMaxCounterSets) {
		p.Slices = append(p.Slices, resourceslice.Slice{SharedCounters: sets})
	}
	var offered []Device
	for _, d := range m.devices {
		if m.offered[d.Name] {
			offered = append(offered, d)
		}
	}
	for chunk := range slices.Chunk(offered, MaxDevicesPerSlice) {
		s := resourceslice.Slice{Devices: make([]resourceapi.Device, 0, len(chunk))}
		for _, d := range chunk {
			s.Devices = append(s.Devices, d.api(counterSetName(d.GPUIndex)))
		}
		p.Slices = append(p.Slices, s)
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{PoolName(m.node): p}}
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
