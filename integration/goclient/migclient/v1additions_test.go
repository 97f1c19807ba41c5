package migclient_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func fake(t *testing.T, list migclient.ListActiveFunc) (*fakesidecar.Server, *migclient.Client) {
	t.Helper()
	s, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	c, err := migclient.New(context.Background(), socket, migclient.Options{
		CallTimeout: 5 * time.Second, AllocateTimeout: 5 * time.Second, MaxAttempts: 4, ListActive: list,
		Backoff: migclient.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond}, AllowSimulatedBackend: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return s, c
}

// req is pod p's Allocate of its container 0.
func req(devs ...migclient.DeviceRequest) migclient.AllocateRequest {
	for i := range devs {
		devs[i].DeviceIndex = uint32(i)
	}
	return migclient.AllocateRequest{Pod: migclient.PodRef{UID: "p", Namespace: "ns", Name: "p"}, ContainerName: "c",
		Devices: devs}
}

// on is a 1g.10gb device at start on GPU-a.
func on(start uint32) migclient.DeviceRequest {
	return migclient.DeviceRequest{GPUUUID: "GPU-a", Profile: "1g.10gb", Placement: migclient.Placement{Start: start, Size: 1}}
}

func states(s *fakesidecar.Server) map[string]pb.InstanceState {
	out := map[string]pb.InstanceState{}
	for _, in := range s.Instances() {
		out[in.MigUUID] = in.State
	}
	return out
}

func TestUndoAllocateDestroysWhatTheAllocateCreatedAndIdlesWhatItReused(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	res, err := c.Allocate(ctx, req(on(0), on(1)))
	if err != nil {
		t.Fatal(err)
	}
	if res.Devices[0].Outcome != migclient.OutcomeReused || res.Devices[1].Outcome != migclient.OutcomeCreated {
		t.Fatalf("outcomes %v %v", res.Devices[0].Outcome, res.Devices[1].Outcome)
	}
	undo, err := c.UndoAllocate(ctx, "p", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(undo.Destroyed) != 1 || undo.Destroyed[0].MigUUID != res.Devices[1].MigUUID ||
		len(undo.Idled) != 1 || undo.Idled[0].MigUUID != cached.MigUUID {
		t.Fatalf("undo %+v", undo)
	}
	if got := states(s); len(got) != 1 || got[cached.MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("table after undo: %v", got)
	}
	again, err := c.UndoAllocate(ctx, "p", 0)
	if err != nil || len(again.Destroyed)+len(again.Idled) != 0 {
		t.Fatalf("a repeated undo changed something: %+v %v", again, err)
	}
}

func TestUndoAllocateRetriesUnavailableAndRejectsAnEmptyPodUID(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	if _, err := c.Allocate(ctx, req(on(2))); err != nil {
		t.Fatal(err)
	}
	s.FailNext(2)
	undo, err := c.UndoAllocate(ctx, "p", 0)
	if err != nil || len(undo.Destroyed) != 1 {
		t.Fatalf("undo after two UNAVAILABLE answers: %+v %v", undo, err)
	}
	if _, err := c.UndoAllocate(ctx, "", 0); !migclient.IsReason(err, migclient.ReasonInvalidRequest) {
		t.Fatalf("empty pod UID: %v", err)
	}
}

func TestReclaimIdleRefusalsAreTypedAndDestroyNothing(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	idle := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	busy := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 1, Size: 1, State: pb.InstanceState_ACTIVE})
	for _, tc := range []struct {
		mig    string
		code   codes.Code
		reason string
	}{
		{busy.MigUUID, codes.FailedPrecondition, migclient.ReasonNotIdle},
		{"MIG-nowhere", codes.NotFound, migclient.ReasonUnknownInstance},
	} {
		_, err := c.ReclaimIdle(ctx, "GPU-a", idle.MigUUID, tc.mig)
		if migclient.CodeOf(err) != tc.code || !migclient.IsReason(err, tc.reason) {
			t.Fatalf("ReclaimIdle %s: %v, want %s %s", tc.mig, err, tc.code, tc.reason)
		}
	}
	if len(s.Instances()) != 2 {
		t.Fatalf("a refused reclaim destroyed something: %v", states(s))
	}
	got, err := c.ReclaimIdle(ctx, "GPU-a")
	if err != nil || len(got) != 1 || got[0].MigUUID != idle.MigUUID {
		t.Fatalf("reclaim all idle: %+v %v", got, err)
	}
	if st := states(s); len(st) != 1 || st[busy.MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("table after reclaim: %v", st)
	}
}

func TestSetMigModeWithReclaimIdleDisablesAGPUThatOnlyCachesInstances(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "2g.20gb", Start: 0, Size: 2, State: pb.InstanceState_IDLE})
	if _, err := c.SetMigMode(ctx, "GPU-b", false); !migclient.IsReason(err, migclient.ReasonPlacementBusy) {
		t.Fatalf("disable without reclaim: %v", err)
	}
	if !s.MigEnabled("GPU-b") || len(s.Instances()) != 1 {
		t.Fatal("a refused disable changed the GPU")
	}
	res, err := c.SetMigMode(ctx, "GPU-b", false, migclient.ReclaimIdle())
	if err != nil || res.MigMode.Current {
		t.Fatalf("disable with reclaim: %+v %v", res, err)
	}
	if s.MigEnabled("GPU-b") || len(s.Instances()) != 0 {
		t.Fatalf("MIG still on or instances left: %v", states(s))
	}
}

func TestRankPlacementsPutsReuseFirstAndBlockedLast(t *testing.T) {
	s, c := fake(t, nil)
	idle := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "2g.20gb", Start: 2, Size: 2, State: pb.InstanceState_IDLE})
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 4, Size: 1, State: pb.InstanceState_ACTIVE})
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	got, err := c.RankPlacements(context.Background(), "GPU-a", "2g.20gb")
	if err != nil {
		t.Fatal(err)
	}
	var costs []string
	for _, p := range got {
		costs = append(costs, p.Placement.String()+"="+p.Cost.String())
	}
	want := []string{"2:2=REUSE", "0:2=RECLAIM", "4:2=BLOCKED"}
	if len(costs) != len(want) || costs[0] != want[0] || costs[1] != want[1] || costs[2] != want[2] {
		t.Fatalf("ranking %v, want %v", costs, want)
	}
	if got[0].IdleMigUUID != idle.MigUUID || len(got[1].Reclaim) != 1 {
		t.Fatalf("advice details: %+v", got)
	}
}

func TestRecoverSendsPendingReservationsTheListNames(t *testing.T) {
	pending := &pb.ActiveAllocation{Pod: &pb.PodRef{Uid: "later"}, ContainerName: "c", GpuUuid: "GPU-a",
		Profile: "1g.10gb", Placement: &pb.Placement{Start: 3, Size: 1}}
	s, c := fake(t, func(context.Context) ([]*pb.ActiveAllocation, error) { return []*pb.ActiveAllocation{pending}, nil })
	s.Unrecover()
	if _, err := c.ReclaimIdle(context.Background(), "GPU-a"); err != nil {
		t.Fatal(err)
	}
	recs := s.Recovers()
	if len(recs) != 1 || len(recs[0].GetActive()) != 1 || recs[0].GetActive()[0].GetMigUuid() != "" ||
		recs[0].GetActive()[0].GetPod().GetUid() != "later" {
		t.Fatalf("Recover did not carry the pending reservation: %v", recs)
	}
}

// oldSidecar is a sidecar from before UndoDevice: it answers GetInfo and nothing new.
type oldSidecar struct {
	pb.UnimplementedMigSidecarServer
}

func (oldSidecar) GetInfo(context.Context, *pb.GetInfoRequest) (*pb.GetInfoResponse, error) {
	return &pb.GetInfoResponse{ApiVersion: "v1", Backend: "simulated", BootId: "old", Recovered: true}, nil
}

func TestUndoDeviceAgainstAnOlderSidecarFailsAndNeverFallsBackToTheContainerUndo(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "old.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterMigSidecarServer(srv, oldSidecar{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	c, err := migclient.New(context.Background(), socket, migclient.Options{CallTimeout: 5 * time.Second, AllocateTimeout: 5 * time.Second,
		MaxAttempts: 2, AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	if _, err := c.UndoDevice(context.Background(), "MIG-x", migclient.DeviceOwner{PodUID: "p"}); migclient.CodeOf(err) != codes.Unimplemented {
		t.Fatalf("an older sidecar: %v", err)
	}
}

func TestUndoDeviceAnswersWhatItDidOrWhyNot(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	res, err := c.Allocate(ctx, req(on(0), on(1)))
	if err != nil {
		t.Fatal(err)
	}
	dev0, dev1 := res.Devices[0].MigUUID, res.Devices[1].MigUUID
	done, err := c.UndoDevice(ctx, dev1, migclient.DeviceOwner{PodUID: "p", DeviceIndex: 1})
	if err != nil || done.Destroyed == nil || done.Destroyed.MigUUID != dev1 || done.Skipped != migclient.UndoSkipNone {
		t.Fatalf("undo of device 1: %+v %v", done, err)
	}
	if got := states(s); len(got) != 1 || got[dev0] != pb.InstanceState_ACTIVE {
		t.Fatalf("device 0 after undoing device 1: %v", got)
	}
	for _, tc := range []struct {
		mig   string
		owner migclient.DeviceOwner
		want  migclient.UndoSkip
	}{
		{dev1, migclient.DeviceOwner{PodUID: "p", DeviceIndex: 1}, migclient.UndoSkipUnknownInstance},
		{dev0, migclient.DeviceOwner{PodUID: "p", DeviceIndex: 1}, migclient.UndoSkipOtherOwner},
		{dev0, migclient.DeviceOwner{PodUID: "q"}, migclient.UndoSkipOtherOwner},
	} {
		if got, err := c.UndoDevice(ctx, tc.mig, tc.owner); err != nil || got.Skipped != tc.want || got.Destroyed != nil || got.Idled != nil {
			t.Fatalf("%s %+v: %+v %v, want %s", tc.mig, tc.owner, got, err, tc.want)
		}
	}
	if got := states(s); len(got) != 1 || got[dev0] != pb.InstanceState_ACTIVE {
		t.Fatalf("after the skipped undos: %v", got)
	}
	if _, err := c.UndoDevice(ctx, "", migclient.DeviceOwner{PodUID: "p"}); !migclient.IsReason(err, migclient.ReasonInvalidRequest) {
		t.Fatalf("an empty MIG UUID: %v", err)
	}
}

func TestTheKnownGenerationPassFallsBackWhenTheSidecarRestarted(t *testing.T) {
	s, c := fake(t, func(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil })
	ctx := context.Background()
	if _, err := c.Allocate(ctx, req(on(0))); err != nil {
		t.Fatal(err)
	}
	s.Unrecover() // NOT_RECOVERED until the next Recover, as after a restart
	s.ResetCalls()
	res, err := c.ReleaseWithKnownGeneration(ctx, func(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil })
	if err != nil || len(res.Idled) != 1 {
		t.Fatalf("after the restart: %+v %v", res, err)
	}
	if calls := s.Calls(); calls["Recover"] != 1 || calls["GetInfo"] == 0 {
		t.Fatalf("the fallback pass: %v", calls)
	}
	if got := states(s); len(got) != 1 {
		t.Fatalf("%v", got)
	}
}

func TestAClaimsInstanceIsReleasedByItsClaimOnlyAndAPodAndAClaimAtOnceAreRefused(t *testing.T) {
	s, c := fake(t, nil)
	ctx := context.Background()
	pod, err := c.Allocate(ctx, req(on(0)))
	if err != nil {
		t.Fatal(err)
	}
	claimReq := migclient.AllocateRequest{Claim: &migclient.ClaimRef{UID: "claim-1", Namespace: "ns", Name: "c"},
		Devices: []migclient.DeviceRequest{{GPUUUID: "GPU-a", Profile: "1g.10gb", Placement: migclient.Placement{Start: 1, Size: 1}, Request: "gpu"}}}
	claim, err := c.Allocate(ctx, claimReq)
	if err != nil {
		t.Fatal(err)
	}

	both := claimReq
	both.Pod = migclient.PodRef{UID: "p"}
	if _, err := c.Allocate(ctx, both); !migclient.IsReason(err, migclient.ReasonInvalidRequest) {
		t.Fatalf("a pod and a claim in one Allocate: want INVALID_REQUEST, got %v", err)
	}
	if _, err := c.ReleaseClaim(ctx, ""); !migclient.IsReason(err, migclient.ReasonInvalidRequest) {
		t.Fatalf("an empty claim UID: want INVALID_REQUEST, got %v", err)
	}

	// A level-triggered pod release with no pod listed leaves the claim's instance ACTIVE.
	if _, err := c.ReleaseByPodList(ctx, func(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	want := map[string]pb.InstanceState{pod.Devices[0].MigUUID: pb.InstanceState_IDLE, claim.Devices[0].MigUUID: pb.InstanceState_ACTIVE}
	if got := states(s); len(got) != 2 || got[pod.Devices[0].MigUUID] != want[pod.Devices[0].MigUUID] ||
		got[claim.Devices[0].MigUUID] != want[claim.Devices[0].MigUUID] {
		t.Fatalf("after the pod pass: %v, want %v", got, want)
	}
	released, err := c.ReleaseClaim(ctx, "claim-1")
	if err != nil || len(released) != 1 || released[0].MigUUID != claim.Devices[0].MigUUID {
		t.Fatalf("ReleaseClaim: %+v %v", released, err)
	}
	if again, err := c.ReleaseClaim(ctx, "claim-1"); err != nil || len(again) != 0 {
		t.Fatalf("a repeated ReleaseClaim: %+v %v", again, err)
	}
	if got := states(s); got[claim.Devices[0].MigUUID] != pb.InstanceState_IDLE {
		t.Fatalf("after ReleaseClaim: %v", got)
	}
}
