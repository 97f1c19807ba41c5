package migclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
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
	backend    string
	bootID     string
	boots      int
	started    time.Time
	recovered  bool
	generation uint64
	// restartGeneration is the generation a restart resumes from (the durable ceiling).
	restartGeneration uint64
	getInfos          int
	// allocateAlways, when set, answers every Allocate once allocateErrs are used up.
	allocateAlways error
	// recoverErrs are returned (and consumed) by the next Recover calls before recoverErr.
	recoverErrs []error
	// allocateErrs are returned (and consumed) by the next Allocate calls.
	allocateErrs []error
	allocateHang bool
	// hanging, when set, hears from each Allocate that starts to hang (buffered, never blocks).
	hanging    chan struct{}
	recoverErr error
	allocates  []*pb.AllocateRequest
	recovers   []*pb.RecoverRequest
	syncs      []*pb.SyncActiveRequest
	partial    bool
	// migUUID, when set, is the MIG UUID every answered device gets.
	migUUID string
}

func newRemote() *remote {
	return &remote{backend: BackendNVML, bootID: "boot-1", boots: 1, started: time.Unix(1000, 0), recovered: true}
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
	r.getInfos++
	return &pb.GetInfoResponse{
		ApiVersion: "v1", Backend: r.backend, BootId: r.bootID, Recovered: r.recovered,
		Generation: r.generation, StartedAt: timestamppb.New(r.started),
	}, nil
}

func (r *remote) Allocate(ctx context.Context, req *pb.AllocateRequest) (*pb.AllocateResponse, error) {
	r.mu.Lock()
	r.allocates = append(r.allocates, req)
	hang, hanging := r.allocateHang, r.hanging
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
	if r.allocateAlways != nil {
		r.mu.Unlock()
		return nil, r.allocateAlways
	}
	r.generation++
	partial, migUUID := r.partial, r.migUUID
	r.mu.Unlock()
	if hang {
		select {
		case hanging <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}
	resp := &pb.AllocateResponse{}
	for _, d := range req.GetDevices() {
		resp.Devices = append(resp.Devices, &pb.AllocatedDevice{
			DeviceIndex: d.GetDeviceIndex(), GpuUuid: d.GetGpuUuid(), Profile: d.GetProfile(), Placement: d.GetPlacement(),
			MigUuid: "MIG-" + d.GetGpuUuid(), GpuInstanceId: 3, ComputeInstanceId: 0, Outcome: pb.Outcome_CREATED,
		})
		if migUUID != "" {
			resp.Devices[len(resp.Devices)-1].MigUuid = migUUID
		}
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
	if len(r.recoverErrs) > 0 {
		err := r.recoverErrs[0]
		r.recoverErrs = r.recoverErrs[1:]
		return nil, err
	}
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
	r.boots++
	r.bootID, r.started, r.recovered, r.generation = fmt.Sprintf("boot-%d", r.boots), r.started.Add(time.Minute), false, r.restartGeneration
}

// allocatesOf returns the Allocate requests of one pod the double received so far.
func (r *remote) allocatesOf(uid string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, a := range r.allocates {
		if a.GetPod().GetUid() == uid {
			n++
		}
	}
	return n
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

func TestAllocateAnsweredOnlyUnavailableWithoutAReasonUntilMaxAttemptsIsUnreachable(t *testing.T) {
	r, c := started(t, fastOptions())
	for range 10 {
		r.allocateErrs = append(r.allocateErrs, status.Error(codes.Unavailable, "server shutting down"))
	}
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonSidecarUnreachable || e.Code != codes.Unavailable || !e.Retryable() {
		t.Fatalf("want UNAVAILABLE SIDECAR_UNREACHABLE, got %v", err)
	}
	if e.Attempts != 4 || r.allocatesOf(oneDevice.Pod.UID) != 4 || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want 4 attempts ended by MaxAttempts, not by the deadline; got %v after %d calls", err, r.allocatesOf(oneDevice.Pod.UID))
	}
	if status.Code(err) != codes.Unavailable || !strings.Contains(e.Message, "server shutting down") {
		t.Fatalf("the error does not keep the last answer: %v", err)
	}
}

func TestAllocateWhoseAttemptsRunOutOnAnAnswerWithoutAReasonKeepsTheSidecarsLastReason(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{sidecarError(codes.Unavailable, ReasonInstanceInUse, map[string]string{"mig_uuid": "MIG-busy"})}
	for range 3 {
		r.allocateErrs = append(r.allocateErrs, status.Error(codes.Unavailable, "connection reset"))
	}
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Code != codes.Unavailable || e.Metadata["mig_uuid"] != "MIG-busy" {
		t.Fatalf("want INSTANCE_IN_USE naming the instance, got %v", err)
	}
	if e.Attempts != 4 || r.allocatesOf(oneDevice.Pod.UID) != 4 {
		t.Fatalf("want 4 attempts, got %v after %d calls", err, r.allocatesOf(oneDevice.Pod.UID))
	}
}

func TestABugInTheSidecarIsReportedAsInternalAndNotRetried(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{sidecarError(codes.Internal, ReasonInternal, nil)}
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonInternal) || CodeOf(err) != codes.Internal {
		t.Fatalf("want INTERNAL INTERNAL, got %v", err)
	}
	if r.allocatesOf(oneDevice.Pod.UID) != 1 {
		t.Fatalf("a sidecar bug was retried: %d calls", r.allocatesOf(oneDevice.Pod.UID))
	}
}

// warm makes one call and waits until the connection shows READY, so that a short deadline set
// by the test bounds only the call under test, not dialling the socket and the backend check's
// first GetInfo (on a busy machine those alone can outlast it, and the call then fails as
// SIDECAR_UNREACHABLE instead).
func warm(t *testing.T, c *Client) {
	t.Helper()
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for state := c.conn.GetState(); state != connectivity.Ready; state = c.conn.GetState() {
		if !c.conn.WaitForStateChange(ctx, state) {
			t.Fatalf("the connection answered GetInfo but never showed READY (still %s)", state)
		}
	}
}

func TestAllocateFailsClosedWhenTheSidecarHangsPastTheDeadline(t *testing.T) {
	opts := fastOptions()
	opts.AllocateTimeout = 200 * time.Millisecond
	r, c := started(t, opts)
	warm(t, c)
	r.allocateHang = true
	_, err := c.Allocate(context.Background(), oneDevice)
	if CodeOf(err) != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) {
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

func TestAllocateRefusesAnAnswerWhoseMigUUIDIsNotAMigUUID(t *testing.T) {
	for _, bad := range []string{"GPU-a", "3f1c2a4e-0000-4000-8000-000000000001", "mig-3f1c2a4e-0000-4000-8000-000000000001"} {
		r, c := started(t, fastOptions())
		r.migUUID = bad
		_, err := c.Allocate(context.Background(), oneDevice)
		if !IsReason(err, ReasonInvalidResponse) || !strings.Contains(err.Error(), bad) {
			t.Fatalf("MIG UUID %q accepted or not named: %v", bad, err)
		}
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

// Backend: a simulated sidecar is never used unless the client was told it may be.

func TestASimulatedSidecarIsRefusedAtStartupAndNothingIsSent(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.backend = BackendSimulated
	r.restart()
	_, err := c.EnsureRecovered(context.Background())
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonSimulatedBackend || e.Code != codes.FailedPrecondition || e.Retryable() {
		t.Fatalf("want a non-retryable SIMULATED_BACKEND, got %v", err)
	}
	if e.Metadata["backend"] != BackendSimulated {
		t.Fatalf("the error does not name the backend: %v", e)
	}
	_, err = c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonSimulatedBackend) {
		t.Fatalf("Allocate: want SIMULATED_BACKEND, got %v", err)
	}
	if len(r.recovers) != 0 || len(r.allocates) != 0 {
		t.Fatalf("sent to a simulated sidecar: %d Recover, %d Allocate", len(r.recovers), len(r.allocates))
	}
	if r.getInfos != 2 {
		t.Fatalf("the refusal was retried: %d GetInfo calls for two client calls", r.getInfos)
	}
}

func TestASimulatedSidecarIsUsedWhenTheClientAllowsIt(t *testing.T) {
	opts := fastOptions()
	opts.AllowSimulatedBackend = true
	r, c := started(t, opts)
	r.backend = BackendSimulated
	info, err := c.EnsureRecovered(context.Background())
	if err != nil || info.Backend != BackendSimulated {
		t.Fatalf("EnsureRecovered: %+v, %v", info, err)
	}
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	if len(r.allocates) != 1 {
		t.Fatalf("sidecar saw %d Allocate calls, want 1", len(r.allocates))
	}
}

func TestASidecarNamingAnUnknownBackendIsRefusedEvenWhenSimulationIsAllowed(t *testing.T) {
	opts := fastOptions()
	opts.AllowSimulatedBackend = true
	r, c := started(t, opts)
	r.backend = ""
	if _, err := c.Allocate(context.Background(), oneDevice); !IsReason(err, ReasonInvalidResponse) {
		t.Fatalf("want INVALID_RESPONSE, got %v", err)
	}
	if len(r.allocates) != 0 {
		t.Fatal("Allocate sent to a sidecar of unknown backend")
	}
}

func TestASidecarThatRestartsOnTheSimulatedBackendIsRefusedBeforeRecover(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	r.backend = BackendSimulated
	r.mu.Unlock()
	r.restart()
	if _, err := c.Allocate(context.Background(), oneDevice); !IsReason(err, ReasonSimulatedBackend) {
		t.Fatalf("want SIMULATED_BACKEND, got %v", err)
	}
	if len(r.recovers) != 0 {
		t.Fatal("Recover sent to a simulated sidecar")
	}
}

func TestASidecarReplacedBehindTheSocketIsCheckedAgainBeforeTheNextCall(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "sidecar.sock")
	first := newRemote()
	srv := serve(t, socket, first)
	c := connect(t, socket, fastOptions())
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	// The client notices the connection going down; wait for that outcome, not for a time.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for c.backendChecked() {
		if ctx.Err() != nil {
			t.Fatal("the client never noticed the lost connection")
		}
		time.Sleep(time.Millisecond)
	}
	// Another process, already recovered by someone else, so no NOT_RECOVERED reveals it.
	second := newRemote()
	second.backend, second.bootID = BackendSimulated, "boot-other"
	serve(t, socket, second)
	if _, err := c.Allocate(context.Background(), oneDevice); !IsReason(err, ReasonSimulatedBackend) {
		t.Fatalf("want SIMULATED_BACKEND, got %v", err)
	}
	if len(second.allocates) != 0 {
		t.Fatal("Allocate sent to the simulated replacement")
	}
}

// Retries and deadlines: INSTANCE_IN_USE may last a pod's grace period.

func TestByDefaultOnlyTheDeadlineBoundsTheRetriesOfAllocate(t *testing.T) {
	opts := fastOptions()
	opts.MaxAttempts = 0
	r, c := started(t, opts)
	for range 12 {
		r.allocateErrs = append(r.allocateErrs, sidecarError(codes.Unavailable, ReasonInstanceInUse, nil))
	}
	res, err := c.Allocate(context.Background(), oneDevice)
	if err != nil {
		t.Fatalf("Allocate gave up before its deadline: %v", err)
	}
	if len(res.Devices) != 2 || r.allocatesOf(oneDevice.Pod.UID) != 13 {
		t.Fatalf("result %+v after %d calls, want 13 calls", res, r.allocatesOf(oneDevice.Pod.UID))
	}
}

// The deadlines below pass at a known point of the call (expiring, expireAt, whenHanging), not
// on a timer, so the tests can count attempts exactly; their AllocateTimeout of a minute is never
// reached.

func TestAnAllocateThatRunsOutOfTimeReportsTheLastReasonAndTheDeadline(t *testing.T) {
	ctx := newExpiring()
	opts := fastOptions()
	opts.MaxAttempts = 0
	opts.AllocateTimeout = time.Minute
	// The deadline passes as the third attempt starts: gRPC never sends it.
	opts.DialOptions = []grpc.DialOption{expireAt(pb.MigSidecar_Allocate_FullMethodName, 3, beforeSending, ctx)}
	r, c := started(t, opts)
	r.allocateErrs = []error{sidecarError(codes.Unavailable, ReasonNvmlError, map[string]string{"gpu_uuid": "GPU-a"})}
	r.allocateAlways = sidecarError(codes.Unavailable, ReasonInstanceInUse, map[string]string{"mig_uuid": "MIG-busy"})
	_, err := c.Allocate(ctx, oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Code != codes.Unavailable || e.Metadata["mig_uuid"] != "MIG-busy" {
		t.Fatalf("want the last answer, INSTANCE_IN_USE naming the instance, got %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the error does not say the deadline ran out: %v", err)
	}
	if seen := r.allocatesOf(oneDevice.Pod.UID); seen != 2 || e.Attempts != 3 {
		t.Fatalf("error counts %d attempts and the sidecar saw %d; want 3, of which the last never reached it", e.Attempts, seen)
	}
}

func TestADeadlinePassingWhileAllocateWaitsToRetryEndsTheWaitWithTheSidecarsReason(t *testing.T) {
	ctx := newExpiring()
	opts := fastOptions()
	opts.MaxAttempts = 0
	opts.AllocateTimeout = time.Minute
	// Only the deadline can end a wait this long; it passes once the first answer is in.
	opts.Backoff = Backoff{Initial: time.Hour, Max: time.Hour}
	opts.DialOptions = []grpc.DialOption{expireAt(pb.MigSidecar_Allocate_FullMethodName, 1, onceAnswered, ctx)}
	r, c := started(t, opts)
	r.allocateAlways = sidecarError(codes.Unavailable, ReasonInstanceInUse, map[string]string{"mig_uuid": "MIG-busy"})
	done := make(chan error, 1)
	go func() {
		_, err := c.Allocate(ctx, oneDevice)
		done <- err
	}()
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute): // fail instead of hanging
		t.Fatal("Allocate is still waiting out its backoff after its deadline passed")
	}
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Code != codes.Unavailable || e.Metadata["mig_uuid"] != "MIG-busy" {
		t.Fatalf("want INSTANCE_IN_USE naming the instance, got %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) || e.Attempts != 1 || r.allocatesOf(oneDevice.Pod.UID) != 1 {
		t.Fatalf("want the deadline after 1 attempt, got %v after %d calls", err, r.allocatesOf(oneDevice.Pod.UID))
	}
}

func TestADeadlineFallingInsideAnAttemptStillReportsTheEarlierReason(t *testing.T) {
	ctx := newExpiring()
	opts := fastOptions()
	opts.AllocateTimeout = time.Minute
	r, c := started(t, opts)
	r.allocateErrs = []error{sidecarError(codes.Unavailable, ReasonInstanceInUse, nil)}
	whenHanging(t, r, ctx.expire) // the second attempt hangs, and the deadline passes while it does
	_, err := c.Allocate(ctx, oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Attempts != 2 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want INSTANCE_IN_USE after 2 attempts and the deadline, got %v", err)
	}
	if seen := r.allocatesOf(oneDevice.Pod.UID); seen != 2 {
		t.Fatalf("the sidecar saw %d Allocate calls, want 2", seen)
	}
}

// The sidecar's end of the call can time out (from the grpc-timeout header) a moment before
// the client's own timer: the answer is DEADLINE_EXCEEDED while ctx.Err() is still nil.
func TestADeadlineTheSidecarReportsFirstStillReportsTheEarlierReason(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{
		sidecarError(codes.Unavailable, ReasonInstanceInUse, nil),
		status.Error(codes.DeadlineExceeded, "context deadline exceeded"),
	}
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Reason != ReasonInstanceInUse || e.Attempts != 2 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want INSTANCE_IN_USE after 2 attempts and the deadline, got %v", err)
	}
}

func TestADeadlineTheSidecarReportsFirstIsADeadline(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{status.Error(codes.DeadlineExceeded, "context deadline exceeded")}
	_, err := c.Allocate(context.Background(), oneDevice)
	if CodeOf(err) != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want DEADLINE_EXCEEDED that errors.Is the context's, got %v", err)
	}
}

// gRPC hands a ready connection to calls a moment before GetState reports it READY, so the
// first answers on a fresh connection can arrive while it still shows CONNECTING. answering
// stands in for such a sidecar deterministically: it answers GetInfo and Allocate itself, on a
// socket nobody listens to, so the connection never shows READY.
func answering(allocate error) grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
	) error {
		switch method {
		case pb.MigSidecar_GetInfo_FullMethodName:
			proto.Merge(reply.(proto.Message), &pb.GetInfoResponse{
				ApiVersion: "v1", Backend: BackendNVML, BootId: "boot-1", Recovered: true, StartedAt: timestamppb.New(time.Unix(1000, 0)),
			})
			return nil
		case pb.MigSidecar_Allocate_FullMethodName:
			return allocate
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

func TestADeadlineTheSidecarReportsBeforeTheConnectionShowsReadyIsADeadline(t *testing.T) {
	opts := fastOptions()
	opts.DialOptions = []grpc.DialOption{answering(status.Error(codes.DeadlineExceeded, "context deadline exceeded"))}
	c := connect(t, filepath.Join(t.TempDir(), "absent.sock"), opts)
	_, err := c.Allocate(context.Background(), oneDevice)
	if CodeOf(err) != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) || IsReason(err, ReasonSidecarUnreachable) {
		t.Fatalf("a sidecar that answered is called unreachable: %v", err)
	}
}

// Cancellation: a caller that gives up is not a slow or absent sidecar.

// whenHanging makes every Allocate that gets past the double's scripted answers hang, and runs
// end as soon as one starts to, so the call is cut short while the sidecar holds it.
func whenHanging(t *testing.T, r *remote, end func()) {
	t.Helper()
	hanging := make(chan struct{}, 1)
	r.mu.Lock()
	r.allocateHang, r.hanging = true, hanging
	r.mu.Unlock()
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() {
		select {
		case <-hanging:
			end()
		case <-stop:
		}
	}()
}

// cancelWhenHanging returns a context that is cancelled as soon as an Allocate starts to hang
// on the double.
func cancelWhenHanging(t *testing.T, r *remote) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	whenHanging(t, r, cancel)
	return ctx
}

func assertCancelled(t *testing.T, err error) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Canceled || !errors.Is(err, context.Canceled) {
		t.Fatalf("want CANCELLED that errors.Is context.Canceled, got %v", err)
	}
	if errors.Is(err, context.DeadlineExceeded) || e.Reason == ReasonSidecarUnreachable ||
		strings.Contains(e.Message, "did not answer") {
		t.Fatalf("a cancelled call is blamed on time or on the sidecar: %v", err)
	}
	return e
}

func TestACancelledAllocateIsReportedAsCancelledNotAsASlowSidecar(t *testing.T) {
	r, c := started(t, fastOptions())
	_, err := c.Allocate(cancelWhenHanging(t, r), oneDevice)
	if e := assertCancelled(t, err); e.Reason != "" {
		t.Fatalf("a cancelled call carries reason %q though the sidecar gave none", e.Reason)
	}
}

func TestACancelledAllocateNamesTheSidecarsLastAnswer(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{sidecarError(codes.Unavailable, ReasonInstanceInUse, map[string]string{"mig_uuid": "MIG-busy"})}
	_, err := c.Allocate(cancelWhenHanging(t, r), oneDevice)
	e := assertCancelled(t, err)
	if !strings.Contains(e.Message, ReasonInstanceInUse) || !strings.Contains(e.Message, "MIG-busy") || e.Attempts != 2 {
		t.Fatalf("the error does not name the sidecar's last answer after 2 attempts: %v", err)
	}
}

func TestACallCancelledWhileNoSidecarAnswersIsNotCalledUnreachable(t *testing.T) {
	c := connect(t, filepath.Join(t.TempDir(), "absent.sock"), fastOptions())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := c.Allocate(ctx, oneDevice)
	_ = assertCancelled(t, err) // the assertion is the test; the error's fields are not needed here
}

func TestTheRecoveryInsideAllocateRunsUnderAllocatesDeadline(t *testing.T) {
	opts := fastOptions()
	opts.CallTimeout, opts.AllocateTimeout = time.Minute, 5*time.Second
	var deadline time.Time
	var hasDeadline bool
	opts.ListActive = func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		deadline, hasDeadline = ctx.Deadline()
		return annotated, nil
	}
	r, c := started(t, opts)
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.restart()
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	// Allocate's deadline is far shorter than CallTimeout: a list bounded by anything but
	// Allocate's deadline would end later than Allocate could have.
	if latest := time.Now().Add(opts.AllocateTimeout); !hasDeadline || deadline.After(latest) {
		t.Fatalf("the pod list ran with deadline %v (set: %t), beyond Allocate's %v", deadline, hasDeadline, latest)
	}
}

func TestTheRecoveryInsideGetInfoRunsUnderADeadlineWhenTheCallerGivesNone(t *testing.T) {
	opts := fastOptions()
	var deadline time.Time
	var hasDeadline bool
	opts.ListActive = func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		deadline, hasDeadline = ctx.Deadline()
		return annotated, nil
	}
	r, c := started(t, opts)
	r.restart()
	if _, err := c.EnsureRecovered(context.Background()); err != nil {
		t.Fatal(err)
	}
	if latest := time.Now().Add(opts.CallTimeout); !hasDeadline || deadline.After(latest) {
		t.Fatalf("the pod list ran with deadline %v (set: %t), beyond CallTimeout's %v", deadline, hasDeadline, latest)
	}
}

// A call that finds the sidecar not recovered while another call's recovery is under way waits
// for that recovery within its own deadline, and says what it was waiting for.

// ended marks the context of the call under test: afterAnswer ends it once an RPC made with it
// has been answered, that is at a known point of the call rather than after some time.
type ended struct{}

func afterAnswer(method string, end func()) grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
	) error {
		err := invoker(ctx, m, req, reply, cc, opts...)
		if m == method && ctx.Value(ended{}) != nil {
			end()
		}
		return err
	})
}

// expiring is a context whose deadline passes when the test says so rather than on a timer.
type expiring struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newExpiring() *expiring {
	return &expiring{Context: context.Background(), done: make(chan struct{})}
}

func (x *expiring) Done() <-chan struct{} { return x.done }

func (x *expiring) Err() error {
	select {
	case <-x.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

func (x *expiring) expire() { x.once.Do(func() { close(x.done) }) }

// whileAnotherCallRecovers starts an Allocate that finds the sidecar restarted and keeps its
// recovery under way (its pod list does not return) while call runs; it returns call's error
// once that recovery has finished. end is what afterAnswer runs once call's GetInfo has been
// answered.
func whileAnotherCallRecovers(t *testing.T, end func(), call func(*Client) error) error {
	t.Helper()
	opts := fastOptions()
	opts.AllocateTimeout = time.Minute
	listing := make(chan struct{}, 1)
	finish := make(chan struct{})
	opts.ListActive = func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		select {
		case listing <- struct{}{}:
		default:
		}
		select {
		case <-finish:
			return annotated, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	opts.DialOptions = []grpc.DialOption{afterAnswer(pb.MigSidecar_GetInfo_FullMethodName, end)}
	r, c := started(t, opts)
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.restart()
	recovering := make(chan error, 1)
	go func() {
		_, err := c.Allocate(context.Background(), oneDevice)
		recovering <- err
	}()
	var once sync.Once
	stop := func() { once.Do(func() { close(finish) }) }
	t.Cleanup(stop)
	select {
	case <-listing:
	case err := <-recovering:
		t.Fatalf("the first Allocate did not start a recovery: %v", err)
	}
	waited := make(chan error, 1)
	go func() { waited <- call(c) }()
	var err error
	select {
	case err = <-waited:
	case <-time.After(10 * time.Second): // fail instead of hanging
		t.Fatal("the call is still waiting for the other call's recovery after its context ended")
	}
	stop()
	if rerr := <-recovering; rerr != nil {
		t.Fatalf("the recovering Allocate: %v", rerr)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.recovers) != 1 {
		t.Fatalf("%d Recover calls, want the recovering call's only", len(r.recovers))
	}
	return err
}

func TestACallWhoseDeadlinePassesWhileAnotherCallRecoversSaysItWaitedForTheRecovery(t *testing.T) {
	ctx := newExpiring()
	err := whileAnotherCallRecovers(t, ctx.expire, func(c *Client) error {
		_, err := c.GetInfo(context.WithValue(ctx, ended{}, true))
		return err
	})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want DEADLINE_EXCEEDED that errors.Is the context's, got %v", err)
	}
	if e.Reason != ReasonNotRecovered || !strings.Contains(e.Message, "recovery") || strings.Contains(e.Message, "did not answer") {
		t.Fatalf("the error does not say the call waited for a recovery in progress: %v", err)
	}
}

func TestACallCancelledWhileAnotherCallRecoversIsCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), ended{}, true))
	defer cancel()
	err := whileAnotherCallRecovers(t, cancel, func(c *Client) error {
		_, err := c.GetInfo(ctx)
		return err
	})
	e := assertCancelled(t, err)
	if !strings.Contains(e.Message, "recovery") {
		t.Fatalf("the error does not say the call waited for a recovery in progress: %v", err)
	}
}

// Restarts: concurrent callers, stale pod lists, failed lists.

func TestConcurrentAllocatesDuringARestartShareOneRecoverAndEachRepeatsOnce(t *testing.T) {
	const callers = 4
	opts := fastOptions()
	r := newRemote()
	// The list is taken only once every caller has been answered NOT_RECOVERED, so all of
	// them are waiting for the same recovery.
	opts.ListActive = func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		for {
			r.mu.Lock()
			n := len(r.allocates)
			r.mu.Unlock()
			if n >= callers {
				return annotated, nil
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			time.Sleep(time.Millisecond)
		}
	}
	socket := filepath.Join(t.TempDir(), "sidecar.sock")
	serve(t, socket, r)
	c := connect(t, socket, opts)
	if _, err := c.GetInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.restart()
	errs := make([]error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := oneDevice
			req.Pod.UID = fmt.Sprintf("uid-%d", i)
			_, errs[i] = c.Allocate(context.Background(), req)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
		if n := r.allocatesOf(fmt.Sprintf("uid-%d", i)); n != 2 {
			t.Fatalf("caller %d sent Allocate %d times, want 2 (refused, then repeated once)", i, n)
		}
	}
	if len(r.recovers) != 1 {
		t.Fatalf("%d Recover calls, want 1", len(r.recovers))
	}
}

func TestAPodListTakenWhileTheSidecarRestartedAgainIsNeverSent(t *testing.T) {
	opts := fastOptions()
	r, c := started(t, opts)
	fresh := []*pb.ActiveAllocation{proto.Clone(annotated[0]).(*pb.ActiveAllocation)}
	fresh[0].MigUuid = "MIG-fresh"
	lists := 0
	opts.ListActive = func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		if lists == 1 {
			r.restart() // the sidecar restarts while the first list is taken
			return annotated, nil
		}
		return fresh, nil
	}
	c.opts.ListActive = opts.ListActive
	r.restart()
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	if len(r.recovers) != 1 || r.recovers[0].GetActive()[0].GetMigUuid() != "MIG-fresh" {
		t.Fatalf("Recover not sent once with the fresh list: %v", r.recovers)
	}
}

func TestNoRecoverIsSentWhenSomeoneElseRecoveredTheSidecarDuringTheList(t *testing.T) {
	opts := fastOptions()
	r, c := started(t, opts)
	c.opts.ListActive = func(context.Context) ([]*pb.ActiveAllocation, error) {
		// Another client recovers the sidecar and allocates while this list is taken.
		r.mu.Lock()
		r.recovered = true
		r.generation++
		r.mu.Unlock()
		return annotated, nil
	}
	r.restart()
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	if len(r.recovers) != 0 {
		t.Fatalf("a stale list was sent with Recover: %v", r.recovers)
	}
}

func TestARecoverCutShortByARestartStartsOverWithAFreshList(t *testing.T) {
	opts := fastOptions()
	lists := 0
	opts.ListActive = func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		return annotated, nil
	}
	r, c := started(t, opts)
	r.restart()
	r.recoverErrs = []error{status.Error(codes.Unavailable, "connection reset")}
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatal(err)
	}
	if lists != 2 || len(r.recovers) != 2 {
		t.Fatalf("%d lists and %d Recover calls, want 2 and 2", lists, len(r.recovers))
	}
}

func TestAListThatFailsIsNeverSentEvenWithTheEntriesItGot(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, errors.New("page 2 of the pod list failed"))
	r, c := started(t, opts)
	r.restart()
	if _, err := c.Allocate(context.Background(), oneDevice); !IsReason(err, ReasonPodListFailed) {
		t.Fatalf("Allocate: want POD_LIST_FAILED, got %v", err)
	}
	if _, err := c.ReleaseByPodList(context.Background(), opts.ListActive); !IsReason(err, ReasonPodListFailed) {
		t.Fatalf("ReleaseByPodList: want POD_LIST_FAILED, got %v", err)
	}
	if len(r.recovers) != 0 || len(r.syncs) != 0 {
		t.Fatalf("a partial list was sent: %d Recover, %d SyncActive", len(r.recovers), len(r.syncs))
	}
}

func TestReleaseByPodListStartsOverWhenTheSidecarRestartsDuringTheList(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.generation, r.restartGeneration = 7, 9
	lists := 0
	podList := func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		if lists == 1 {
			r.restart()
		}
		return annotated, nil
	}
	res, err := c.ReleaseByPodList(context.Background(), podList)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.syncs) != 1 || r.syncs[0].GetGeneration() != 9 || res.Generation != 9 {
		t.Fatalf("SyncActive must carry the restarted sidecar's generation 9: %v", r.syncs)
	}
	if len(r.recovers) != 1 || lists != 2 {
		t.Fatalf("%d Recover calls and %d lists, want 1 and 2", len(r.recovers), lists)
	}
}

func TestReleaseByPodListReleasesNothingWhenTheSidecarRestartsDuringEveryList(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	podList := func(context.Context) ([]*pb.ActiveAllocation, error) {
		r.restart()
		return annotated, nil
	}
	_, err := c.ReleaseByPodList(context.Background(), podList)
	if !IsReason(err, ReasonSidecarRestarted) || CodeOf(err) != codes.Unavailable {
		t.Fatalf("want SIDECAR_RESTARTED, got %v", err)
	}
	if len(r.syncs) != 0 {
		t.Fatalf("SyncActive sent with a fence from another run: %v", r.syncs)
	}
}

// Recover answered UNAVAILABLE (an NVML error while the sidecar gathers the layout, a failed
// record write, a restart during the call) may succeed later: it is repeated with backoff and a
// fresh pod list until the call's deadline, not given up after a few quick tries.

// expiryPoint is where in a call expireAt ends the deadline.
type expiryPoint int

const (
	// beforeSending: the call has started but is not handed to gRPC yet, which then never sends it.
	beforeSending expiryPoint = iota
	// onceAnswered: the sidecar's answer is in, and the client finds the deadline passed after it.
	onceAnswered
)

// expireAt returns a dial option that ends ctx at point of the n-th call of method, and waits
// until the call's own context has seen it, so the client finds the deadline passed at a known
// point of the call rather than after some time.
func expireAt(method string, n int, point expiryPoint, ctx *expiring) grpc.DialOption {
	var mu sync.Mutex
	calls := 0
	return grpc.WithChainUnaryInterceptor(func(rctx context.Context, m string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
	) error {
		if m != method {
			return invoker(rctx, m, req, reply, cc, opts...)
		}
		mu.Lock()
		calls++
		nth := calls == n
		mu.Unlock()
		end := func() {
			ctx.expire()
			<-rctx.Done()
		}
		if nth && point == beforeSending {
			end()
		}
		err := invoker(rctx, m, req, reply, cc, opts...)
		if nth && point == onceAnswered {
			end()
		}
		return err
	})
}

func TestARecoverAnsweredUnavailableIsRepeatedWithAFreshListUntilItSucceeds(t *testing.T) {
	opts := fastOptions()
	opts.MaxAttempts = 0
	opts.AllocateTimeout = time.Minute
	lists := 0
	opts.ListActive = func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		return annotated, nil
	}
	r, c := started(t, opts)
	r.restart()
	r.recoverErrs = []error{
		sidecarError(codes.Unavailable, ReasonNvmlError, map[string]string{"operation": "get_gpu_instances"}),
		sidecarError(codes.Unavailable, ReasonStateWriteFailed, nil),
		status.Error(codes.Unavailable, "connection reset"),
		sidecarError(codes.Unavailable, ReasonNvmlError, nil),
	}
	if _, err := c.Allocate(context.Background(), oneDevice); err != nil {
		t.Fatalf("Allocate gave up on a recovery that succeeds within its deadline: %v", err)
	}
	if len(r.recovers) != 5 || lists != 5 {
		t.Fatalf("%d Recover calls and %d pod lists, want 5 and 5 (a fresh list for each)", len(r.recovers), lists)
	}
	for _, req := range r.recovers {
		if len(req.GetActive()) != 1 || !proto.Equal(req.GetActive()[0], annotated[0]) {
			t.Fatalf("Recover not sent with the active list: %v", req)
		}
	}
	if r.allocatesOf(oneDevice.Pod.UID) != 2 {
		t.Fatalf("sidecar saw %d Allocate calls, want 2 (refused, then repeated once)", r.allocatesOf(oneDevice.Pod.UID))
	}
}

func TestARecoverUnavailableUntilTheDeadlineReportsTheSidecarsLastReason(t *testing.T) {
	ctx := newExpiring()
	opts := fastOptions()
	opts.MaxAttempts = 0
	opts.AllocateTimeout = time.Minute
	opts.ListActive = activeList(annotated, nil)
	opts.DialOptions = []grpc.DialOption{expireAt(pb.MigSidecar_Recover_FullMethodName, 3, onceAnswered, ctx)}
	r, c := started(t, opts)
	r.restart()
	r.recoverErr = sidecarError(codes.Unavailable, ReasonNvmlError, map[string]string{"gpu_uuid": "GPU-a"})
	_, err := c.Allocate(ctx, oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Reason != ReasonNvmlError || e.Metadata["gpu_uuid"] != "GPU-a" {
		t.Fatalf("want the sidecar's UNAVAILABLE NVML_ERROR naming the GPU, got %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) || e.Attempts != 3 {
		t.Fatalf("the error does not say the deadline ended 3 Recover attempts: %v", err)
	}
	if len(r.recovers) != 3 || r.allocatesOf(oneDevice.Pod.UID) != 1 {
		t.Fatalf("%d Recover and %d Allocate calls, want 3 and 1 (not repeated unrecovered)",
			len(r.recovers), r.allocatesOf(oneDevice.Pod.UID))
	}
}

func TestMaxAttemptsAlsoCapsTheRecoverCallsOfOneRecovery(t *testing.T) {
	opts := fastOptions()
	opts.MaxAttempts = 2
	opts.ListActive = activeList(annotated, nil)
	r, c := started(t, opts)
	r.restart()
	r.recoverErr = sidecarError(codes.Unavailable, ReasonStateWriteFailed, map[string]string{"file": "x.json"})
	_, err := c.Allocate(context.Background(), oneDevice)
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Reason != ReasonStateWriteFailed || e.Metadata["file"] != "x.json" {
		t.Fatalf("want the sidecar's UNAVAILABLE STATE_WRITE_FAILED, got %v", err)
	}
	if len(r.recovers) != 2 || e.Attempts != 2 || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%d Recover calls, error %v; want 2 attempts and no deadline", len(r.recovers), err)
	}
}

func TestARecoveryWhosePodListIsSpoiledByARestartEveryTimeFailsWithoutSendingIt(t *testing.T) {
	opts := fastOptions()
	r, c := started(t, opts)
	lists := 0
	c.opts.ListActive = func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		r.restart()
		return annotated, nil
	}
	r.restart()
	_, err := c.Allocate(context.Background(), oneDevice)
	if !IsReason(err, ReasonRecoveryFailed) || CodeOf(err) != codes.Unavailable {
		t.Fatalf("want RECOVERY_FAILED, got %v", err)
	}
	if len(r.recovers) != 0 || lists != recoverTries {
		t.Fatalf("%d Recover calls and %d lists, want 0 and %d", len(r.recovers), lists, recoverTries)
	}
}

// ReleaseByPodList on a sidecar that has not recovered: only a real restart starts a pass over.

func TestReleaseByPodListWithoutAListCallbackFailsClosedOnAnUnrecoveredSidecar(t *testing.T) {
	r, c := started(t, fastOptions()) // no ListActive: nothing can recover the sidecar
	r.restart()
	lists := 0
	_, err := c.ReleaseByPodList(context.Background(), func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		return annotated, nil
	})
	if !IsReason(err, ReasonNotRecovered) || CodeOf(err) != codes.FailedPrecondition {
		t.Fatalf("want FAILED_PRECONDITION NOT_RECOVERED, got %v", err)
	}
	if lists != 0 || len(r.syncs) != 0 || len(r.recovers) != 0 {
		t.Fatalf("%d pod lists, %d SyncActive, %d Recover for a sidecar nobody can recover; want none", lists, len(r.syncs), len(r.recovers))
	}
}

// restartAfterRecover returns a dial option that restarts the double once, right after its first
// Recover has been answered: the sidecar is gone again before the caller can use the recovery.
func restartAfterRecover(r *remote) grpc.DialOption {
	var once sync.Once
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
	) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if method == pb.MigSidecar_Recover_FullMethodName && err == nil {
			once.Do(r.restart)
		}
		return err
	})
}

func TestReleaseByPodListTakesNoListWhileTheSidecarHasRestartedAgainSinceItsRecovery(t *testing.T) {
	opts := fastOptions()
	opts.ListActive = activeList(annotated, nil)
	r := newRemote()
	opts.DialOptions = []grpc.DialOption{restartAfterRecover(r)}
	socket := filepath.Join(t.TempDir(), "sidecar.sock")
	serve(t, socket, r)
	c := connect(t, socket, opts)
	r.restart()
	r.restartGeneration = 4
	lists := 0
	res, err := c.ReleaseByPodList(context.Background(), func(context.Context) ([]*pb.ActiveAllocation, error) {
		lists++
		return annotated, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if lists != 1 || len(r.recovers) != 2 {
		t.Fatalf("%d pod lists and %d Recover calls, want 1 and 2 (no list taken from the restarted sidecar)", lists, len(r.recovers))
	}
	if len(r.syncs) != 1 || r.syncs[0].GetGeneration() != 4 || res.Generation != 4 {
		t.Fatalf("SyncActive must carry the last run's generation 4: %v", r.syncs)
	}
}

func TestARequestTheTransportRefusesAsTooLargeIsATypedErrorAndNotRetried(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{status.Error(codes.ResourceExhausted, "grpc: received message larger than max (1048576 vs. 729088)")}
	_, err := c.Allocate(context.Background(), oneDevice)
	if !errors.Is(err, ErrRequestTooLarge) || !IsReason(err, ReasonRequestTooLarge) {
		t.Fatalf("not the typed too-large error: %v", err)
	}
	if CodeOf(err) != codes.ResourceExhausted || len(r.allocates) != 1 {
		t.Fatalf("code %v after %d calls, want RESOURCE_EXHAUSTED after one", CodeOf(err), len(r.allocates))
	}
	var e *Error
	if !errors.As(err, &e) || e.Retryable() {
		t.Fatalf("a too-large request must not be retryable: %v", err)
	}
}

func TestAResourceExhaustedWithTheSidecarsReasonKeepsItsReason(t *testing.T) {
	r, c := started(t, fastOptions())
	r.allocateErrs = []error{sidecarError(codes.ResourceExhausted, "SOMETHING_ELSE", nil)}
	_, err := c.Allocate(context.Background(), oneDevice)
	if errors.Is(err, ErrRequestTooLarge) || !IsReason(err, "SOMETHING_ELSE") {
		t.Fatalf("a reasoned RESOURCE_EXHAUSTED was taken for the transport's: %v", err)
	}
}
