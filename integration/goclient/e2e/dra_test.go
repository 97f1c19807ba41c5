// The DRA kubelet plugin (package dra) against a real sidecar, beside HAMi's adapter: the plugin
// started as kubelet would find it (registration socket, dra.sock) and driven by a fake kubelet,
// its claims in a real API server.
package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	oci "github.com/opencontainers/runtime-spec/specs-go"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// draNode starts the DRA plugin for node on the sidecar, serving only gpu, with a client of its
// own that leaves the sidecar's recovery to HAMi's (a second process on the node, as deployed).
func draNode(ctx context.Context, t *testing.T, node string, gpu migclient.GPU, opts dra.Options) *fakekubelet.Node {
	t.Helper()
	s := kubeapi.Get(t)
	c, err := migclient.New(ctx, env(t, "MIGSIDECAR_SOCKET"), migclient.Options{CallTimeout: 30 * time.Second,
		AllocateTimeout: 60 * time.Second, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	opts.NodeName, opts.GPUs = node, []string{gpu.UUID}
	n := fakekubelet.Start(ctx, t, s, c, opts)
	profiles, err := c.DiscoverProfiles(ctx, gpu.UUID, opts.Profiles)
	if err != nil {
		t.Fatal(err)
	}
	want := 0
	for _, p := range profiles {
		want += len(p.Placements)
	}
	n.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == want })
	return n
}

// prepared is the MIG UUID of the one device kubelet got for claim (the name of its CDI device).
// The answer holds the node driver's CDI device beside it exactly when MIGSIDECAR_DRIVER_CDI names
// one (the test's sidecar then writes the driver's spec), and nothing else.
func prepared(ctx context.Context, t *testing.T, n *fakekubelet.Node, claim *resourceapi.ResourceClaim) string {
	t.Helper()
	resp, err := n.Prepare(ctx, claim)
	if err != nil || resp.GetError() != "" {
		t.Fatalf("prepare %s: %+v %v", claim.Name, resp, err)
	}
	cdi := fakekubelet.CDIDevices(resp)
	want := []string{"<instance>"}
	if driver := os.Getenv("MIGSIDECAR_DRIVER_CDI"); driver != "" {
		want = append(want, driver)
	}
	if len(cdi) != len(want) || (len(want) == 2 && cdi[1] != want[1]) {
		t.Fatalf("claim %s: CDI devices %v, want %v", claim.Name, cdi, want)
	}
	_, mig, _ := strings.Cut(cdi[0], "=")
	return mig
}

func wantStates(ctx context.Context, t *testing.T, c *migclient.Client, step string, want map[string]pb.InstanceState) {
	t.Helper()
	got := states(ctx, t, c)
	for mig, state := range want {
		if got[mig] != state {
			t.Fatalf("%s: %s is %s, want %s (all: %v)", step, mig, got[mig], state, got)
		}
	}
}

func TestHAMisDevicePluginAndTheDRAPluginOnOneSidecarNeverReleaseEachOthersInstances(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	m, err := hami.New(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	hamiGPU, at := int(gpus[0].Index), nvml.GpuInstancePlacement{Start: 0, Size: 1}
	take := func(uid string) string {
		o := hami.Owner{PodUID: uid, PodNamespace: "e2e", PodName: "pod-" + uid, ContainerName: "main"}
		mig, took, err := m.EnsureAllocation(o, hamiGPU, "1g.10gb", at)
		if err != nil || !took {
			t.Fatalf("pod %s: %s %t %v", uid, mig, took, err)
		}
		info, _ := m.AllocationRuntimeInfo(hamiGPU, "1g.10gb", at)
		p.record(o, gpus[0].UUID, info)
		return mig
	}
	podMIG := take("a")

	// The DRA plugin serves GPU 1 alone (HAMi's filterdevices leaves it out).
	node := draNode(ctx, t, "node-x", gpus[1], dra.Options{})
	pool := dra.PoolName("node-x")
	device := dra.DeviceName(gpus[1].Index, "1g.10gb", 0)
	claim := node.Claim(ctx, t, "default", "shared", [2]string{pool, device})
	claimMIG := prepared(ctx, t, node, claim)

	// HAMi's level-triggered release with no pod left: the pod's instance goes IDLE, the claim's stays.
	p.forget("a")
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	wantStates(ctx, t, c, "HAMi's release pass", map[string]pb.InstanceState{podMIG: pb.InstanceState_IDLE, claimMIG: pb.InstanceState_ACTIVE})

	// A claim deleted without its unprepare (kubelet lost it), then the sidecar restarts; HAMi's client
	// recovers it from its (empty) pod list: the live claim's instance stays ACTIVE, and the running
	// plugin, seeing the sidecar's new incarnation, releases the deleted claim's.
	lost := node.Claim(ctx, t, "default", "lost", [2]string{pool, dra.DeviceName(gpus[1].Index, "1g.10gb", 2)})
	lostMIG := prepared(ctx, t, node, lost)
	if err := node.Admin.ResourceV1().ResourceClaims("default").Delete(ctx, lost.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("/bin/sh", "-c", env(t, "MIGSIDECAR_RESTART_CMD")).CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	if _, err := c.EnsureRecovered(ctx); err != nil {
		t.Fatal(err)
	}
	wantStates(ctx, t, c, "after HAMi's recovery", map[string]pb.InstanceState{claimMIG: pb.InstanceState_ACTIVE})
	for states(ctx, t, c)[lostMIG] != pb.InstanceState_IDLE {
		if ctx.Err() != nil {
			t.Fatalf("the plugin never released the deleted claim's %s after the sidecar's restart: %v", lostMIG, states(ctx, t, c))
		}
		time.Sleep(100 * time.Millisecond)
	}
	wantStates(ctx, t, c, "after the plugin's sync", map[string]pb.InstanceState{claimMIG: pb.InstanceState_ACTIVE})

	// A pod holds an instance again; the plugin's unprepare, and its recovery of a deleted claim, leave it ACTIVE.
	podMIG = take("b")
	if err := node.Unprepare(ctx, claim); err != nil {
		t.Fatal(err)
	}
	gone := node.Claim(ctx, t, "default", "gone", [2]string{pool, dra.DeviceName(gpus[1].Index, "1g.10gb", 1)})
	goneMIG := prepared(ctx, t, node, gone)
	node.Stop()
	if err := node.Admin.ResourceV1().ResourceClaims("default").Delete(ctx, gone.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	draNode(ctx, t, "node-x", gpus[1], dra.Options{}) // the plugin again: its startup recovers the claims
	wantStates(ctx, t, c, "after the plugin's unprepare and recovery", map[string]pb.InstanceState{podMIG: pb.InstanceState_ACTIVE,
		claimMIG: pb.InstanceState_IDLE, goneMIG: pb.InstanceState_IDLE})
}

// profileClaim asks for one device of profile through the driver's DeviceClass.
func profileClaim(profile string) resourceapi.DeviceRequest {
	return resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: dra.DefaultDriverName,
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: `device.attributes["` + dra.DefaultDriverName + `"].` + dra.AttrProfile + ` == "` + profile + `"`}}}}}
}

// injected is an empty container after the CDI devices names from the sidecar's spec directory
// were injected into it by the reference library, as the container runtime does.
func injected(t *testing.T, names ...string) (*cdi.Cache, *oci.Spec) {
	t.Helper()
	cache, err := cdi.NewCache(cdi.WithSpecDirs(env(t, "MIGSIDECAR_CDI_DIR")), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if unresolved, err := cache.InjectDevices(spec, names...); err != nil || len(unresolved) != 0 {
		t.Fatalf("inject %v: unresolved %v, %v", names, unresolved, err)
	}
	return cache, spec
}

// resolved injects CDI device name from the sidecar's spec directory into an empty container, as
// the container runtime does, and answers the MIG UUID the device is named for and the
// nvidia-caps device nodes it got (the GI's and the CI's access nodes).
func resolved(t *testing.T, name string) (string, int) {
	t.Helper()
	cache, spec := injected(t, name)
	dev := cache.GetDevice(name)
	if dev == nil {
		t.Fatalf("CDI device %s: no spec in the sidecar's directory names it", name)
	}
	caps := 0
	for _, n := range spec.Linux.Devices {
		if strings.HasPrefix(n.Path, "/dev/nvidia-caps/nvidia-cap") {
			caps++
		}
	}
	return dev.Name, caps
}

// wantTheDriver fails the test unless a container given the CDI devices names gets what the
// driver's device brings beside an instance's nodes: libcuda and nvidia-smi from the simulated
// node's driver root, the hook linking libcuda.so.1 and, where device nodes can be made (root),
// the control and unified-memory nodes.
func wantTheDriver(t *testing.T, claim string, names []string) {
	t.Helper()
	_, spec := injected(t, names...)
	var mounts, nodes []string
	for _, m := range spec.Mounts {
		mounts = append(mounts, m.Destination)
	}
	for _, n := range spec.Linux.Devices {
		nodes = append(nodes, n.Path)
	}
	linksLibcuda1 := false
	if spec.Hooks != nil {
		for _, h := range spec.Hooks.CreateContainer {
			linksLibcuda1 = linksLibcuda1 || (slices.Contains(h.Args, "create-symlinks") && strings.Contains(strings.Join(h.Args, " "), "libcuda.so.1::"))
		}
	}
	libcuda := slices.ContainsFunc(mounts, func(m string) bool { return strings.Contains(m, "/libcuda.so.") })
	if !libcuda || !slices.Contains(mounts, "/usr/bin/nvidia-smi") || !linksLibcuda1 {
		t.Fatalf("claim %s: a container given %v gets mounts %v (libcuda %t, nvidia-smi %t) and a libcuda.so.1 link %t",
			claim, names, mounts, libcuda, slices.Contains(mounts, "/usr/bin/nvidia-smi"), linksLibcuda1)
	}
	if os.Geteuid() == 0 { // the driver root's control nodes are character devices, which only root can make
		for _, want := range []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} {
			if !slices.Contains(nodes, want) {
				t.Fatalf("claim %s: a container given %v gets device nodes %v, without %s", claim, names, nodes, want)
			}
		}
	}
}

// The end to end: pods with claims scheduled by the real kube-scheduler from the slices the
// plugin publishes, prepared by kubelet (the fake) through the plugin, the container's CDI names
// resolving to a live MIG instance and to the node's driver (libcuda, nvidia-smi); unprepared to
// IDLE; the next claim for the profile scheduled onto the same device, now warm and first, and
// prepared on the same MIG UUID, the driver's name beside it again, with no GPU instance created.
func TestAClaimScheduledByTheRealSchedulerGetsAWarmInstanceBackWithNoGPUInstanceCreated(t *testing.T) {
	ctx, c, _, gpus := setup(t)
	s := kubeapi.GetWithScheduler(t)
	driver := env(t, "MIGSIDECAR_DRIVER_CDI") // this test's sidecar writes the driver's spec
	node := draNode(ctx, t, "node-sched", gpus[0], dra.Options{})
	kubeapi.ReadyNode(ctx, t, node.Admin, node.Name)

	run := func(name string) (*resourceapi.ResourceClaim, string) {
		kubeapi.PodWithClaim(t, node.Admin, "default", name, profileClaim("1g.10gb"))
		claim := s.Bound(t, "default", name, node.Name)
		mig := prepared(ctx, t, node, claim)
		resp, _ := node.Prepare(ctx, claim)                   // kubelet asks again after its restart: the same answer
		names := fakekubelet.ContainerCDIDevices(resp, "gpu") // what the pod's container gets
		if len(names) != 2 || names[1] != driver {
			t.Fatalf("claim %s: the container gets CDI devices %v, want its instance's and the driver's %s", name, names, driver)
		}
		if named, caps := resolved(t, names[0]); named != mig || caps != 2 {
			t.Fatalf("claim %s: CDI device %s resolves to %s with %d nvidia-caps nodes, want %s with 2", name, names[0], named, caps, mig)
		}
		wantTheDriver(t, name, names)
		if live, _ := hardware(t); !slices.Contains(live, mig) {
			t.Fatalf("claim %s: %s is not on the simulated GPUs: %v", name, mig, live)
		}
		return claim, mig
	}
	// Two claims: the scheduler takes the first fitting devices, the two lowest 1g.10gb placements.
	first, firstMIG := run("first")
	second, mig := run("second")
	device := second.Status.Allocation.Devices.Results[0].Device
	wantStates(ctx, t, c, "prepared", map[string]pb.InstanceState{firstMIG: pb.InstanceState_ACTIVE, mig: pb.InstanceState_ACTIVE})

	// Both pods end: unprepared to IDLE, pods and claims deleted. The first's instance is then
	// destroyed, so the lowest placement is free and only the second's device is warm: without the
	// warm-first order the scheduler would take the free, lower one and a GPU instance be created.
	for _, claim := range []*resourceapi.ResourceClaim{first, second} {
		if err := node.Unprepare(ctx, claim); err != nil {
			t.Fatal(err)
		}
		if err := node.Admin.CoreV1().Pods("default").Delete(ctx, claim.Name, *metav1.NewDeleteOptions(0)); err != nil {
			t.Fatal(err)
		}
		if err := kubeapi.DeleteClaim(ctx, node.Admin, "default", claim.Name); err != nil {
			t.Fatal(err)
		}
	}
	wantStates(ctx, t, c, "unprepared", map[string]pb.InstanceState{firstMIG: pb.InstanceState_IDLE, mig: pb.InstanceState_IDLE})
	if _, err := c.ReclaimIdle(ctx, gpus[0].UUID, firstMIG); err != nil {
		t.Fatal(err)
	}
	// Republished: the IDLE instance's device is first of the pool and warm.
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool {
		return ds[0].Name == device && *ds[0].Attributes[dra.AttrWarm].BoolValue && !*ds[1].Attributes[dra.AttrWarm].BoolValue
	})

	_, gisBefore := hardware(t)
	third, again := run("third")
	if got := third.Status.Allocation.Devices.Results[0].Device; got != device || again != mig {
		t.Fatalf("the third claim got %s (%s), want the warm %s (%s)", got, again, device, mig)
	}
	if _, gisAfter := hardware(t); !slices.Equal(gisAfter, gisBefore) {
		t.Fatalf("GPU instances before the third claim %v, after %v: one was created", gisBefore, gisAfter)
	}
}

// The tail, end to end: an IDLE instance in the way of the only cold device of a profile claims ask
// for. The plugin names that device (its next cold one) to the sidecar, whose background trim
// destroys the IDLE instance under it; the slices republished no longer list that instance warm,
// and a claim there is prepared with one GPU instance created and none destroyed. An IDLE instance
// in no claim's way stays.
func TestThePluginsNextColdDeviceIsFreedInTheBackgroundAndAClaimThereDestroysNothing(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	gpu := gpus[0]
	// 1g.10gb IDLE at 0 (under 2g.20gb at 0) and at 6 (under no 2g.20gb placement), and a pod's at 2
	// (2g.20gb at 2 is tainted while it runs).
	idle := map[uint32]string{}
	for _, start := range []uint32{0, 6} {
		uid := fmt.Sprintf("pod-%d", start)
		idle[start] = allocate(ctx, t, c, p, request(uid, dev(gpu, "1g.10gb", start, 1))).Devices[0].MigUUID
		if _, err := c.Release(ctx, uid); err != nil {
			t.Fatal(err)
		}
		p.forget(uid)
	}
	node := draNode(ctx, t, "node-tail", gpu, dra.Options{KeepFreeWithin: time.Hour})
	pool := dra.PoolName(node.Name)
	idle[2] = allocate(ctx, t, c, p, request("pod-2", dev(gpu, "1g.10gb", 2, 1))).Devices[0].MigUUID
	// A claim for 2g.20gb on its one free placement (4): 2g.20gb is asked for now, and the plugin's
	// next cold 2g.20gb device is at 0, over the IDLE instance there.
	prepared(ctx, t, node, node.Claim(ctx, t, "default", "first", [2]string{pool, "gpu0-2g-20gb-at4"}))

	deadline := time.Now().Add(time.Minute)
	for {
		got := states(ctx, t, c)
		if _, left := got[idle[0]]; !left && got[idle[6]] == pb.InstanceState_IDLE {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the IDLE instance under gpu0-2g-20gb-at0 (%s) was not trimmed, or the one at 6 was: %v", idle[0], got)
		}
		time.Sleep(50 * time.Millisecond)
	}
	node.Devices(ctx, t, func(ds []resourceapi.Device) bool {
		var warm []string
		for _, d := range ds {
			if *d.Attributes[dra.AttrWarm].BoolValue {
				warm = append(warm, d.Name)
			}
		}
		// The IDLE instance at 6, and the first claim's (it goes IDLE at the claim's unprepare).
		return slices.Equal(warm, []string{"gpu0-1g-10gb-at6", "gpu0-2g-20gb-at4"})
	})
	_, before := hardware(t)
	second := prepared(ctx, t, node, node.Claim(ctx, t, "default", "second", [2]string{pool, "gpu0-2g-20gb-at0"}))
	if _, after := hardware(t); len(after) != len(before)+1 || slices.ContainsFunc(before, func(gi string) bool { return !slices.Contains(after, gi) }) {
		t.Fatalf("GPU instances %v before the claim at the freed device, %v after: want one more, none destroyed", before, after)
	}
	wantStates(ctx, t, c, "after the second claim", map[string]pb.InstanceState{second: pb.InstanceState_ACTIVE,
		idle[2]: pb.InstanceState_ACTIVE, idle[6]: pb.InstanceState_IDLE})
}
