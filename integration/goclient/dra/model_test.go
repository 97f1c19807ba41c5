package dra_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestMain(m *testing.M) { os.Exit(kubeapi.Main(m)) }

// simProfiles are a board's profiles as the sidecar's simulator (and so DiscoverProfiles on it)
// lists them, from the export the hardware-truth test keeps current.
func simProfiles(t *testing.T, board string) []migclient.Profile {
	t.Helper()
	raw, err := os.ReadFile("../hwtruth/testdata/sim-tables.json")
	if err != nil {
		t.Fatal(err)
	}
	var tables map[string]struct {
		Profiles []struct {
			Name          string     `json:"name"`
			SliceCount    uint32     `json:"slice_count"`
			InstanceCount uint32     `json:"instance_count"`
			MemoryMB      uint64     `json:"memory_mb"`
			Placements    [][]uint32 `json:"placements"`
		} `json:"profiles"`
	}
	if err := json.Unmarshal(raw, &tables); err != nil {
		t.Fatal(err)
	}
	var out []migclient.Profile
	for _, p := range tables[board].Profiles {
		mp := migclient.Profile{Name: p.Name, SliceCount: p.SliceCount, InstanceCount: p.InstanceCount, MemoryMB: p.MemoryMB}
		for _, pl := range p.Placements {
			mp.Placements = append(mp.Placements, migclient.Placement{Start: pl[0], Size: pl[1]})
		}
		out = append(out, mp)
	}
	if len(out) == 0 {
		t.Fatalf("no profiles for %s", board)
	}
	return out
}

// sliceObjects are the ResourceSlices the helper's controller would write for the model.
func sliceObjects(node string, res map[string][]resourceapi.ResourceSliceSpec) []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for pool, specs := range res {
		for i, spec := range specs {
			spec.Driver = dra.DefaultDriverName
			spec.NodeName = ptr.To(node)
			spec.Pool = resourceapi.ResourcePool{Name: pool, Generation: 1, ResourceSliceCount: int64(len(specs))}
			out = append(out, &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", pool, i)}, Spec: spec})
		}
	}
	return out
}

func specs(m *dra.Model) map[string][]resourceapi.ResourceSliceSpec {
	out := map[string][]resourceapi.ResourceSliceSpec{}
	for pool, p := range m.Resources().Pools {
		for _, s := range p.Slices {
			out[pool] = append(out[pool], resourceapi.ResourceSliceSpec{Devices: s.Devices, SharedCounters: s.SharedCounters})
		}
	}
	return out
}

// view is the View of a warm set alone: every warm placement IDLE, nothing blocked.
func view(warm map[dra.Placed]bool) dra.View {
	v := dra.View{Warm: warm, Idle: map[string][]migclient.Placement{}}
	for p := range warm {
		v.Idle[p.GPUUUID] = append(v.Idle[p.GPUUUID], p.Placement)
	}
	return v
}

// devicesOf are the devices of node-m's pool in publishing order, across its device slices.
func devicesOf(m *dra.Model) []resourceapi.Device {
	var out []resourceapi.Device
	for _, s := range specs(m)[dra.PoolName("node-m")] {
		out = append(out, s.Devices...)
	}
	return out
}

func TestAnH100sSlicesAreAcceptedWithTheirCountersAndAClaimAllocatedFromThem(t *testing.T) {
	ctx := context.Background()
	profiles := simProfiles(t, "h100-80gb")
	warm := map[dra.Placed]bool{{GPUUUID: "GPU-1", Profile: "1g.10gb", Placement: migclient.Placement{Start: 3, Size: 1}}: true}
	m := dra.NewModel("node-m", []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: profiles}, {Index: 1, UUID: "GPU-1", Profiles: profiles}}, view(warm))

	byPool := specs(m)
	pool := byPool["node-m"]
	if len(byPool) != 1 || len(pool) != 2 || len(pool[0].SharedCounters) != 2 || len(pool[0].Devices) != 0 || len(pool[1].SharedCounters) != 0 {
		t.Fatalf("want one pool, node-m, of a slice of two counter sets, then one of devices: %+v", byPool)
	}
	set := pool[0].SharedCounters[0]
	media := set.Counters["media-extensions"].Value
	if set.Name != "gpu0" || pool[0].SharedCounters[1].Name != "gpu1" || len(set.Counters) != 9 || media.Value() != 1 {
		t.Fatalf("gpu0's counters: want memory-slice-0..7 and media-extensions: %+v", set)
	}
	devices := pool[1].Devices
	if len(devices) != 50 {
		t.Fatalf("%d devices, want one per (profile, placement) of an H100, 25 per GPU", len(devices))
	}
	first := devices[0]
	if first.Name != "gpu1-1g-10gb-at3" || !*first.Attributes[dra.AttrWarm].BoolValue || *devices[1].Attributes[dra.AttrWarm].BoolValue ||
		devices[1].Name != "gpu0-1g-10gb-at0" {
		t.Fatalf("the warm 1g.10gb at 3 of gpu1 must come first, alone warm, then gpu0's: %s, then %s", first.Name, devices[1].Name)
	}
	me, ok := m.Lookup("node-m", "gpu0-1g-10gb-me-at3")
	if !ok || me.Profile != "1g.10gb+me" || me.Placement != (migclient.Placement{Start: 3, Size: 1}) {
		t.Fatalf("gpu0-1g-10gb-me-at3: %+v %v", me, ok)
	}
	if d, ok := m.Lookup("node-m-gpu0", "gpu0-1g-10gb-at3"); !ok || d.GPUIndex != 0 {
		t.Fatal("a device of gpu0 not found under the per-GPU pool name of earlier versions")
	}
	if _, ok := m.Lookup("node-m-gpu1", "gpu0-1g-10gb-at3"); ok {
		t.Fatal("a device of gpu0 found in gpu1's pool of earlier versions")
	}

	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-m"}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, slice := range sliceObjects("node-m", byPool) {
		if _, err := admin.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
			t.Fatalf("slice %s refused: %v", slice.Name, err)
		}
	}
	// Stored as sent: with DRAPartitionableDevices off the server would drop the counters silently.
	stored, err := admin.ResourceV1().ResourceSlices().Get(ctx, "node-m-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := stored.Spec.Devices[0].ConsumesCounters; len(got) != 1 || got[0].CounterSet != "gpu1" || len(got[0].Counters) != 1 {
		t.Fatalf("the warm device's consumesCounters came back as %+v", got)
	}
	if counters, err := admin.ResourceV1().ResourceSlices().Get(ctx, "node-m-0", metav1.GetOptions{}); err != nil ||
		len(counters.Spec.SharedCounters) != 2 || len(counters.Spec.SharedCounters[0].Counters) != 9 {
		t.Fatalf("the counter slice came back as %+v (%v)", counters, err)
	}

	kubeapi.DeviceClass(ctx, t, admin, dra.DefaultDriverName, dra.DefaultDriverName)
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "small"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: dra.DefaultDriverName}}}}}}
	claim, err = admin.ResourceV1().ResourceClaims("default").Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	claim.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
		Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: dra.DefaultDriverName, Pool: "node-m", Device: first.Name}}}}
	if _, err := admin.ResourceV1().ResourceClaims("default").UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("the allocation of %s refused: %v", first.Name, err)
	}
}

func TestEveryBoardsSlicesKeepTheServersLimits(t *testing.T) {
	for _, board := range []string{"a100-40gb", "a30", "h100-80gb", "b200", "rtx-pro-6000"} {
		m := dra.NewModel("n", []dra.GPU{{Index: 7, UUID: "GPU-7", Profiles: simProfiles(t, board)}}, dra.View{})
		for pool, slices := range specs(m) {
			for i, s := range slices {
				if len(s.Devices) > dra.MaxDevicesPerSlice {
					t.Errorf("%s %s slice %d: %d devices", board, pool, i, len(s.Devices))
				}
				for _, d := range s.Devices {
					if len(d.ConsumesCounters) > resourceapi.ResourceSliceMaxDeviceCounterConsumptionsPerDevice {
						t.Errorf("%s %s: %d consumesCounters entries", board, d.Name, len(d.ConsumesCounters))
					}
				}
				for _, set := range s.SharedCounters {
					if len(set.Counters) > resourceapi.ResourceSliceMaxCountersPerCounterSet {
						t.Errorf("%s: %d counters", board, len(set.Counters))
					}
				}
			}
		}
	}
}

// A claim that misses the cache takes a free placement while one is left: after the warm device,
// every device whose memory slices no IDLE instance holds comes before every device over one.
func TestColdDevicesOnFreeMemorySlicesComeBeforeThoseOverAnIdleInstance(t *testing.T) {
	idle := migclient.Placement{Start: 3, Size: 1}
	warm := map[dra.Placed]bool{{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: idle}: true}
	m := dra.NewModel("node-m", []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: simProfiles(t, "h100-80gb")}}, view(warm))

	devices := devicesOf(m)
	if devices[0].Name != "gpu0-1g-10gb-at3" {
		t.Fatalf("first %s, want the warm gpu0-1g-10gb-at3", devices[0].Name)
	}
	over, free := 0, 0
	for _, d := range devices[1:] {
		start, size := *d.Attributes[dra.AttrPlacementStart].IntValue, *d.Attributes[dra.AttrPlacementSize].IntValue
		if start < int64(idle.Start+idle.Size) && int64(idle.Start) < start+size {
			over++
			continue
		}
		free++
		if over > 0 {
			t.Fatalf("%s (free) comes after %d devices over the IDLE instance at 3", d.Name, over)
		}
	}
	// An H100's 25 devices: the warm one, 6 over slice 3 (1g.10gb+me at 3, 1g.20gb and 2g.20gb at
	// 2, 3g.40gb, 4g.40gb and 7g.80gb at 0), 18 clear of it.
	if free != 18 || over != 6 {
		t.Fatalf("%d free and %d over slice 3, want 18 and 6", free, over)
	}
}

// Among the devices over IDLE instances, those over fewer come first: each is a destroy on the
// prepare's path.
func TestColdDevicesOverFewerIdleInstancesComeFirst(t *testing.T) {
	warm := map[dra.Placed]bool{
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: migclient.Placement{Start: 0, Size: 1}}: true,
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: migclient.Placement{Start: 1, Size: 1}}: true,
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: migclient.Placement{Start: 4, Size: 1}}: true,
	}
	m := dra.NewModel("node-m", []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: simProfiles(t, "h100-80gb")}}, view(warm))

	var order []string
	for _, d := range devicesOf(m) {
		if *d.Attributes[dra.AttrProfile].StringValue == "3g.40gb" {
			order = append(order, d.Name)
		}
	}
	// 3g.40gb at 4 covers one IDLE instance (at 4), at 0 two (at 0 and 1).
	if len(order) != 2 || order[0] != "gpu0-3g-40gb-at4" {
		t.Fatalf("3g.40gb devices in order %v, want the one over one IDLE instance (at4) first", order)
	}
}

// The device a claim that finds no warm one gets next, per profile, is its first device that is
// not warm, not tainted and clear of the instances claims hold: over IDLE instances when no free
// one is left.
func TestNextColdIsEachProfilesFirstAllocatableDeviceThatIsNotWarm(t *testing.T) {
	at := func(start, size uint32) migclient.Placement { return migclient.Placement{Start: start, Size: size} }
	warm := map[dra.Placed]bool{
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(0, 1)}: true,
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(1, 1)}: true,
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(4, 1)}: true,
	}
	v := view(warm)
	// A claim holds 1g.10gb at 2: its device is warm (its instance goes IDLE at the claim's
	// unprepare) and the devices over it are the claim's counters', nobody's next.
	v.Held = map[dra.Placed]bool{{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(2, 1)}: true}
	v.HeldGoIdle = true
	v.Blocked = map[string][]dra.Block{"GPU-0": {{Placement: at(6, 1), Why: dra.TaintForeign}}}
	m := dra.NewModel("node-m", []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: simProfiles(t, "h100-80gb")}}, v)

	next := map[string]string{}
	for _, d := range m.NextCold() {
		if _, twice := next[d.Profile]; twice {
			t.Fatalf("two devices for %s", d.Profile)
		}
		next[d.Profile] = d.Name
	}
	// 1g.10gb: at3, the first free one (at2 is the claim's). 2g.20gb: at4, over one IDLE instance
	// (at0 over two, at2 over the claim's). 3g.40gb: none (at0 over the claim's, at4 under the
	// foreign GI), nor 7g.80gb.
	want := map[string]string{"1g.10gb": "gpu0-1g-10gb-at3", "2g.20gb": "gpu0-2g-20gb-at4"}
	for profile, name := range want {
		if next[profile] != name {
			t.Fatalf("next cold %s: %q, want %q (all: %v)", profile, next[profile], name, next)
		}
	}
	for _, none := range []string{"3g.40gb", "7g.80gb"} {
		if _, ok := next[none]; ok {
			t.Fatalf("%s named next, though none of its devices is free to allocate: %v", none, next)
		}
	}
	if d := devicesOf(m); d[0].Name != "gpu0-1g-10gb-at0" || !slices.ContainsFunc(d[:4], func(d resourceapi.Device) bool {
		return d.Name == "gpu0-1g-10gb-at2" && *d.Attributes[dra.AttrWarm].BoolValue
	}) {
		t.Fatalf("the claim's device is not among the first four, warm: %v", names(d[:4]))
	}
}

func names(ds []resourceapi.Device) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.Name)
	}
	return out
}

// What the scheduler cannot see through the counters and prepare must refuse taints every device
// over it, with the reason as the taint's value; a claim's own instance, in any state, and an
// instance the sidecar creates or destroys for its cache taint nothing. Every device stays
// published (a claim allocated one keeps its counters counted), the tainted ones last.
func TestWhatPrepareMustRefuseTaintsTheDevicesOverItAndAClaimsOwnInstanceTaintsNone(t *testing.T) {
	claim := &pb.Owner{Kind: pb.OwnerKind_OWNER_KIND_CLAIM, Claim: &pb.ClaimRef{Uid: "c1"}}
	pod := &pb.Owner{Pod: &pb.PodRef{Uid: "p1"}} // kind unspecified: an older sidecar's pod
	for _, c := range []struct {
		in   *pb.Instance
		want string
	}{
		{&pb.Instance{State: pb.InstanceState_ACTIVE, Owner: pod}, dra.TaintPodInstance},
		{&pb.Instance{State: pb.InstanceState_CREATING, Owner: pod}, dra.TaintPodInstance},
		{&pb.Instance{State: pb.InstanceState_ERROR}, dra.TaintErrorInstance},
		{&pb.Instance{State: pb.InstanceState_IDLE, Health: pb.InstanceHealth_FAULTED}, dra.TaintFaultedInstance},
		{nil, dra.TaintForeign},
		{&pb.Instance{State: pb.InstanceState_ACTIVE, Owner: claim}, ""},
		{&pb.Instance{State: pb.InstanceState_ACTIVE, Owner: claim, Health: pb.InstanceHealth_FAULTED}, ""},
		{&pb.Instance{State: pb.InstanceState_CREATING, Owner: claim}, ""},
		{&pb.Instance{State: pb.InstanceState_CREATING}, ""},
		{&pb.Instance{State: pb.InstanceState_DELETING}, ""},
	} {
		g := &pb.GpuState{Gpu: &pb.Gpu{Uuid: "GPU-0"}}
		label := "foreign"
		if c.in == nil {
			g.Foreign = []*pb.ForeignInstance{{GpuInstanceId: 9, Placement: &pb.Placement{Start: 2, Size: 1}}}
		} else {
			c.in.Profile, c.in.MigUuid, c.in.Placement = "1g.10gb", "MIG-x", &pb.Placement{Start: 2, Size: 1}
			g.Instances = []*pb.Instance{c.in}
			label = fmt.Sprintf("%s %s owner %v", c.in.GetState(), c.in.GetHealth(), c.in.GetOwner().GetKind())
		}
		v := dra.ViewOf(&pb.GetStateResponse{Gpus: []*pb.GpuState{g}})
		v.HeldGoIdle = true
		m := dra.NewModel("node-m", []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: simProfiles(t, "h100-80gb")}}, v)
		// Over slice 2: the 1g.10gb (and +me) at 2, 1g.20gb and 2g.20gb at 2, 3g.40gb, 4g.40gb and 7g.80gb at 0.
		over := []string{"gpu0-1g-10gb-at2", "gpu0-1g-10gb-me-at2", "gpu0-1g-20gb-at2", "gpu0-2g-20gb-at2",
			"gpu0-3g-40gb-at0", "gpu0-4g-40gb-at0", "gpu0-7g-80gb-at0"}
		for _, name := range over {
			if got := m.Taint(name); got != c.want {
				t.Fatalf("%s at 2: %s tainted %q, want %q", label, name, got, c.want)
			}
		}
		for _, name := range []string{"gpu0-1g-10gb-at1", "gpu0-1g-10gb-at3", "gpu0-2g-20gb-at0", "gpu0-3g-40gb-at4"} {
			if got := m.Taint(name); got != "" {
				t.Fatalf("%s at 2: %s, clear of it, tainted %q", label, name, got)
			}
		}
		devices := devicesOf(m)
		if len(devices) != 25 {
			t.Fatalf("%s at 2: %d devices published, want all 25 of the H100", label, len(devices))
		}
		if c.want == "" {
			continue
		}
		for i, d := range devices {
			tainted := len(d.Taints) == 1 && d.Taints[0] == resourceapi.DeviceTaint{Key: dra.TaintKey, Value: c.want,
				Effect: resourceapi.DeviceTaintEffectNoSchedule}
			if tainted != (i >= len(devices)-len(over)) || tainted != slices.Contains(over, d.Name) {
				t.Fatalf("%s at 2: device %d %s taints %+v; want the %d over it last, tainted", label, i, d.Name, d.Taints, len(over))
			}
		}
	}
}

// The view the trim will leave once it freed the devices named to keep free: the IDLE instances
// over one are neither warm nor in the way, so the slices steer no claim onto an instance being
// destroyed, and the freed device comes with the free ones.
func TestTheTrimmedViewDropsTheIdleInstancesOverTheDevicesToKeepFree(t *testing.T) {
	at := func(start, size uint32) migclient.Placement { return migclient.Placement{Start: start, Size: size} }
	v := view(map[dra.Placed]bool{
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(0, 1)}: true,
		{GPUUUID: "GPU-0", Profile: "1g.10gb", Placement: at(6, 1)}: true,
	})
	gpus := []dra.GPU{{Index: 0, UUID: "GPU-0", Profiles: simProfiles(t, "h100-80gb")}}
	var next []dra.Device
	for _, d := range dra.NewModel("node-m", gpus, v).NextCold() {
		if d.Profile == "7g.80gb" {
			next = append(next, d)
		}
	}
	if len(next) != 1 || next[0].Name != "gpu0-7g-80gb-at0" {
		t.Fatalf("next cold 7g.80gb: %+v", next)
	}
	devices := devicesOf(dra.NewModel("node-m", gpus, v.Trimmed(next)))
	for _, d := range devices {
		if *d.Attributes[dra.AttrWarm].BoolValue {
			t.Fatalf("%s warm in the trimmed view, which has no IDLE instance left", d.Name)
		}
	}
	if devices[0].Name != "gpu0-1g-10gb-at0" {
		t.Fatalf("first %s, want gpu0-1g-10gb-at0, free once trimmed", devices[0].Name)
	}
	if len(v.Warm) != 2 || len(v.Idle["GPU-0"]) != 2 {
		t.Fatalf("Trimmed changed the view it was called on: %+v", v)
	}
}
