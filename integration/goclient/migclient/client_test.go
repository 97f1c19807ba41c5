package migclient

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// remote is a test double of the sidecar on the other end of the socket: a scripted
// MigSidecarServer that records what arrived.
type remote struct {
	pb.UnimplementedMigSidecarServer

	mu         sync.Mutex
	bootID     string
	started    time.Time
	recovered  bool
	generation uint64
	// allocateErrs are returned (and consumed) by the next Allocate calls.
	allocateErrs []error
	allocateHang bool
	recoverErr   error
	allocates    []*pb.AllocateRequest
	recovers     []*pb.RecoverRequest
	syncs        []*pb.SyncActiveRequest
	partial      bool
}

func newRemote() *remote {
	return &remote{bootID: "boot-1", started: time.Unix(1000, 0), recovered: true}
}

func sidecarError(code codes.Code, reason string, md map[string]string) error {
	st, err := status.New(code, reason+" from the double").WithDetails(&errdetails.ErrorInfo{
		Reason: reason, Domain: ErrorDomain, Metadata: md,
	})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

func (r *remote) GetInfo(context.Context, *pb.GetInfoRequest) (*pb.GetInfoResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return &pb.GetInfoResponse{
		ApiVersion: "v1", Backend: "simulated", BootId: r.bootID, Recovered: r.recovered,
		Generation: r.generation, StartedAt: timestamppb.New(r.started),
	}, nil
}

func (r *remote) Allocate(ctx context.Context, req *pb.AllocateRequest) (*pb.AllocateResponse, error) {
	r.mu.Lock()
	r.allocates = append(r.allocates, req)
	hang := r.allocateHang
	if !r.recovered {
		r.mu.Unlock()
		return nil, sidecarError(codes.FailedPrecondition, ReasonNotRecovered, nil)
	}
	if len(r.allocateErrs) > 0 {
		err := r.allocateErrs[0]
		r.allocateErrs = r.allocateErrs[1:]
		r.mu.Unlock()
		return nil, err
	}
	r.generation++
	partial := r.partial
	r.mu.Unlock()
	if hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	resp := &pb.AllocateResponse{}
	for _, d := range req.GetDevices() {
		resp.Devices = append(resp.Devices, &pb.AllocatedDevice{
			DeviceIndex: d.GetDeviceIndex(), GpuUuid: d.GetGpuUuid(), Profile: d.GetProfile(), Placement: d.GetPlacement(),
			MigUuid: "MIG-" + d.GetGpuUuid(), GpuInstanceId: 3, ComputeInstanceId: 0, Outcome: pb.Outcome_CREATED,
		})
		if partial {
			break
		}
	}
	return resp, nil
}

func (r *remote) Recover(_ context.Context, req *pb.RecoverRequest) (*pb.RecoverResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recovers = append(r.recovers, req)
	if r.recoverErr != nil {
		return nil, r.recoverErr
	}
	r.recovered = true
	resp := &pb.RecoverResponse{}
	for _, a := range req.GetActive() {
		resp.AdoptedActive = append(resp.AdoptedActive, &pb.InstanceRef{GpuUuid: a.GetGpuUuid(), MigUuid: a.GetMigUuid()})
	}
	return resp, nil
}

func (r *remote) SyncActive(_ context.Context, req *pb.SyncActiveRequest) (*pb.SyncActiveResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.recovered {
		return nil, sidecarError(codes.FailedPrecondition, ReasonNotRecovered, nil)
	}
	r.syncs = append(r.syncs, req)
	return &pb.SyncActiveResponse{}, nil
}

// restart makes the double look like a freshly started sidecar.
func (r *remote) restart() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.bootID, r.started, r.recovered, r.generation = "boot-2", r.started.Add(time.Minute), false, 0
}

func serve(t *testing.T, socket string, r *remote) *grpc.Server {
	t.Helper()
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterMigSidecarServer(srv, r)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return srv
}

func fastOptions() Options {
	return Options{
		CallTimeout: 5 * time.Second, AllocateTimeout: 5 * time.Second, MaxAttempts: 4,
		Backoff: Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
	}
}

func connect(t *testing.T, socket string, opts Options) *Client {
	t.Helper()
	c, err := New(context.Background(), socket, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func started(t *testing.T, opts Options) (*remote, *Client) {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "sidecar.sock")
	r := newRemote()
	serve(t, socket, r)
	return r, connect(t, socket, opts)
}

var oneDevice = AllocateRequest{
	Pod:           PodRef{UID: "uid-1", Namespace: "default", Name: "pod-1"},
	ContainerName: "main",
	Devices: []DeviceRequest{
		{DeviceIndex: 0, GPUUUID: "GPU-a", Profile: "1g.10gb", Placement: Placement{Start: 6, Size: 1}},
		{DeviceIndex: 1, GPUUUID: "GPU-b", Profile: "2g.20gb", Placement: Placement{Start: 0, Size: 2}},
	},
}

func TestAllocateRetriesUnavailableWithTheSameAllocationKey(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{
		sidecarError(codes.Unavailable, ReasonNvmlError, nil),
		sidecarError(codes.Unavailable, ReasonInstanceInUse, nil),
	}
	res, err := c.Allocate(context.Background(), oneDevice)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Devices) != 2 || res.Devices[0].MigUUID != "MIG-GPU-a" || res.Devices[1].Outcome != OutcomeCreated {
		t.Fatalf("unexpected result %+v", res)
	}
	if len(r.allocates) != 3 {
		t.Fatalf("sidecar saw %d Allocate calls, want 3", len(r.allocates))
	}
	for _, got := range r.allocates[1:] {
		if !proto.Equal(got, r.allocates[0]) {
			t.Fatalf("retry changed the request:\n%v\n%v", got, r.allocates[0])
		}
	}
}

func TestAllocateDoesNotRetryARefusalAndExposesItsReason(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{sidecarError(codes.FailedPrecondition, ReasonPlacementBusy, map[string]string{"blocker": "MIG-x"})}
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("not a *migclient.Error: %v", err)
	}
	if e.Code != codes.FailedPrecondition || e.Reason != ReasonPlacementBusy || e.Metadata["blocker"] != "MIG-x" || e.Op != "Allocate" {
		t.Fatalf("unexpected error %#v", e)
	}
	if !IsReason(err, ReasonPlacementBusy) || status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("helpers disagree with the error: %v", err)
	}
	if len(r.allocates) != 1 {
		t.Fatalf("a refusal was retried: %d calls", len(r.allocates))
	}
}

func TestAllocateGivesUpOnUnavailableAfterMaxAttempts(t *testing.T) {
	r, c := started(t, fastOptions())
	for range 10 {
		r.allocateErrs = append(r.allocateErrs, sidecarError(codes.Unavailable, ReasonInstanceInUse, nil))
	}
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Attempts != 4 || !e.Retryable() {
		t.Fatalf("unexpected error %v", err)
	}
	if len(r.allocates) != 4 {
		t.Fatalf("sidecar saw %d calls, want 4", len(r.allocates))
	}
}

func TestAllocateFailsClosedWhenTheSidecarHangsPastTheDeadline(t *testing.T) {
	opts := fastOptions()
	opts.AllocateTimeout = 200 * time.Millisecond
	r, c := started(t, opts)
	r.allocateHang = true
	_, err := c.Allocate(context.Background(), oneDevice)
	if CodeOf(err) != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) && status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("want DEADLINE_EXCEEDED, got %v", err)
	}
}

func TestAllocateRefusesAPartialAnswer(t *testing.T) {
	r, c := started(t, fastOptions())
	r.partial = true
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonInvalidResponse) {
		t.Fatalf("partial answer accepted: %v", err)
	}
}

func TestAllocateRejectsAnIncompleteRequestWithoutCallingTheSidecar(t *testing.T) {
	r, c := started(t, fastOptions())
	bad := oneDevice
	bad.Pod.UID = ""
	if _, err := c.Allocate(context.Background(), bad); !IsReason(err, ReasonInvalidRequest) || CodeOf(err) != codes.InvalidArgument {
		t.Fatalf("want INVALID_REQUEST, got %v", err)
	}
	bad = oneDevice
	bad.Devices = []DeviceRequest{oneDevice.Devices[0], oneDevice.Devices[0]}
	if _, err := c.Allocate(context.Background(), bad); !IsReason(err, ReasonInvalidRequest) {
		t.Fatalf("duplicate device index accepted: %v", err)
	}
	if len(r.allocates) != 0 {
		t.Fatal("an invalid request reached the sidecar")
	}
}

func TestACallWaitsForASidecarThatStartsWithinTheDeadline(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "sidecar.sock")
	c := connect(t, socket, fastOptions())
	r := newRemote()
	ready := make(chan struct{})
	go func() {
		time.Sleep(300 * time.Millisecond)
		serve(t, socket, r)
		close(ready)
	}()
	res, err := c.Allocate(context.Background(), oneDevice)
	<-ready
	if err != nil {
		t.Fatalf("call did not wait for the sidecar: %v", err)
	}
	if len(res.Devices) != 2 {
		t.Fatalf("unexpected result %+v", res)
	}
}

func TestACallFailsClosedWhenNoSidecarAnswers(t *testing.T) {
	opts := fastOptions()
	opts.AllocateTimeout = 300 * time.Millisecond
	c := connect(t, filepath.Join(t.TempDir(), "absent.sock"), opts)
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonSidecarUnreachable || e.Code != codes.Unavailable {
		t.Fatalf("want SIDECAR_UNREACHABLE, got %v", err)
	}
}

func activeList(list []*pb.ActiveAllocation, err error) ListActiveFunc {
	return func(context.Context) ([]*pb.ActiveAllocation, error) { return list, err }
}

var annotated = []*pb.ActiveAllocation{{
	Pod: &pb.PodRef{Uid: "uid-0", Namespace: "default", Name: "old"}, ContainerName: "main",
	GpuUuid: "GPU-a", Profile: "1g.10gb", Placement: &pb.Placement{Start: 5, Size: 1},
	MigUuid: "MIG-old", GpuInstanceId: 9, ComputeInstanceId: 0,
}}

func TestARestartedSidecarIsRecoveredWithTheActiveListAndTheCallRetriedOnce(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.restart()
	res, err := c.Allocate(context.Background(), oneDevice)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Devices) != 2 {
		t.Fatalf("unexpected result %+v", res)
	}
	if len(r.recovers) != 1 || !proto.Equal(r.recovers[0].GetActive()[0], annotated[0]) {
		t.Fatalf("Recover not sent with the active list: %v", r.recovers)
	}
	if len(r.allocates) != 2 || !proto.Equal(r.allocates[0], r.allocates[1]) {
		t.Fatalf("call not retried once with the same request: %d calls", len(r.allocates))
	}
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	if c.Restarts() != 1 {
		t.Fatalf("restart not noticed: %d", c.Restarts())
	}
}

func TestGetInfoRecoversASidecarThatHasNotRecovered(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.restart()
	info, err := c.EnsureRecovered(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !info.Recovered || info.BootID != "boot-2" || len(r.recovers) != 1 {
		t.Fatalf("not recovered: %+v, %d Recover calls", info, len(r.recovers))
	}
}

func TestWithoutAListCallbackNotRecoveredFailsClosed(t *testing.T) {
	r, c := started(t, fastOptions())
	r.restart()
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonNotRecovered) || CodeOf(err) != codes.FailedPrecondition {
		t.Fatalf("want NOT_RECOVERED, got %v", err)
	}
	if len(r.recovers) != 0 {
		t.Fatal("Recover sent without an active list")
	}
}

func TestAFailedRecoveryReportsItsReasonAndDoesNotRepeatTheCall(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.restart()
	r.recoverErr = sidecarError(codes.FailedPrecondition, ReasonUnverifiableState, map[string]string{"mig_uuid": "MIG-old"})
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonUnverifiableState) {
		t.Fatalf("want UNVERIFIABLE_STATE, got %v", err)
	}
	if len(r.allocates) != 1 {
		t.Fatalf("call repeated after a failed recovery: %d calls", len(r.allocates))
	}
}

func TestAFailedPodListStopsRecoveryBeforeRecoverIsSent(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(nil, errors.New("apiserver unreachable"))
	r, c := started(t, opts)
	r.restart()
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonPodListFailed) {
		t.Fatalf("want POD_LIST_FAILED, got %v", err)
	}
	if len(r.recovers) != 0 {
		t.Fatal("Recover sent without a trustworthy list")
	}
}

func TestReleaseByPodListSendsTheGenerationReadBeforeTheList(t *testing.T) {
	r, c := started(t, fastOptions())
	r.generation = 7
	racing := func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		// An Allocate completes while the pod list is being taken.
		if _, err := c.Allocate(ctx, oneDevice); err != nil {
			return nil, err
		}
		return annotated, nil
	}
	res, err := c.ReleaseByPodList(context.Background(), racing)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.syncs) != 1 || r.syncs[0].GetGeneration() != 7 || res.Generation != 7 {
		t.Fatalf("SyncActive not fenced by the earlier generation: %v", r.syncs)
	}
	if !proto.Equal(r.syncs[0].GetActive()[0], annotated[0]) {
		t.Fatalf("active list not sent: %v", r.syncs[0])
	}
}

func TestReleaseByPodListSendsNothingWhenThePodListFails(t *testing.T) {
	r, c := started(t, fastOptions())
	_, err := c.ReleaseByPodList(context.Background(), activeList(nil, errors.New("informer not synced")))
	if !IsReason(err, ReasonPodListFailed) {
		t.Fatalf("want POD_LIST_FAILED, got %v", err)
	}
	if len(r.syncs) != 0 {
		t.Fatal("SyncActive sent after a failed pod list")
	}
}

func TestReleaseByPodListRecoversARestartedSidecarFirst(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.restart()
	if _, err := c.ReleaseByPodList(context.Background(), opts.ListActive); err != nil {
		t.Fatal(err)
	}
	if len(r.recovers) != 1 || len(r.syncs) != 1 || r.syncs[0].GetGeneration() != 0 {
		t.Fatalf("recover=%d syncs=%v", len(r.recovers), r.syncs)
	}
}
