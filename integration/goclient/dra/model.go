package dra

import (
	"cmp"
	"fmt"
	"math"
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
// Every device is published, always: a device a claim was allocated must stay in the slices, or the
// allocator no longer counts the counters it consumes and hands its memory slices to the next
// claim, whose prepare then finds them taken. A device prepare must refuse is tainted instead
// (TaintKey, effect NoSchedule: the allocator gives it to no new claim that does not tolerate the
// taint, and still counts it for the claims that hold it), with the reason as the taint's value:
// a device whose placement overlaps anything not this plugin's to hand out, which the scheduler
// cannot see through the counters: a foreign GPU instance, an instance of HAMi's path (owned by a
// pod), an ERROR one, a FAULTED one no claim holds; and every device of a GPU the sidecar could not
// read (GpuState.unreadable: lost, or its listing failed). The taint goes once that is gone, at the
// next republish. Tainted devices come last. A claim's own instances taint nothing: the scheduler
// counts them through the claim's allocation. Nor do instances the sidecar is creating or
// destroying for its cache (CREATING, DELETING, no owner): it does so under the GPU's lock, which an
// Allocate waits for.
//
// A device is warm when an IDLE, healthy instance of exactly its profile sits exactly at its
// placement, and, unless the plugin destroys at unprepare, when a claim's healthy instance does:
// that instance goes IDLE at the claim's unprepare, and the allocator cannot give the device to
// another claim before the claim's allocation is gone, by which time it is IDLE. So an unprepare
// changes nothing in the slices, and a claim that follows a departure finds the departed claim's
// instance warm and first without waiting for a republish. A firstAvailable list whose first
// subrequest selects the attribute "warm" stays for claims that want a warm device or none of the
// first choice.

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
	devices []Device                         // every device, in rank order (warm first, tainted last)
	tainted map[string]string                // device -> why it is tainted
	held    map[string][]migclient.Placement // placements claims hold, by GPU UUID
	sets    []resourceapi.CounterSet         // one per GPU, by index
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

// View is what GetState says of the GPUs beyond their profiles: the warm set, the instances a
// claim holds, the IDLE placements by GPU, what blocks a placement, and the GPUs that could not
// be read.
type View struct {
	Warm map[Placed]bool
	// Held are the healthy instances claims hold (ACTIVE, or CREATING for a prepare in flight).
	Held map[Placed]bool
	// Idle are the placements of each GPU's IDLE, healthy instances (by GPU UUID).
	Idle map[string][]migclient.Placement
	// Blocked are the placements of each GPU whose overlapping devices are tainted (by GPU UUID).
	Blocked map[string][]Block
	// Unreadable are the GPUs the sidecar could not read, with its reason (by GPU UUID).
	Unreadable map[string]string
	// HeldGoIdle: a claim's instances go IDLE at its unprepare (Options.DestroyAtUnprepare off), so
	// a held device is published warm and its instance counts among the IDLE ones in the ranks.
	HeldGoIdle bool
}

// Block is a placement no new claim may be given a device over: Why is the taint's value (a label
// value), Detail what the sidecar said of it, for the log.
type Block struct {
	Placement migclient.Placement
	Why       string
	Detail    string
}

// The taint of a device prepare must refuse, and its values.
const (
	TaintKey             = DefaultDriverName + "/unavailable"
	TaintForeign         = "foreign-gpu-instance"
	TaintPodInstance     = "hami-pod-instance"
	TaintErrorInstance   = "error-instance"
	TaintFaultedInstance = "faulted-instance"
	TaintGPUUnreadable   = "gpu-unreadable"
)

// rank orders the devices by what preparing a claim on one costs the sidecar: 0 warm (a reuse,
// no create), 1 cold on memory slices no IDLE instance holds (one create), then cold over n IDLE
// instances, 1+n (the sidecar destroys each inline before it creates: the slowest prepares, and
// the cache loses them); tainted devices after all of them. The order of RankPlacements' REUSE,
// FREE and RECLAIM, so that a claim missing the cache takes a free placement while one is left,
// and else the one in the fewest cached instances' way.
func rank(d Device, idle []migclient.Placement, tainted bool) int {
	switch {
	case tainted:
		return math.MaxInt
	case d.Warm:
		return 0
	}
	r := 1
	for _, p := range idle {
		if d.Placement.Overlaps(p) {
			r++
		}
	}
	return r
}

// ViewOf reads a GetState answer: IDLE, healthy instances are warm; a claim's healthy instances
// are held; foreign GIs, instances owned by a pod, ERROR ones and FAULTED ones no claim holds
// block their placement. HeldGoIdle is the caller's to set.
func ViewOf(st *pb.GetStateResponse) View {
	v := View{Warm: map[Placed]bool{}, Held: map[Placed]bool{}, Idle: map[string][]migclient.Placement{},
		Blocked: map[string][]Block{}, Unreadable: map[string]string{}}
	for _, g := range st.GetGpus() {
		gpu := g.GetGpu().GetUuid()
		if why := g.GetUnreadable(); why != "" {
			v.Unreadable[gpu] = why
		}
		for _, f := range g.GetForeign() {
			v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: placementOf(f.GetPlacement()), Why: TaintForeign,
				Detail: fmt.Sprintf("foreign GPU instance %d", f.GetGpuInstanceId())})
		}
		for _, in := range g.GetInstances() {
			at := placementOf(in.GetPlacement())
			healthy := in.GetHealth() != pb.InstanceHealth_FAULTED
			kind := in.GetOwner().GetKind()
			detail := fmt.Sprintf("%s instance %s (%s)", in.GetState(), in.GetMigUuid(), in.GetHealth())
			switch {
			case kind == pb.OwnerKind_OWNER_KIND_CLAIM:
				if healthy && (in.GetState() == pb.InstanceState_ACTIVE || in.GetState() == pb.InstanceState_CREATING) {
					v.Held[Placed{gpu, in.GetProfile(), at}] = true
				}
			case in.GetOwner() != nil: // a pod's (an older sidecar leaves the kind unspecified)
				v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: at, Why: TaintPodInstance, Detail: detail})
			case in.GetState() == pb.InstanceState_ERROR:
				v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: at, Why: TaintErrorInstance, Detail: detail})
			case !healthy:
				v.Blocked[gpu] = append(v.Blocked[gpu], Block{Placement: at, Why: TaintFaultedInstance, Detail: detail})
			case in.GetState() == pb.InstanceState_IDLE:
				v.Warm[Placed{gpu, in.GetProfile(), at}] = true
				v.Idle[gpu] = append(v.Idle[gpu], at)
			}
		}
	}
	return v
}

func placementOf(p *pb.Placement) migclient.Placement {
	return migclient.Placement{Start: p.GetStart(), Size: p.GetSize()}
}

// taint is the reason d is tainted ("" when it is not): its GPU unreadable, or a block over it.
func (v View) taint(d Device) string {
	if _, lost := v.Unreadable[d.GPUUUID]; lost {
		return TaintGPUUnreadable
	}
	for _, b := range v.Blocked[d.GPUUUID] {
		if d.Placement.Overlaps(b.Placement) {
			return b.Why
		}
	}
	return ""
}

// Trimmed is the view once the sidecar's trim has freed next (the devices named to keep free): the
// IDLE instances overlapping one are gone from Warm and Idle.
func (v View) Trimmed(next []Device) View {
	doomed := func(gpu string, p migclient.Placement) bool {
		return slices.ContainsFunc(next, func(d Device) bool { return d.GPUUUID == gpu && d.Placement.Overlaps(p) })
	}
	out := v
	out.Warm, out.Idle = map[Placed]bool{}, map[string][]migclient.Placement{}
	for p := range v.Warm {
		if !doomed(p.GPUUUID, p.Placement) {
			out.Warm[p] = true
		}
	}
	for gpu, ps := range v.Idle {
		for _, p := range ps {
			if !doomed(gpu, p) {
				out.Idle[gpu] = append(out.Idle[gpu], p)
			}
		}
	}
	return out
}

// blocks says what taints devices, a line for the log: each unreadable GPU and each block with
// what the sidecar said of it, in a stable order; "" when nothing does.
func (v View) blocks() string {
	var parts []string
	for gpu, why := range v.Unreadable {
		parts = append(parts, fmt.Sprintf("%s: every device (%s)", gpu, why))
	}
	for gpu, blocks := range v.Blocked {
		for _, b := range blocks {
			parts = append(parts, fmt.Sprintf("%s at %d+%d: %s (%s)", gpu, b.Placement.Start, b.Placement.Size, b.Detail, b.Why))
		}
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}

// heldPlacements are each GPU's placements claims hold.
func (v View) heldPlacements() map[string][]migclient.Placement {
	out := map[string][]migclient.Placement{}
	for p := range v.Held {
		out[p.GPUUUID] = append(out[p.GPUUUID], p.Placement)
	}
	return out
}

// NewModel builds the node's pool of gpus with the view.
func NewModel(node string, gpus []GPU, view View) *Model {
	m := &Model{node: node, tainted: map[string]string{}, held: view.heldPlacements(), byName: map[string]Device{},
		gpuByID: map[string]uint32{}}
	pool := PoolName(node)
	ranks := map[string]int{}
	for _, g := range slices.SortedFunc(slices.Values(gpus), func(a, b GPU) int { return int(a.Index) - int(b.Index) }) {
		set := resourceapi.CounterSet{Name: counterSetName(g.Index), Counters: map[string]resourceapi.Counter{}}
		idle := view.Idle[g.UUID]
		if view.HeldGoIdle {
			idle = append(slices.Clone(idle), m.held[g.UUID]...)
		}
		for _, p := range g.Profiles {
			instances := instanceCounter(p)
			if instances != "" {
				set.Counters[instances] = resourceapi.Counter{Value: *resource.NewQuantity(int64(p.InstanceCount), resource.DecimalSI)}
			}
			for _, pl := range p.Placements {
				at := Placed{g.UUID, p.Name, pl}
				d := Device{Pool: pool, Name: DeviceName(g.Index, p.Name, pl.Start), GPUIndex: g.Index, GPUUUID: g.UUID,
					Profile: p.Name, Placement: pl, MemoryBytes: p.MemoryMB << 20, Warm: view.Warm[at] || view.HeldGoIdle && view.Held[at]}
				for k := pl.Start; k < pl.Start+pl.Size; k++ {
					name := fmt.Sprintf("memory-slice-%d", k)
					set.Counters[name] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
					d.counters = append(d.counters, name)
				}
				if instances != "" {
					d.counters = append(d.counters, instances)
				}
				if why := view.taint(d); why != "" {
					m.tainted[d.Name] = why
					d.Warm = false
				}
				ranks[d.Name] = rank(d, idle, m.tainted[d.Name] != "")
				m.devices = append(m.devices, d)
				m.byName[d.Name] = d
			}
		}
		m.sets = append(m.sets, set)
		m.gpuByID[g.UUID] = g.Index
	}
	// Stable: within a rank, by GPU index, then in DiscoverProfiles' order.
	slices.SortStableFunc(m.devices, func(a, b Device) int { return cmp.Compare(ranks[a.Name], ranks[b.Name]) })
	return m
}

// Taint is why the device is tainted, "" when a new claim may be given it.
func (m *Model) Taint(device string) string { return m.tainted[device] }

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
// next: its first device in rank order that is not warm, not tainted and clear of the instances
// claims hold (whose counters their allocations consume): the allocator's first fit on a node
// without other claims in flight. The plugin names them to the sidecar (KeepFree), whose
// background trim destroys the IDLE instances over one, so that claim creates at once instead of
// waiting for those destroys; the slices republished then list it free (rank 1).
func (m *Model) NextCold() []Device {
	var out []Device
	seen := map[string]bool{}
	for _, d := range m.devices {
		if d.Warm || m.tainted[d.Name] != "" || seen[d.Profile] ||
			slices.ContainsFunc(m.held[d.GPUUUID], d.Placement.Overlaps) {
			continue
		}
		seen[d.Profile] = true
		out = append(out, d)
	}
	return out
}

// Resources is the model as the kubeletplugin helper publishes it: the node's pool, its counter
// slices (ResourceSliceMaxCounterSets sets each), then every device in rank order,
// MaxDevicesPerSlice each, the tainted ones with their taint.
func (m *Model) Resources() resourceslice.DriverResources {
	var p resourceslice.Pool
	for sets := range slices.Chunk(m.sets, resourceapi.ResourceSliceMaxCounterSets) {
		p.Slices = append(p.Slices, resourceslice.Slice{SharedCounters: sets})
	}
	for chunk := range slices.Chunk(m.devices, MaxDevicesPerSlice) {
		s := resourceslice.Slice{Devices: make([]resourceapi.Device, 0, len(chunk))}
		for _, d := range chunk {
			s.Devices = append(s.Devices, d.api(counterSetName(d.GPUIndex), m.tainted[d.Name]))
		}
		p.Slices = append(p.Slices, s)
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{PoolName(m.node): p}}
}

func (d Device) api(counterSet, taint string) resourceapi.Device {
	counters := make(map[string]resourceapi.Counter, len(d.counters))
	for _, c := range d.counters {
		counters[c] = resourceapi.Counter{Value: *resource.NewQuantity(1, resource.DecimalSI)}
	}
	var taints []resourceapi.DeviceTaint
	if taint != "" {
		taints = []resourceapi.DeviceTaint{{Key: TaintKey, Value: taint, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	return resourceapi.Device{
		Taints: taints,
		Name:   d.Name,
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
