package kubeapi_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// The DRA plugin itself (package dra) publishing to the real API server, its slices read by the
// real kube-scheduler, and kubelet (the fake) preparing what the scheduler allocated, over the
// fake sidecar: what the slices offer is what prepare can do, and a plain claim lands warm.

// pluginNode starts the plugin for a new ready node (named after the test) over a fake sidecar of
// gpus, each of which the table of the fake's profiles (1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb), and
// waits for its first slices. Setup puts instances in the fake before the plugin reads it.
func pluginNode(t *testing.T, s *kubeapi.Server, gpus []string, setup func(*fakesidecar.Server)) (*fakesidecar.Server, *fakekubelet.Node) {
	t.Helper()
	ctx := context.Background()
	admin := s.Client(t, kubeapi.AdminUser)
	name := namespace(t, admin)
	// Registered first, so it runs after the plugin stopped: no later pod lands on this node.
	t.Cleanup(func() {
		_ = admin.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
		_ = admin.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: resourcev1.ResourceSliceSelectorNodeName + "=" + name})
	})
	fake, socket := fakesidecar.Start(t, gpus...)
	if setup != nil {
		setup(fake)
	}
	c, err := migclient.New(ctx, socket, migclient.Options{AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	node := fakekubelet.Start(ctx, t, s, c, dra.Options{NodeName: name, Poll: 50 * time.Millisecond, MinInterval: 100 * time.Millisecond})
	kubeapi.ReadyNode(ctx, t, admin, name)
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool { return len(ds) > 0 })
	return fake, node
}

// run creates a pod with a claim for request on the node, waits for the scheduler to bind it
// there and for the fake kubelet to prepare it, and answers the device it got.
func run(ctx context.Context, t *testing.T, s *kubeapi.Server, node *fakekubelet.Node, name string, request resourcev1.DeviceRequest) string {
	t.Helper()
	kubeapi.PodWithClaim(t, node.Admin, node.Name, name, request)
	claim := s.Bound(t, node.Name, name, node.Name)
	got := claim.Status.Allocation.Devices.Results
	if len(got) != 1 || got[0].Pool != dra.PoolName(node.Name) {
		t.Fatalf("%s: allocation %+v, want one device of pool %s", name, got, dra.PoolName(node.Name))
	}
	resp, err := node.Prepare(ctx, claim)
	if err != nil || resp.GetError() != "" {
		t.Fatalf("%s: prepare of %s: %+v %v", name, got[0].Device, resp, err)
	}
	return got[0].Device
}

// gpuIs is a claim for one device of profile on the GPU with that UUID.
func gpuIs(profile, uuid string) resourcev1.DeviceRequest {
	r := claimFor(profile)
	r.Exactly.Selectors[0].CEL.Expression += fmt.Sprintf(` && device.attributes[%q].gpuUUID == %q`, driver, uuid)
	return r
}

// A GPU instance the sidecar does not own, an instance of HAMi's path (a pod's) and an ERROR one
// are in the way of some placements: every device over them is published tainted, with the reason,
// so the scheduler gives a plain claim the first placement clear of them and a 7g.80gb none (the
// pod stays Pending, its claim unallocated, rather than bound to a prepare that must fail), and
// once they are gone the taints go and their placements are given again.
func TestTheSlicesTaintEveryPlacementPrepareMustRefuseAndUntaintItOnceFree(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	ctx := context.Background()
	var blockers []*fakesidecar.Instance
	fake, node := pluginNode(t, s, []string{"GPU-0"}, func(f *fakesidecar.Server) {
		blockers = []*fakesidecar.Instance{
			f.Put(fakesidecar.Instance{GPU: "GPU-0", Profile: "1g.10gb", Start: 0, Size: 1, Foreign: true}),
			f.Put(fakesidecar.Instance{GPU: "GPU-0", Profile: "1g.10gb", Start: 1, Size: 1, State: pb.InstanceState_ACTIVE,
				Owner: &fakesidecar.Key{PodUID: "hami-pod"}}),
			f.Put(fakesidecar.Instance{GPU: "GPU-0", Profile: "1g.10gb", Start: 2, Size: 1, State: pb.InstanceState_ERROR}),
		}
	})
	devices := node.Devices(ctx, t, func([]resourcev1.Device) bool { return true })
	for name, want := range map[string]string{"gpu0-1g-10gb-at0": dra.TaintForeign, "gpu0-1g-10gb-at1": dra.TaintPodInstance,
		"gpu0-1g-10gb-at2": dra.TaintErrorInstance, "gpu0-2g-20gb-at0": dra.TaintForeign, "gpu0-3g-40gb-at0": dra.TaintForeign,
		"gpu0-7g-80gb-at0": dra.TaintForeign, "gpu0-1g-10gb-at3": ""} {
		if got := fakekubelet.Taint(devices, name); got != want {
			t.Errorf("%s: taint %q, want %q", name, got, want)
		}
	}

	if got := run(ctx, t, s, node, "plain", claimFor("1g.10gb")); got != "gpu0-1g-10gb-at3" {
		t.Fatalf("a plain 1g.10gb claim got %s, want the first placement clear of them, gpu0-1g-10gb-at3", got)
	}
	kubeapi.PodWithClaim(t, node.Admin, node.Name, "whole", claimFor("7g.80gb"))
	kubeapi.Unschedulable(t, node.Admin, node.Name, "whole")

	// The foreign GI destroyed by its owner, the pod's instance released and reclaimed, the ERROR
	// one destroyed by the reconciler.
	for _, in := range blockers {
		fake.Destroy(in.MigUUID)
	}
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool { return fakekubelet.Taint(ds, "gpu0-1g-10gb-at0") == "" })
	if got := run(ctx, t, s, node, "again", claimFor("1g.10gb")); got != "gpu0-1g-10gb-at0" {
		t.Fatalf("once free, a plain 1g.10gb claim got %s, want gpu0-1g-10gb-at0", got)
	}
}

// A claim's allocated device keeps counting while a republish taints it: the 7g.80gb a claim was
// allocated (not yet prepared) comes under a foreign GPU instance, and the next claim, for a
// 1g.10gb clear of that instance, stays Pending (the 7g.80gb's counters hold every memory slice)
// until the first claim is gone. A plugin that stopped publishing the device would let the
// scheduler forget those counters and give the second claim a placement the first one's prepare
// then finds taken.
func TestADeviceAClaimWasAllocatedKeepsItsCountersWhenARepublishTaintsIt(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	ctx := context.Background()
	fake, node := pluginNode(t, s, []string{"GPU-0"}, nil)
	kubeapi.PodWithClaim(t, node.Admin, node.Name, "whole", claimFor("7g.80gb"))
	if got := s.Bound(t, node.Name, "whole", node.Name).Status.Allocation.Devices.Results[0].Device; got != "gpu0-7g-80gb-at0" {
		t.Fatalf("the 7g.80gb claim got %s", got)
	}
	fake.Put(fakesidecar.Instance{GPU: "GPU-0", Profile: "1g.10gb", Start: 6, Size: 1, Foreign: true})
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool {
		return fakekubelet.Taint(ds, "gpu0-7g-80gb-at0") == dra.TaintForeign
	})

	kubeapi.PodWithClaim(t, node.Admin, node.Name, "small", claimFor("1g.10gb"))
	kubeapi.Unschedulable(t, node.Admin, node.Name, "small")

	if err := node.Admin.CoreV1().Pods(node.Name).Delete(ctx, "whole", *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
	if err := kubeapi.DeleteClaim(ctx, node.Admin, node.Name, "whole"); err != nil {
		t.Fatal(err)
	}
	if got := s.Bound(t, node.Name, "small", node.Name).Status.Allocation.Devices.Results[0].Device; got != "gpu0-1g-10gb-at0" {
		t.Fatalf("once the 7g.80gb claim is gone, the 1g.10gb claim got %s, want gpu0-1g-10gb-at0", got)
	}
}

// A GPU the sidecar cannot read (lost: GetState answers it unreadable, the others as usual) costs
// its own devices only: all of them are tainted, so a claim for that GPU stays Pending with its
// claim unallocated, while the healthy GPU's slices still follow its IDLE set; once the GPU reads
// again the taints go.
func TestALostGPUCostsItsOwnDevicesOnlyAndTheOthersStillFollowTheirIdleSet(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	ctx := context.Background()
	fake, node := pluginNode(t, s, []string{"GPU-0", "GPU-1"}, nil)
	fake.Unreadable("GPU-1", "read GPU GPU-1: NVML_ERROR: GPU is lost")
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool {
		return fakekubelet.Taint(ds, "gpu0-1g-10gb-at0") == "" && !slices.ContainsFunc(ds, func(d resourcev1.Device) bool {
			return strings.HasPrefix(d.Name, "gpu1-") && fakekubelet.Taint(ds, d.Name) != dra.TaintGPUUnreadable
		})
	})

	kubeapi.PodWithClaim(t, node.Admin, node.Name, "on-lost", gpuIs("1g.10gb", "GPU-1"))
	kubeapi.Unschedulable(t, node.Admin, node.Name, "on-lost")

	// An instance goes IDLE on the healthy GPU: its device turns warm and first.
	put := time.Now()
	fake.Put(fakesidecar.Instance{GPU: "GPU-0", Profile: "2g.20gb", Start: 4, Size: 2, State: pb.InstanceState_IDLE})
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool {
		return ds[0].Name == "gpu0-2g-20gb-at4" && *ds[0].Attributes[dra.AttrWarm].BoolValue
	})
	t.Logf("the healthy GPU's IDLE instance published warm %v after it appeared, the other GPU lost", time.Since(put).Round(time.Millisecond))

	fake.Unreadable("GPU-1", "")
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool { return fakekubelet.Taint(ds, "gpu1-1g-10gb-at0") == "" })
	if got := s.Bound(t, node.Name, "on-lost", node.Name).Status.Allocation.Devices.Results[0].Device; got != "gpu1-1g-10gb-at0" {
		t.Fatalf("once GPU-1 reads again, its claim got %s, want gpu1-1g-10gb-at0", got)
	}
}

// With the node's only warm 1g.10gb on gpu3 of 11, a plain claim for the profile (no
// firstAvailable) lands on it; the next, with none warm left and gpu0 and gpu1 full (HAMi's pods
// hold them whole), takes gpu2's first free placement, not gpu10's.
func TestAPlainClaimLandsWarmOnGPU3Of11AndColdOnGPU2NotGPU10(t *testing.T) {
	s := kubeapi.GetWithScheduler(t)
	ctx := context.Background()
	gpus := make([]string, 11)
	for i := range gpus {
		gpus[i] = fmt.Sprintf("GPU-%d", i)
	}
	fake, node := pluginNode(t, s, gpus, func(f *fakesidecar.Server) {
		f.Put(fakesidecar.Instance{GPU: "GPU-3", Profile: "1g.10gb", Start: 5, Size: 1, State: pb.InstanceState_IDLE})
	})
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool { return ds[0].Name == "gpu3-1g-10gb-at5" })
	if got := run(ctx, t, s, node, "warm", claimFor("1g.10gb")); got != "gpu3-1g-10gb-at5" {
		t.Fatalf("a plain 1g.10gb claim got %s, want the warm gpu3-1g-10gb-at5", got)
	}
	if in := fake.Instances(); len(in) != 1 || in[0].State != pb.InstanceState_ACTIVE {
		t.Fatalf("the warm claim's prepare: %+v, want the IDLE instance ACTIVE and none created", in)
	}

	for _, g := range []string{"GPU-0", "GPU-1"} {
		fake.Put(fakesidecar.Instance{GPU: g, Profile: "7g.80gb", Start: 0, Size: 8, State: pb.InstanceState_ACTIVE,
			Owner: &fakesidecar.Key{PodUID: "hami-" + g}})
	}
	node.Devices(ctx, t, func(ds []resourcev1.Device) bool {
		return fakekubelet.Taint(ds, "gpu0-1g-10gb-at0") == dra.TaintPodInstance && fakekubelet.Taint(ds, "gpu1-1g-10gb-at0") == dra.TaintPodInstance
	})
	if got := run(ctx, t, s, node, "cold", claimFor("1g.10gb")); got != "gpu2-1g-10gb-at0" {
		t.Fatalf("a plain 1g.10gb claim with gpu0 and gpu1 full got %s, want gpu2-1g-10gb-at0", got)
	}
}

// A claim asking for adminAccess to a device of the class is refused when it is written, with the
// reason, by deploy/dra/deviceclass.yaml's policy (in a namespace labelled for admin access, where
// the API server itself allows it): no pod is bound to wait on a prepare that must refuse it.
func TestAnAdminAccessClaimIsRefusedWithItsReasonBeforeAnyBinding(t *testing.T) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	a := newApplier(t, s)
	for _, obj := range objects(t, draClass, file(t, draClass)) {
		a.install(t, obj)
	}
	ctx := context.Background()
	ns := namespace(t, admin)
	labelled, err := admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	labelled.Labels = map[string]string{"resource.kubernetes.io/admin-access": "true"}
	if _, err := admin.CoreV1().Namespaces().Update(ctx, labelled, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	request := claimFor("1g.10gb")
	request.Exactly.AdminAccess = new(true)
	claim := func(name string) *resourcev1.ResourceClaim {
		return &resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{request}}}}
	}
	// The policy takes effect once the server has loaded it.
	var refusal error
	for i, deadline := 0, time.Now().Add(60*time.Second); refusal == nil; i++ {
		if _, refusal = admin.ResourceV1().ResourceClaims(ns).Create(ctx, claim(fmt.Sprintf("admin-%d", i)), metav1.CreateOptions{}); refusal == nil {
			if time.Now().After(deadline) {
				t.Fatal("the policy never refused a claim for adminAccess to a mig.hami.io device")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if !strings.Contains(refusal.Error(), "adminAccess to a mig.hami.io device is not supported") {
		t.Fatalf("the claim for adminAccess: %v", refusal)
	}
	template := &resourcev1.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "admin"},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: claim("").Spec}}
	if _, err := admin.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, template, metav1.CreateOptions{}); err == nil ||
		!strings.Contains(err.Error(), "adminAccess to a mig.hami.io device is not supported") {
		t.Fatalf("the template for adminAccess: %v", err)
	}
	plain := claim("plain")
	plain.Spec.Devices.Requests[0].Exactly.AdminAccess = nil
	if _, err := admin.ResourceV1().ResourceClaims(ns).Create(ctx, plain, metav1.CreateOptions{}); err != nil {
		t.Fatalf("a plain claim of the class: %v", err)
	}
}
