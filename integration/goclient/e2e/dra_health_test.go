package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// kubeletStream is the kubelet's end of NodeWatchResources in process: what the service sends
// arrives on out until ctx ends.
type kubeletStream struct {
	grpc.ServerStream // the methods the service does not call
	ctx               context.Context
	out               chan *drahealth.NodeWatchResourcesResponse
}

func (s *kubeletStream) Context() context.Context { return s.ctx }

func (s *kubeletStream) Send(r *drahealth.NodeWatchResourcesResponse) error {
	select {
	case s.out <- r:
		return nil
	case <-s.ctx.Done():
		return s.ctx.Err()
	}
}

// A critical Xid on a claim's instance turns its DRA device Unhealthy on the kubelet's health
// stream, and the stream outlives a kill -9 of the sidecar: the fault stays, and an Xid after the
// restart reaches it too.
func TestAnXidTurnsTheDRADeviceUnhealthyAndTheHealthStreamOutlivesASidecarRestart(t *testing.T) {
	ctx, c, _, gpus := setup(t)
	restart := env(t, "MIGSIDECAR_RESTART_CMD")
	claim := func(uid string, d migclient.DeviceRequest) migclient.AllocatedDevice {
		t.Helper()
		d.Request = "gpu"
		res, err := c.Allocate(ctx, migclient.AllocateRequest{
			Claim: &migclient.ClaimRef{UID: uid, Namespace: "e2e", Name: "claim-" + uid}, Devices: []migclient.DeviceRequest{d}})
		if err != nil {
			t.Fatalf("Allocate for claim %s: %v", uid, err)
		}
		return res.Devices[0]
	}
	hit := claim("hit", dev(gpus[0], "1g.10gb", 0, 1))
	later := claim("later", dev(gpus[0], "1g.10gb", 1, 1))

	conn, err := grpc.NewClient("unix://"+env(t, "MIGSIDECAR_SOCKET"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	index := map[string]uint32{}
	for _, g := range gpus {
		index[g.UUID] = g.Index
	}
	resolve := func(u *pb.InstanceHealthUpdate) (string, string, bool) {
		i, ok := index[u.GetGpuUuid()]
		name := strings.NewReplacer(".", "-", "+", "-").Replace(u.GetProfile())
		return fmt.Sprintf("node-gpu%d", i), fmt.Sprintf("gpu%d-%s-at%d", i, name, u.GetPlacement().GetStart()), ok
	}
	// A refresh of an hour: after the opening, only the follow stream tells the changes.
	h := dra.NewHealth(pb.NewMigSidecarClient(conn), resolve, dra.HealthOptions{Refresh: time.Hour})
	watch, stop := context.WithCancel(ctx)
	defer stop()
	stream := &kubeletStream{ctx: watch, out: make(chan *drahealth.NodeWatchResourcesResponse, 64)}
	done := make(chan error, 1)
	go func() { done <- h.NodeWatchResources(&drahealth.NodeWatchResourcesRequest{}, stream) }()

	hitDevice := fmt.Sprintf("node-gpu%d/gpu%d-1g-10gb-at0", gpus[0].Index, gpus[0].Index)
	laterDevice := fmt.Sprintf("node-gpu%d/gpu%d-1g-10gb-at1", gpus[0].Index, gpus[0].Index)
	until := func(what string, ok func(map[string]string) bool) map[string]string {
		t.Helper()
		for {
			select {
			case resp := <-stream.out:
				got := map[string]string{}
				for _, d := range resp.GetDevices() {
					got[d.GetDevice().GetPoolName()+"/"+d.GetDevice().GetDeviceName()] = d.GetHealth().String() + " " + d.GetMessage()
				}
				if ok(got) {
					return got
				}
			case err := <-done:
				t.Fatalf("the health stream ended before %s: %v", what, err)
			case <-ctx.Done():
				t.Fatalf("no response with %s", what)
			}
		}
	}
	until("both devices healthy", func(h map[string]string) bool {
		return strings.HasPrefix(h[hitDevice], "HEALTHY") && strings.HasPrefix(h[laterDevice], "HEALTHY")
	})

	sim(t, "xid", "--gpu", fmt.Sprint(gpus[0].Index), "--gi", fmt.Sprint(hit.GPUInstanceID), "79")
	got := until("the Xid", func(h map[string]string) bool { return strings.HasPrefix(h[hitDevice], "UNHEALTHY") })
	if !strings.Contains(got[hitDevice], "Xid 79") || !strings.Contains(got[hitDevice], hit.MigUUID) ||
		!strings.HasPrefix(got[laterDevice], "HEALTHY") {
		t.Fatalf("after Xid 79 on %s: %v", hit.MigUUID, got)
	}

	if out, err := exec.Command("/bin/sh", "-c", restart).CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	if _, err := c.EnsureRecovered(ctx); err != nil {
		t.Fatal(err)
	}
	sim(t, "xid", "--gpu", fmt.Sprint(gpus[0].Index), "--gi", fmt.Sprint(later.GPUInstanceID), "48")
	got = until("the Xid after the restart", func(h map[string]string) bool { return strings.HasPrefix(h[laterDevice], "UNHEALTHY") })
	if !strings.Contains(got[laterDevice], "Xid 48") || !strings.Contains(got[hitDevice], "Xid 79") {
		t.Fatalf("after the restart and Xid 48 on %s: %v", later.MigUUID, got)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("the kubelet's end of the stream ended it with %v", err)
	}
}
