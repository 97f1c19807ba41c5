// Package e2e drives a real sidecar over its socket. The tests skip unless MIGSIDECAR_SOCKET
// names the socket of a running, simulated-backend sidecar that nothing else is using; pytest
// (integration/test_go_e2e.py) starts one per test and sets the variables:
//
//	MIGSIDECAR_SOCKET       the sidecar's Unix socket
//	MIGSIDECAR_CDI_DIR      its --cdi-dir (CDI checks)
//	MIGSIDECAR_RESTART_CMD  a shell command that kill -9s the sidecar and starts it again
//	MIGSIDECAR_SIM_CMD      the simulator's `sim` command on its hardware, arguments appended
//	MIGSIDECAR_MOCKPLUGIN   the mock plugin binary (cmd/mockplugin)
//	MIGSIDECAR_DRIVER_CDI   the CDI name of the node's driver, where the sidecar writes its spec
package e2e

import (
	"context"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func env(t *testing.T, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		t.Skipf("%s not set: no sidecar to test against", name)
	}
	return v
}

// plugin is the slice of HAMi's plugin state these tests need: the active allocations it
// would read from pod annotations.
type plugin struct {
	mu     sync.Mutex
	active map[string][]*pb.ActiveAllocation // by pod UID
}

func (p *plugin) list(context.Context) ([]*pb.ActiveAllocation, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*pb.ActiveAllocation
	for _, a := range p.active {
		out = append(out, a...)
	}
	return out, nil
}

// annotate records an Allocate result as the plugin's annotation patch would.
func (p *plugin) annotate(req migclient.AllocateRequest, res migclient.AllocateResult) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var list []*pb.ActiveAllocation
	for _, d := range res.Devices {
		list = append(list, &pb.ActiveAllocation{
			Pod:           &pb.PodRef{Uid: req.Pod.UID, Namespace: req.Pod.Namespace, Name: req.Pod.Name},
			ContainerName: req.ContainerName, ContainerIndex: req.ContainerIndex, DeviceIndex: d.DeviceIndex,
			GpuUuid: d.GPUUUID, Profile: d.Profile, Placement: &pb.Placement{Start: d.Placement.Start, Size: d.Placement.Size},
			MigUuid: d.MigUUID, GpuInstanceId: d.GPUInstanceID, ComputeInstanceId: d.ComputeInstanceID,
		})
	}
	p.active[req.Pod.UID] = list
}

func (p *plugin) forget(uid string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.active, uid)
}

func setup(t *testing.T) (context.Context, *migclient.Client, *plugin, []migclient.GPU) {
	t.Helper()
	socket := env(t, "MIGSIDECAR_SOCKET")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	p := &plugin{active: map[string][]*pb.ActiveAllocation{}}
	c, err := migclient.New(ctx, socket, migclient.Options{
		CallTimeout: 30 * time.Second, AllocateTimeout: 60 * time.Second, ListActive: p.list,
		// These tests run against the simulated hardware on purpose.
		AllowSimulatedBackend: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.EnsureRecovered(ctx); err != nil {
		t.Fatal(err)
	}
	gpus, err := c.ListGpus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) < 2 {
		t.Fatalf("need two GPUs, sidecar has %d", len(gpus))
	}
	return ctx, c, p, gpus
}

func request(uid string, devs ...migclient.DeviceRequest) migclient.AllocateRequest {
	for i := range devs {
		devs[i].DeviceIndex = uint32(i)
	}
	return migclient.AllocateRequest{
		Pod: migclient.PodRef{UID: uid, Namespace: "e2e", Name: "pod-" + uid}, ContainerName: "main", Devices: devs,
	}
}

func dev(gpu migclient.GPU, profile string, start, size uint32) migclient.DeviceRequest {
	return migclient.DeviceRequest{GPUUUID: gpu.UUID, Profile: profile, Placement: migclient.Placement{Start: start, Size: size}}
}

func allocate(ctx context.Context, t *testing.T, c *migclient.Client, p *plugin, req migclient.AllocateRequest) migclient.AllocateResult {
	t.Helper()
	res, err := c.Allocate(ctx, req)
	if err != nil {
		t.Fatalf("Allocate %s: %v", req.Pod.UID, err)
	}
	p.annotate(req, res)
	return res
}

// states maps MIG UUID -> instance state as the sidecar reports it.
func states(ctx context.Context, t *testing.T, c *migclient.Client) map[string]pb.InstanceState {
	t.Helper()
	st, err := c.GetState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]pb.InstanceState{}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			out[in.GetMigUuid()] = in.GetState()
		}
	}
	return out
}

func TestAReleaseRacingAnAllocateKeepsTheNewAllocationActive(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	old := allocate(ctx, t, c, p, request("old", dev(gpus[0], "1g.10gb", 0, 1)))
	p.forget("old") // the old pod is deleted

	var racing migclient.AllocateResult
	stalePodList := func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		list, err := p.list(ctx) // taken before the new pod's annotation is visible
		if err != nil {
			return nil, err
		}
		racing = allocate(ctx, t, c, p, request("new", dev(gpus[0], "1g.10gb", 1, 1)))
		return list, nil
	}
	res, err := c.ReleaseByPodList(ctx, stalePodList)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Idled) != 1 || res.Idled[0].MigUUID != old.Devices[0].MigUUID {
		t.Fatalf("want exactly the old pod's instance idled, got %+v", res.Idled)
	}
	s := states(ctx, t, c)
	if s[racing.Devices[0].MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("the racing allocation was released: %v", s)
	}
	if s[old.Devices[0].MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("the deleted pod's instance is not IDLE: %v", s)
	}
	// The next pass sees the new pod in the list and keeps it.
	if res, err := c.ReleaseByPodList(ctx, p.list); err != nil || len(res.Idled) != 0 {
		t.Fatalf("second pass: %+v %v", res, err)
	}
}

func TestAKilledSidecarIsRecoveredByTheNextCall(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	restart := env(t, "MIGSIDECAR_RESTART_CMD")
	before := allocate(ctx, t, c, p, request("survivor", dev(gpus[0], "1g.10gb", 2, 1), dev(gpus[1], "2g.20gb", 0, 2)))
	cmd := exec.Command("/bin/sh", "-c", restart)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("restart: %v\n%s", err, out)
	}
	after := allocate(ctx, t, c, p, request("newcomer", dev(gpus[0], "1g.10gb", 3, 1)))
	if after.Devices[0].Outcome != migclient.OutcomeCreated {
		t.Fatalf("unexpected outcome %v", after.Devices[0].Outcome)
	}
	if c.Restarts() != 1 {
		t.Fatalf("client noticed %d restarts, want 1", c.Restarts())
	}
	s := states(ctx, t, c)
	for _, d := range before.Devices {
		if s[d.MigUUID] != pb.InstanceState_ACTIVE {
			t.Fatalf("%s not adopted as ACTIVE after the restart: %v", d.MigUUID, s)
		}
	}
	// A retry of the surviving pod's Allocate converges on the same instances.
	again, err := c.Allocate(ctx, request("survivor", dev(gpus[0], "1g.10gb", 2, 1), dev(gpus[1], "2g.20gb", 0, 2)))
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range again.Devices {
		if d.Outcome != migclient.OutcomeAlreadyAllocated || d.MigUUID != before.Devices[i].MigUUID {
			t.Fatalf("retry after restart did not converge: %+v", again.Devices)
		}
	}
}
