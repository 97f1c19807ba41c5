package kubeapi_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
)

// The DRA driver's names, as the plugin publishes them.
const (
	driver      = "mig.hami.io"
	deviceClass = "mig.hami.io"
	gpuIndex    = 0
)

// placement is one (profile, placement) of an H100-80GB: memory slices [start, start+size).
type placement struct {
	profile     string
	start, size int
}

// h100 is the H100-80GB's GPU instance placements, a profile's in ascending start.
var h100 = func() []placement {
	var out []placement
	for _, p := range []struct {
		profile string
		starts  []int
		size    int
	}{
		{"1g.10gb", []int{0, 1, 2, 3, 4, 5, 6}, 1},
		{"1g.20gb", []int{0, 2, 4, 6}, 2},
		{"2g.20gb", []int{0, 2, 4}, 2},
		{"3g.40gb", []int{0, 4}, 4},
		{"4g.40gb", []int{0}, 4},
		{"7g.80gb", []int{0}, 8},
	} {
		for _, start := range p.starts {
			out = append(out, placement{p.profile, start, p.size})
		}
	}
	return out
}()

func (p placement) device() string {
	return fmt.Sprintf("gpu%d-%s-at%d", gpuIndex, strings.NewReplacer(".", "-", "+", "-").Replace(p.profile), p.start)
}

func (p placement) slices() []int {
	var out []int
	for s := p.start; s < p.start+p.size; s++ {
		out = append(out, s)
	}
	return out
}

// byDevice finds the placement a device name stands for.
func byDevice(t *testing.T, name string) placement {
	t.Helper()
	for _, p := range h100 {
		if p.device() == name {
			return p
		}
	}
	t.Fatalf("no placement has device name %s", name)
	return placement{}
}

// draNode creates the test's namespace and a Node of that name with room for pods (no kubelet runs,
// so the test writes its status), removed when the test ends so no later pod lands there.
func draNode(t *testing.T, admin kubernetes.Interface) string {
	t.Helper()
	name := namespace(t, admin)
	ctx := context.Background()
	kubeapi.ReadyNode(ctx, t, admin, name)
	t.Cleanup(func() { _ = admin.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}) })
	kubeapi.DeviceClass(ctx, t, admin, deviceClass, driver)
	return name
}

// publish writes node's pool for GPU 0 as the plugin shapes it: one slice with the GPU's counter set
// (a counter per memory slice) and one with a device per placement in the order given, each consuming
// the memory slices of its placement; warm marks the placements an IDLE instance of exactly that
// profile sits at.
func publish(t *testing.T, admin kubernetes.Interface, node string, devices []placement, warm map[placement]bool) {
	t.Helper()
	pool := resourcev1.ResourcePool{Name: fmt.Sprintf("%s-gpu%d", node, gpuIndex), Generation: 1, ResourceSliceCount: 2}
	counterSet := fmt.Sprintf("gpu%d", gpuIndex)
	counters := map[string]resourcev1.Counter{}
	for s := range 8 {
		counters[fmt.Sprintf("memory-slice-%d", s)] = resourcev1.Counter{Value: resource.MustParse("1")}
	}
	var list []resourcev1.Device
	for _, p := range devices {
		consumed := map[string]resourcev1.Counter{}
		for _, s := range p.slices() {
			consumed[fmt.Sprintf("memory-slice-%d", s)] = resourcev1.Counter{Value: resource.MustParse("1")}
		}
		profile, start, size, isWarm := p.profile, int64(p.start), int64(p.size), warm[p]
		uuid := fmt.Sprintf("GPU-%s-0", node)
		list = append(list, resourcev1.Device{Name: p.device(),
			Attributes: map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{
				"profile": {StringValue: &profile}, "gpuUUID": {StringValue: &uuid},
				"placementStart": {IntValue: &start}, "placementSize": {IntValue: &size}, "warm": {BoolValue: &isWarm}},
			Capacity: map[resourcev1.QualifiedName]resourcev1.DeviceCapacity{
				"memory": {Value: *resource.NewQuantity(size*10<<30, resource.BinarySI)}},
			ConsumesCounters: []resourcev1.DeviceCounterConsumption{{CounterSet: counterSet, Counters: consumed}}})
	}
	ctx := context.Background()
	for _, spec := range []resourcev1.ResourceSliceSpec{
		{SharedCounters: []resourcev1.CounterSet{{Name: counterSet, Counters: counters}}},
		{Devices: list},
	} {
		spec.Driver, spec.Pool, spec.NodeName = driver, pool, &node
		slice := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{GenerateName: pool.Name + "-"}, Spec: spec}
		if _, err := admin.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_ = admin.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	})
}

// profileIs is the CEL selector of a device of profile.
func profileIs(profile string) []resourcev1.DeviceSelector {
	return []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{
		Expression: fmt.Sprintf(`device.attributes[%q].profile == %q`, driver, profile)}}}
}

// claimFor asks for one device of profile.
func claimFor(profile string) resourcev1.DeviceRequest {
	return resourcev1.DeviceRequest{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{
		DeviceClassName: deviceClass, Selectors: profileIs(profile)}}
}

// warmFirst asks for a device of profile, an IDLE instance's ("gpu/warm") if there is one, else any
// ("gpu/any").
func warmFirst(profile string) resourcev1.DeviceRequest {
	warm := profileIs(profile)
	warm[0].CEL.Expression += fmt.Sprintf(` && device.attributes[%q].warm`, driver)
	return resourcev1.DeviceRequest{Name: "gpu", FirstAvailable: []resourcev1.DeviceSubRequest{
		{Name: "warm", DeviceClassName: deviceClass, Selectors: warm},
		{Name: "any", DeviceClassName: deviceClass, Selectors: profileIs(profile)}}}
}

// device is the one device of results, checked to be this driver's in node's pool for GPU 0.
func device(t *testing.T, node string, results []resourcev1.DeviceRequestAllocationResult) resourcev1.DeviceRequestAllocationResult {
	t.Helper()
	if len(results) != 1 || results[0].Driver != driver || results[0].Pool != fmt.Sprintf("%s-gpu%d", node, gpuIndex) {
		t.Fatalf("allocation %+v: want one device of %s in pool %s-gpu%d", results, driver, node, gpuIndex)
	}
	return results[0]
}

// Pods whose claims ask for MIG profiles by CEL are scheduled by the real kube-scheduler onto the node
// that publishes the pool, their claims get devices whose memory slices never overlap, a pod that no
// longer fits stays Pending with its claim unallocated, and it is scheduled once another pod and its
// claim are deleted.
func TestSchedulerAllocatesMIGDevicesWithoutOverlappingMemorySlices(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	admin := s.Client(t, kubeapi.AdminUser)
	node := draNode(t, admin)
	publish(t, admin, node, h100, nil)

	used := map[int]string{}
	for i, profile := range []string{"3g.40gb", "2g.20gb", "1g.10gb"} {
		name := fmt.Sprintf("fits-%d", i)
		kubeapi.PodWithClaim(t, admin, node, name, claimFor(profile))
		got := byDevice(t, device(t, node, s.Bound(t, node, name, node).Status.Allocation.Devices.Results).Device)
		if got.profile != profile {
			t.Fatalf("%s asked for %s and got %s", name, profile, got.device())
		}
		for _, s := range got.slices() {
			if holder, taken := used[s]; taken {
				t.Fatalf("%s got %s, whose memory slice %d %s already holds", name, got.device(), s, holder)
			}
			used[s] = got.device()
		}
	}
	// 3g, 2g and 1g hold seven of the eight memory slices, and a 1g.10gb has no placement on the eighth.
	if len(used) != 7 || used[7] != "" {
		t.Fatalf("memory slices used: %v", used)
	}
	kubeapi.PodWithClaim(t, admin, node, "no-fit", claimFor("1g.10gb"))
	kubeapi.Unschedulable(t, admin, node, "no-fit")

	ctx := context.Background()
	if err := admin.CoreV1().Pods(node).Delete(ctx, "fits-1", *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	if err := kubeapi.DeleteClaim(ctx, admin, node, "fits-1"); err != nil {
		t.Fatal(err)
	}
	if got := device(t, node, s.Bound(t, node, "no-fit", node).Status.Allocation.Devices.Results).Device; got != "gpu0-1g-10gb-at4" {
		t.Fatalf("no-fit got %s once the 2g.20gb at 4 was deleted; want gpu0-1g-10gb-at4", got)
	}
}

// The scheduler allocates the first fitting device in the order the slice lists them, not by name or
// placement: the plugin lists the warm devices of a profile first to have them chosen.
func TestSchedulerTakesTheFirstFittingDeviceInSliceOrder(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	admin := s.Client(t, kubeapi.AdminUser)
	node := draNode(t, admin)
	order := slices.Clone(h100)
	slices.Reverse(order) // 7g first, then 4g, ..., 1g.10gb at 6 down to 0
	publish(t, admin, node, order, nil)

	for i, want := range []string{"gpu0-1g-10gb-at6", "gpu0-1g-10gb-at5", "gpu0-2g-20gb-at2"} {
		profile := byDevice(t, want).profile
		name := fmt.Sprintf("first-%d", i)
		kubeapi.PodWithClaim(t, admin, node, name, claimFor(profile))
		if got := device(t, node, s.Bound(t, node, name, node).Status.Allocation.Devices.Results).Device; got != want {
			t.Fatalf("%s (%s) got %s; the first fitting device in slice order is %s", name, profile, got, want)
		}
	}
}

// A claim's firstAvailable list (DRAPrioritizedList, GA in 1.36) prefers a device with warm == true
// over any device of the profile, wherever the warm one sits in the slice; once it is taken, the next
// claim gets the first other device through the second subrequest.
func TestFirstAvailablePrefersAWarmDevice(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	admin := s.Client(t, kubeapi.AdminUser)
	node := draNode(t, admin)
	warm := placement{"1g.10gb", 5, 1}
	publish(t, admin, node, h100, map[placement]bool{warm: true})

	for i, want := range []struct{ device, request string }{
		{warm.device(), "gpu/warm"},
		{"gpu0-1g-10gb-at0", "gpu/any"},
	} {
		name := fmt.Sprintf("warm-first-%d", i)
		kubeapi.PodWithClaim(t, admin, node, name, warmFirst("1g.10gb"))
		got := device(t, node, s.Bound(t, node, name, node).Status.Allocation.Devices.Results)
		if got.Device != want.device || got.Request != want.request {
			t.Fatalf("%s got %s for request %s, want %s for %s", name, got.Device, got.Request, want.device, want.request)
		}
	}
}
