package e2e

import (
	"testing"
	"time"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
)

// The sidecar's own reserve (here --idle-reserve 3g.40gb: keep a 3g.40gb placement ready somewhere
// on the node) leaves the DRA plugin's GPU to the plugin, which names it with KeepFree: the IDLE
// 2g.20gb in the reserve's way there stays (the plugin's slices list it warm, and a claim steered
// onto it would wait for its destroy), while the reserve frees an IDLE instance in its way on a GPU
// of HAMi's path.
func TestTheSidecarsReserveLeavesTheDRAPluginsGPUToThePlugin(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	mine, hamis := gpus[0], gpus[1]
	draNode(ctx, t, "node-reserve", mine, dra.Options{})

	// No 3g.40gb fits anywhere: 0:4 held on both GPUs, 4:4 on the plugin's GPU under an IDLE
	// 2g.20gb, on HAMi's under an ACTIVE 1g.10gb.
	allocate(ctx, t, c, p, request("pod-a", dev(mine, "1g.10gb", 0, 1)))
	warm := allocate(ctx, t, c, p, request("pod-b", dev(mine, "2g.20gb", 4, 2))).Devices[0].MigUUID
	allocate(ctx, t, c, p, request("pod-c", dev(hamis, "1g.10gb", 0, 1)))
	blocker := allocate(ctx, t, c, p, request("pod-d", dev(hamis, "1g.10gb", 4, 1))).Devices[0].MigUUID
	for _, uid := range []string{"pod-b", "pod-d"} {
		if _, err := c.Release(ctx, uid); err != nil {
			t.Fatal(err)
		}
		p.forget(uid)
	}

	// The reserve runs (every 0.2 s): the IDLE 1g.10gb on HAMi's GPU goes, which readies 4:4 there.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, left := states(ctx, t, c)[blocker]; !left {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reserve never trimmed the IDLE instance in its way on HAMi's GPU: %v", states(ctx, t, c))
		}
	}
	if got := states(ctx, t, c)[warm]; got != pb.InstanceState_IDLE {
		t.Fatalf("the IDLE 2g.20gb on the DRA plugin's GPU: %v, want it kept IDLE", got)
	}
}
