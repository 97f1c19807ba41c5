package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
)

// A GPU of the real sidecar falls off the bus (Xid 79, then every NVML call on it fails
// GPU_IS_LOST): the sidecar's GetState answers it unreadable and the others as usual, so the
// plugin taints that GPU's devices only. A claim for the lost GPU stays Pending, unallocated,
// instead of being bound to a prepare that fails; the healthy GPU's slices still follow its IDLE
// set, and a claim there is scheduled and prepared.
func TestALostGPUOfTheRealSidecarTaintsItsOwnDevicesOnlyAndTheOtherStillFollowsItsIdleSet(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	s := kubeapi.GetWithScheduler(t)
	healthy, lost := gpus[0], gpus[1]
	n := fakekubelet.Start(ctx, t, s, c, dra.Options{NodeName: "node-lost", GPUs: []string{healthy.UUID, lost.UUID}})
	kubeapi.ReadyNode(ctx, t, n.Admin, n.Name)
	onLost := func(ds []resourceapi.Device, taint string) bool {
		prefix := fmt.Sprintf("gpu%d-", lost.Index)
		count := 0
		for _, d := range ds {
			if strings.HasPrefix(d.Name, prefix) {
				count++
				if fakekubelet.Taint(ds, d.Name) != taint {
					return false
				}
			}
		}
		return count > 0
	}
	n.Devices(ctx, t, func(ds []resourceapi.Device) bool { return onLost(ds, "") })

	sim(t, "xid", "--gpu", fmt.Sprint(lost.Index), "79")
	sim(t, "lose", "--gpu", fmt.Sprint(lost.Index))
	first := dra.DeviceName(healthy.Index, "1g.10gb", 0)
	n.Devices(ctx, t, func(ds []resourceapi.Device) bool {
		return onLost(ds, dra.TaintGPUUnreadable) && fakekubelet.Taint(ds, first) == ""
	})

	lostClaim := profileClaim("1g.10gb")
	lostClaim.Exactly.Selectors[0].CEL.Expression += fmt.Sprintf(` && device.attributes[%q].%s == %q`, dra.DefaultDriverName,
		dra.AttrGPUUUID, lost.UUID)
	kubeapi.PodWithClaim(t, n.Admin, "default", "on-lost", lostClaim)
	kubeapi.Unschedulable(t, n.Admin, "default", "on-lost")

	// HAMi's pod ends on the healthy GPU: its 2g.20gb at 4 goes IDLE, and the device turns warm and
	// first in the slices while the other GPU stays lost.
	allocate(ctx, t, c, p, request("pod-idle", dev(healthy, "2g.20gb", 4, 2)))
	if _, err := c.Release(ctx, "pod-idle"); err != nil {
		t.Fatal(err)
	}
	p.forget("pod-idle")
	released := time.Now()
	warm := dra.DeviceName(healthy.Index, "2g.20gb", 4)
	n.Devices(ctx, t, func(ds []resourceapi.Device) bool {
		return ds[0].Name == warm && *ds[0].Attributes[dra.AttrWarm].BoolValue && onLost(ds, dra.TaintGPUUnreadable)
	})
	t.Logf("the healthy GPU's IDLE instance published warm and first %v after its release, the other GPU lost",
		time.Since(released).Round(time.Millisecond))

	kubeapi.PodWithClaim(t, n.Admin, "default", "on-healthy", profileClaim("2g.20gb"))
	claim := s.Bound(t, "default", "on-healthy", n.Name)
	if got := claim.Status.Allocation.Devices.Results[0].Device; got != warm {
		t.Fatalf("a plain 2g.20gb claim got %s, want the warm %s", got, warm)
	}
	prepared(ctx, t, n, claim)
}
