package dra_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	"k8s.io/utils/ptr"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func fakeNode(ctx context.Context, t *testing.T, node string, opts dra.Options) (*fakesidecar.Server, *migclient.Client, *fakekubelet.Node) {
	t.Helper()
	s := kubeapi.Get(t)
	fake, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	c, err := migclient.New(ctx, socket, migclient.Options{CallTimeout: 5 * time.Second, AllocateTimeout: 5 * time.Second,
		Backoff: migclient.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond}, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	opts.NodeName = node
	return fake, c, fakekubelet.Start(ctx, t, s, c, opts)
}

// instance is the fake's instance with that MIG UUID.
func instance(t *testing.T, fake *fakesidecar.Server, mig string) fakesidecar.Instance {
	t.Helper()
	for _, in := range fake.Instances() {
		if in.MigUUID == mig {
			return in
		}
	}
	t.Fatalf("no instance %s", mig)
	return fakesidecar.Instance{}
}

func warmFirst(name string) func([]resourceapi.Device) bool {
	return func(ds []resourceapi.Device) bool {
		for _, d := range ds {
			if d.Name == name {
				return *d.Attributes[dra.AttrWarm].BoolValue
			}
		}
		return false
	}
}

func cdiMIG(t *testing.T, cdi []string) string {
	t.Helper()
	if len(cdi) != 1 {
		t.Fatalf("CDI devices %v, want one", cdi)
	}
	_, mig, ok := strings.Cut(cdi[0], "=")
	if !ok {
		t.Fatalf("CDI device %q is not qualified", cdi[0])
	}
	return mig
}

func TestAFakeKubeletPreparesAClaimTwiceUnpreparesItToAWarmDeviceAndRefusesAForeignOne(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-k", dra.Options{})
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	pool := dra.PoolName("node-k")

	claim := node.Claim(ctx, t, "default", "one", [2]string{pool, "gpu0-2g-20gb-at4"})
	first, err := node.Prepare(ctx, claim)
	if err != nil || first.GetError() != "" {
		t.Fatalf("prepare: %+v %v", first, err)
	}
	mig := cdiMIG(t, fakekubelet.CDIDevices(first))
	in := instance(t, fake, mig)
	if in.State != pb.InstanceState_ACTIVE || in.GPU != "GPU-a" || in.Profile != "2g.20gb" || in.Start != 4 ||
		in.Owner == nil || in.Owner.ClaimUID != string(claim.UID) {
		t.Fatalf("the prepared instance: %+v", in)
	}
	if d := first.GetDevices()[0]; d.GetPoolName() != pool || d.GetDeviceName() != "gpu0-2g-20gb-at4" || d.GetRequestNames()[0] != "gpu" {
		t.Fatalf("the prepared device: %+v", d)
	}
	again, err := node.Prepare(ctx, claim)
	if err != nil || cdiMIG(t, fakekubelet.CDIDevices(again)) != mig || len(fake.Instances()) != 1 {
		t.Fatalf("a repeated prepare: %+v %v, instances %+v", again, err, fake.Instances())
	}

	// A device of another node's pool, and a device this plugin never published: per-claim errors, nothing created.
	for i, pair := range [][2]string{{"node-other-gpu0", "gpu0-2g-20gb-at0"}, {pool, "gpu0-9g-90gb-at0"}} {
		other := node.Claim(ctx, t, "default", []string{"foreign", "unknown"}[i], pair)
		got, err := node.Prepare(ctx, other)
		if err != nil || !strings.Contains(got.GetError(), "not one this plugin publishes") || len(got.GetDevices()) != 0 {
			t.Fatalf("prepare of %v: %+v %v", pair, got, err)
		}
	}
	if len(fake.Instances()) != 1 {
		t.Fatalf("a refused claim changed the table: %+v", fake.Instances())
	}

	if err := node.Unprepare(ctx, claim); err != nil {
		t.Fatal(err)
	}
	if in := instance(t, fake, mig); in.State != pb.InstanceState_IDLE {
		t.Fatalf("after unprepare: %+v", in)
	}
	if err := node.Unprepare(ctx, claim); err != nil {
		t.Fatalf("a repeated unprepare: %v", err)
	}
	// Republished: the IDLE instance's device is warm, and first of its pool.
	devices := node.Devices(ctx, t, warmFirst("gpu0-2g-20gb-at4"))
	if devices[0].Name != "gpu0-2g-20gb-at4" {
		t.Fatalf("the warm device is not first: %s", devices[0].Name)
	}

	// A fault turns it cold, never advertised as warm again, and kubelet's health watch reads its
	// device Unhealthy.
	watch := node.WatchHealth(ctx, t)
	fake.Fault(mig, 79)
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return !warmFirst("gpu0-2g-20gb-at4")(ds) })
	for unhealthy := false; !unhealthy; {
		resp, err := watch.Recv()
		if err != nil {
			t.Fatalf("health watch: %v", err)
		}
		for _, h := range resp.GetDevices() {
			unhealthy = unhealthy || h.GetDevice().GetPoolName() == pool && h.GetDevice().GetDeviceName() == "gpu0-2g-20gb-at4" &&
				h.GetHealth() == drahealth.HealthStatus_UNHEALTHY
		}
	}
	if pool, device, ok := node.Driver.ResolveHealth(&pb.InstanceHealthUpdate{GpuUuid: "GPU-a", Profile: "2g.20gb",
		Placement: &pb.Placement{Start: 4, Size: 2}}); !ok || pool != "node-k" || device != "gpu0-2g-20gb-at4" {
		t.Fatalf("ResolveHealth: %s %s %v", pool, device, ok)
	}
}

func TestRecoveryReleasesTheInstancesOfClaimsGoneOrMovedAndKeepsTheOthers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, c, node := fakeNode(ctx, t, "node-r", dra.Options{})
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	pool := dra.PoolName("node-r")
	prepare := func(name, device string) (*resourceapi.ResourceClaim, string) {
		claim := node.Claim(ctx, t, "default", name, [2]string{pool, device})
		got, err := node.Prepare(ctx, claim)
		if err != nil || got.GetError() != "" {
			t.Fatalf("prepare %s: %+v %v", name, got, err)
		}
		return claim, cdiMIG(t, fakekubelet.CDIDevices(got))
	}
	_, kept := prepare("kept", "gpu1-1g-10gb-at0")
	deleted, deletedMIG := prepare("deleted", "gpu1-1g-10gb-at1")
	moved, movedMIG := prepare("moved", "gpu1-1g-10gb-at2")
	// A pod's instance on the same GPU: recovery never looks at it.
	pod, err := c.Allocate(ctx, migclient.AllocateRequest{Pod: migclient.PodRef{UID: "pod-1"}, ContainerName: "main",
		Devices: []migclient.DeviceRequest{{GPUUUID: "GPU-b", Profile: "1g.10gb", Placement: migclient.Placement{Start: 6, Size: 1}}}})
	if err != nil {
		t.Fatal(err)
	}

	// The plugin is down; meanwhile a claim is deleted and another reallocated to another node.
	node.Stop()
	if err := node.Admin.ResourceV1().ResourceClaims("default").Delete(ctx, deleted.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// An allocation is immutable: the scheduler deallocates, then allocates anew.
	allocation := moved.Status.Allocation
	moved.Status.Allocation = nil
	moved, err = node.Admin.ResourceV1().ResourceClaims("default").UpdateStatus(ctx, moved, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	allocation.Devices.Results[0].Pool = "node-elsewhere-gpu1"
	moved.Status.Allocation = allocation
	if _, err := node.Admin.ResourceV1().ResourceClaims("default").UpdateStatus(ctx, moved, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	restarted, err := dra.New(c, node.Admin, dra.Options{NodeName: "node-r"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = restarted.Close() }()
	if err := restarted.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[string]pb.InstanceState{kept: pb.InstanceState_ACTIVE, deletedMIG: pb.InstanceState_IDLE,
		movedMIG: pb.InstanceState_IDLE, pod.Devices[0].MigUUID: pb.InstanceState_ACTIVE}
	for mig, state := range want {
		if got := instance(t, fake, mig).State; got != state {
			t.Errorf("%s: %s, want %s", mig, got, state)
		}
	}
}

func TestDestroyAtUnprepareLeavesNoInstanceBehindAndNoDeviceWarm(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-d", dra.Options{DestroyAtUnprepare: true})
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	claim := node.Claim(ctx, t, "default", "per-claim", [2]string{dra.PoolName("node-d"), "gpu0-1g-10gb-at2"})
	if got, err := node.Prepare(ctx, claim); err != nil || got.GetError() != "" || len(fake.Instances()) != 1 {
		t.Fatalf("prepare: %+v %v, instances %+v", got, err, fake.Instances())
	}
	if err := node.Unprepare(ctx, claim); err != nil {
		t.Fatal(err)
	}
	if err := node.Unprepare(ctx, claim); err != nil {
		t.Fatalf("a repeated unprepare: %v", err)
	}
	if in := fake.Instances(); len(in) != 0 {
		t.Fatalf("after unprepare the table holds %+v, want nothing", in)
	}
	if m := node.Driver.Model(); m == nil {
		t.Fatal("no model")
	} else if d, _ := m.Lookup(dra.PoolName("node-d"), "gpu0-1g-10gb-at2"); d.Warm {
		t.Fatal("a destroyed instance's device is warm")
	}
}

func TestThePluginRecoversTheSidecarOnlyWhenToldItIsItsOnlyClient(t *testing.T) {
	ctx := context.Background()
	fake, socket := fakesidecar.Start(t, "GPU-a")
	fake.Unrecover()
	sync := func(opts dra.Options, list migclient.ListActiveFunc, within time.Duration) error {
		c, err := migclient.New(ctx, socket, migclient.Options{CallTimeout: time.Second, ListActive: list, AllowSimulatedBackend: true})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }()
		d, err := dra.New(c, nil, opts)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = d.Close() }()
		sctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		return d.Sync(sctx)
	}
	recovered := func() bool {
		info, err := fake.GetInfo(ctx, &pb.GetInfoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return info.GetRecovered()
	}

	// Beside HAMi's plugin: it waits for HAMi's recovery, and gives up only with its context.
	if err := sync(dra.Options{NodeName: "n"}, nil, 500*time.Millisecond); err == nil || !strings.Contains(err.Error(), "--recover-sidecar") {
		t.Fatalf("Sync of an unrecovered sidecar: %v", err)
	}
	if recovered() {
		t.Fatal("the plugin recovered a sidecar it shares")
	}
	// Alone: it recovers it with no pod.
	if err := sync(dra.Options{NodeName: "n", RecoverSidecar: true}, dra.RecoverNoPods, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if !recovered() || len(fake.Recovers()) != 1 || len(fake.Recovers()[0].GetActive()) != 0 {
		t.Fatalf("recovered %t after %+v", recovered(), fake.Recovers())
	}
}

func TestAClaimOfTwoDevicesOnTwoGPUsIsPreparedInOneAllocateOwnedByTheClaim(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-2", dra.Options{})
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	claim := node.Claim(ctx, t, "default", "pair", [2]string{dra.PoolName("node-2"), "gpu0-3g-40gb-at4"},
		[2]string{dra.PoolName("node-2"), "gpu1-7g-80gb-at0"})
	got, err := node.Prepare(ctx, claim)
	if err != nil || got.GetError() != "" || len(fakekubelet.CDIDevices(got)) != 2 {
		t.Fatalf("prepare: %+v %v", got, err)
	}
	for i, want := range []struct{ gpu, profile string }{{"GPU-a", "3g.40gb"}, {"GPU-b", "7g.80gb"}} {
		in := instance(t, fake, cdiMIG(t, fakekubelet.CDIDevices(got)[i:i+1]))
		if in.GPU != want.gpu || in.Profile != want.profile || in.Owner == nil || in.Owner.ClaimUID != string(claim.UID) ||
			in.Owner.DeviceIndex != uint32(i) || got.GetDevices()[i].GetPoolName() != dra.PoolName("node-2") {
			t.Fatalf("device %d: %+v for %+v", i, in, got.GetDevices()[i])
		}
	}
}

func TestAPreparedClaimGivesEachContainerTheDriversCDIDeviceOnceBesideItsInstances(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-3", dra.Options{})
	const driver = "k8s.hami.io/mig-driver=common"
	fake.SetDriverCDIDevices(driver)
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	claim := node.Claim(ctx, t, "default", "two", [2]string{dra.PoolName("node-3"), "gpu0-1g-10gb-at0"},
		[2]string{dra.PoolName("node-3"), "gpu0-1g-10gb-at1"})
	got, err := node.Prepare(ctx, claim)
	if err != nil || got.GetError() != "" {
		t.Fatalf("prepare: %+v %v", got, err)
	}
	for _, request := range []string{"", "gpu"} {
		names := fakekubelet.ContainerCDIDevices(got, request)
		var instances, drivers int
		for _, name := range names {
			switch {
			case name == driver:
				drivers++
			case strings.HasPrefix(name, "k8s.device-plugin.nvidia.com/dynamic-mig=MIG-"):
				instances++
			}
		}
		if instances != 2 || drivers != 1 || len(names) != 3 {
			t.Fatalf("a container using request %q gets %v: want both instances and the driver once", request, names)
		}
	}
	again, err := node.Prepare(ctx, claim) // a repeat answers the same (ALREADY_ALLOCATED)
	if err != nil || !slices.Equal(fakekubelet.ContainerCDIDevices(again, ""), fakekubelet.ContainerCDIDevices(got, "")) {
		t.Fatalf("repeat: %+v %v", again, err)
	}
}

// A claim allocated with adminAccess (the class's policy refuses one when it is written; an
// allocation made before the policy, or with the policy removed, still reaches prepare) is
// refused there with why, and no instance is created for it.
func TestAClaimAllocatedWithAdminAccessIsRefusedAtPrepareWithItsReasonAndNothingCreated(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-admin", dra.Options{})
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 2*13 })
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "monitoring", Name: "watch", UID: "0b6e1a52-0d3e-4c1e-9b59-5b8c2f1d7a01"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: dra.DefaultDriverName,
				Pool: dra.PoolName("node-admin"), Device: "gpu0-1g-10gb-at0", AdminAccess: ptr.To(true)}}}}},
	}

	got, err := node.Driver.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim})
	if err != nil {
		t.Fatal(err)
	}
	res := got[claim.UID]
	if res.Err == nil || len(res.Devices) != 0 || !strings.Contains(res.Err.Error(), "asks for adminAccess to gpu0-1g-10gb-at0, which a MIG device does not support") {
		t.Fatalf("prepare of an adminAccess claim: %+v", res)
	}
	if len(fake.Instances()) != 0 {
		t.Fatalf("an instance was created for the adminAccess claim: %+v", fake.Instances())
	}
}

// A claim deleted without its unprepare (its pod force-deleted, kubelet's state lost) leaves its
// instance ACTIVE, published warm, and the scheduler, which no longer counts the claim, gives its
// device to the next claim: that prepare finds the placement held by a claim gone from the API
// server, releases it and reuses the instance. A claim that still stands keeps its instance.
func TestAPrepareOverTheInstanceOfAClaimGoneWithoutUnprepareReleasesItAndReusesIt(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	fake, _, node := fakeNode(ctx, t, "node-gone", dra.Options{})
	pool := dra.PoolName("node-gone")
	at := [2]string{pool, "gpu0-2g-20gb-at4"}

	gone := node.Claim(ctx, t, "default", "gone", at)
	first, err := node.Prepare(ctx, gone)
	if err != nil || first.GetError() != "" {
		t.Fatalf("prepare: %+v %v", first, err)
	}
	mig := cdiMIG(t, fakekubelet.CDIDevices(first))
	standing := node.Claim(ctx, t, "default", "standing", [2]string{pool, "gpu1-2g-20gb-at4"})
	if got, err := node.Prepare(ctx, standing); err != nil || got.GetError() != "" {
		t.Fatalf("prepare: %+v %v", got, err)
	}

	// Both claims' devices given to new claims; only the first claim is gone.
	if err := node.Admin.ResourceV1().ResourceClaims("default").Delete(ctx, gone.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	next := node.Claim(ctx, t, "default", "next", at)
	got, err := node.Prepare(ctx, next)
	if err != nil || got.GetError() != "" || cdiMIG(t, fakekubelet.CDIDevices(got)) != mig {
		t.Fatalf("prepare over the gone claim's instance %s: %+v %v", mig, got, err)
	}
	if in := instance(t, fake, mig); in.State != pb.InstanceState_ACTIVE || in.Owner == nil || in.Owner.ClaimUID != string(next.UID) {
		t.Fatalf("the gone claim's instance: %+v, want the next claim's", in)
	}
	clash := node.Claim(ctx, t, "default", "clash", [2]string{pool, "gpu1-2g-20gb-at4"})
	if got, err := node.Prepare(ctx, clash); err != nil || !strings.Contains(got.GetError(), "PLACEMENT_BUSY") {
		t.Fatalf("prepare over a standing claim's instance: %+v %v, want PLACEMENT_BUSY", got, err)
	}
	if n := len(fake.Instances()); n != 2 {
		t.Fatalf("%d instances, want the two claims' only: %+v", n, fake.Instances())
	}
}
