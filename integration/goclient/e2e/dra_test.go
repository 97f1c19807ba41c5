// The DRA kubelet plugin (package dra) against a real sidecar, beside HAMi's adapter: the plugin
// started as kubelet would find it (registration socket, dra.sock) and driven by a fake kubelet,
// its claims in a real API server.
package e2e

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
func prepared(ctx context.Context, t *testing.T, n *fakekubelet.Node, claim *resourceapi.ResourceClaim) string {
	t.Helper()
	resp, err := n.Prepare(ctx, claim)
	if err != nil || resp.GetError() != "" {
		t.Fatalf("prepare %s: %+v %v", claim.Name, resp, err)
	}
	cdi := fakekubelet.CDIDevices(resp)
	if len(cdi) != 1 {
		t.Fatalf("claim %s: CDI devices %v", claim.Name, cdi)
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
	pool := dra.PoolName("node-x", gpus[1].Index)
	device := dra.DeviceName(gpus[1].Index, "1g.10gb", 0)
	claim := node.Claim(ctx, t, "default", "shared", [2]string{pool, device})
	claimMIG := prepared(ctx, t, node, claim)

	// HAMi's level-triggered release with no pod left: the pod's instance goes IDLE, the claim's stays.
	p.forget("a")
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	wantStates(ctx, t, c, "HAMi's release pass", map[string]pb.InstanceState{podMIG: pb.InstanceState_IDLE, claimMIG: pb.InstanceState_ACTIVE})

	// The sidecar restarts; HAMi's client recovers it from its (empty) pod list: the claim's stays ACTIVE.
	if out, err := exec.Command("/bin/sh", "-c", env(t, "MIGSIDECAR_RESTART_CMD")).CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	if _, err := c.EnsureRecovered(ctx); err != nil {
		t.Fatal(err)
	}
	wantStates(ctx, t, c, "after HAMi's recovery", map[string]pb.InstanceState{claimMIG: pb.InstanceState_ACTIVE})

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
