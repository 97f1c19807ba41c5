// The HAMi lazy-lifecycle scenario that needs pending reservations in Recover (4.1), through the
// client against a real sidecar.
package e2e

import (
	"os/exec"
	"testing"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestAPendingReservationInRecoverIsAccepted(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	restart := env(t, "MIGSIDECAR_RESTART_CMD")
	held := allocate(ctx, t, c, p, request("held", dev(gpus[0], "1g.10gb", 5, 1)))
	p.mu.Lock()
	p.active["pending"] = []*pb.ActiveAllocation{{Pod: &pb.PodRef{Uid: "pending", Namespace: "e2e", Name: "pending"},
		ContainerName: "main", GpuUuid: gpus[0].UUID, Profile: "1g.10gb", Placement: &pb.Placement{Start: 6, Size: 1}}}
	p.mu.Unlock()
	if out, err := exec.Command("/bin/sh", "-c", restart).CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	if _, err := c.EnsureRecovered(ctx); err != nil {
		t.Fatalf("Recover with a pending reservation: %v", err)
	}
	if s := states(ctx, t, c); s[held.Devices[0].MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("after recovery: %v", s)
	}
	res, err := c.Allocate(ctx, request("pending", dev(gpus[0], "1g.10gb", 6, 1)))
	if err != nil || res.Devices[0].Outcome != migclient.OutcomeCreated {
		t.Fatalf("the pending reservation's Allocate: %+v %v", res, err)
	}
}
