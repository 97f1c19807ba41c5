package migclient

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Defaults used when an Options field is zero.
const (
	DefaultCallTimeout     = 10 * time.Second
	DefaultAllocateTimeout = 60 * time.Second
	DefaultMaxAttempts     = 5
	DefaultBackoffInitial  = 100 * time.Millisecond
	DefaultBackoffMax      = 2 * time.Second
)

// Backoff spaces the retries of a call that failed with UNAVAILABLE: the n-th retry waits a
// random time in [d/2, d] where d = min(Max, Initial*2^(n-1)), so that a restarting sidecar is
// not hit by every caller at once.
type Backoff struct {
	Initial time.Duration
	Max     time.Duration
}

// ListActiveFunc returns every allocation the plugin knows to be live, as read from the
// hami.io/vgpu-mig-allocations annotations of a fresh pod list. It must fail rather than return
// a partial list: the sidecar treats a missing entry as a released allocation.
type ListActiveFunc func(ctx context.Context) ([]*pb.ActiveAllocation, error)

// Options configure a Client. Zero values take the defaults above.
type Options struct {
	// CallTimeout bounds every RPC except Allocate, retries included.
	CallTimeout time.Duration
	// AllocateTimeout bounds Allocate, retries included. kubelet gives Allocate no deadline,
	// so without this a wedged sidecar would hang container creation forever.
	AllocateTimeout time.Duration
	// MaxAttempts caps the calls per RPC (first call included); only UNAVAILABLE is retried.
	MaxAttempts int
	// Backoff spaces the retries.
	Backoff Backoff
	// ListActive enables automatic recovery: when the sidecar answers NOT_RECOVERED (it
	// restarted) or GetInfo shows it has not recovered, the client calls Recover with this
	// list and retries the call once. Nil disables recovery; such calls then fail closed.
	ListActive ListActiveFunc
	// DialOptions are appended to the client's own (tests, interceptors).
	DialOptions []grpc.DialOption
}

func (o Options) withDefaults() Options {
	if o.CallTimeout <= 0 {
		o.CallTimeout = DefaultCallTimeout
	}
	if o.AllocateTimeout <= 0 {
		o.AllocateTimeout = DefaultAllocateTimeout
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = DefaultMaxAttempts
	}
	if o.Backoff.Initial <= 0 {
		o.Backoff.Initial = DefaultBackoffInitial
	}
	if o.Backoff.Max < o.Backoff.Initial {
		o.Backoff.Max = max(DefaultBackoffMax, o.Backoff.Initial)
	}
	return o
}

// Client talks to one sidecar over its Unix socket. It is safe for concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	rpc    pb.MigSidecarClient
	target string
	opts   Options

	mu       sync.Mutex
	seen     *incarnation
	restarts int

	// recoverMu makes concurrent calls that all hit NOT_RECOVERED share one Recover.
	recoverMu sync.Mutex
}

// New prepares a client for the sidecar listening on socketPath. It does not wait for the
// sidecar: at node start the plugin may come up first, and each call waits for the socket
// (wait-for-ready) within its own deadline instead.
func New(ctx context.Context, socketPath string, opts Options) (*Client, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if socketPath == "" {
		return nil, errors.New("migclient: empty socket path")
	}
	abs, err := filepath.Abs(socketPath)
	if err != nil {
		return nil, fmt.Errorf("migclient: socket path %q: %w", socketPath, err)
	}
	opts = opts.withDefaults()
	target := "unix://" + abs
	dial := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Wait for the socket instead of failing fast: a restarting sidecar is the normal
		// case, and every call carries a deadline that bounds the wait.
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)),
		// gRPC's default reconnect backoff grows to two minutes; a local socket that comes
		// back should be noticed within a call's deadline, so keep the delay short.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   time.Second,
			},
			MinConnectTimeout: 2 * time.Second,
		}),
	}
	conn, err := grpc.NewClient(target, append(dial, opts.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("migclient: dial %s: %w", target, err)
	}
	conn.Connect()
	return &Client{conn: conn, rpc: pb.NewMigSidecarClient(conn), target: target, opts: opts}, nil
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Target is the gRPC target the client dials ("unix:///...").
func (c *Client) Target() string { return c.target }

// Restarts counts the sidecar restarts this client has noticed (boot_id or started_at changed
// between two GetInfo answers).
func (c *Client) Restarts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.restarts
}

// call runs fn under one deadline, retrying UNAVAILABLE with backoff. fn must send the same
// request every time: that is what makes a retried Allocate converge on the same instance.
func (c *Client) call(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	attempt := 0
	for {
		attempt++
		err := fn(ctx)
		if err == nil {
			return nil
		}
		if CodeOf(err) != codes.Unavailable || attempt >= c.opts.MaxAttempts {
			return c.finalError(ctx, op, timeout, err, attempt)
		}
		t := time.NewTimer(c.delay(attempt))
		select {
		case <-ctx.Done():
			t.Stop()
			return c.finalError(ctx, op, timeout, err, attempt)
		case <-t.C:
		}
	}
}

// finalError turns the last error of a call into an *Error. A call that ran out of time while
// the connection was not ready is reported as SIDECAR_UNREACHABLE, so the plugin can tell "the
// sidecar is down" from "the sidecar said no".
func (c *Client) finalError(ctx context.Context, op string, timeout time.Duration, err error, attempts int) error {
	e := fromRPC(op, err, attempts)
	if ctx.Err() == nil && e.Code != codes.DeadlineExceeded {
		return e
	}
	if ctx.Err() != nil && e.Code == codes.Unavailable {
		// The deadline fell during the backoff after a retryable answer: keep the sidecar's
		// reason, but say that time ran out.
		e.Message = fmt.Sprintf("%s (deadline %s reached while retrying)", e.Message, timeout)
		return e
	}
	if state := c.conn.GetState(); state != connectivity.Ready {
		return &Error{
			Op: op, Code: codes.Unavailable, Reason: ReasonSidecarUnreachable, Attempts: attempts, cause: err,
			Message: fmt.Sprintf("no sidecar answered on %s within %s (connection %s); nothing was changed by this call",
				c.target, timeout, state),
		}
	}
	e.Code = codes.DeadlineExceeded
	e.Message = fmt.Sprintf("sidecar did not answer within %s: %s; retry with the same request", timeout, e.Message)
	return e
}

func (c *Client) delay(attempt int) time.Duration {
	d := c.opts.Backoff.Initial << min(attempt-1, 20)
	if d <= 0 || d > c.opts.Backoff.Max {
		d = c.opts.Backoff.Max
	}
	return d/2 + rand.N(d/2+1)
}

// withRecovery runs a mutating call; if the sidecar answers NOT_RECOVERED it recovers it (when
// a ListActive callback is configured) and repeats the call exactly once.
func (c *Client) withRecovery(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	err := c.call(ctx, op, timeout, fn)
	if !IsReason(err, ReasonNotRecovered) {
		return err
	}
	if rerr := c.recoverFor(ctx, op, err); rerr != nil {
		return rerr
	}
	return c.call(ctx, op, timeout, fn)
}

// recoverFor runs Recover on behalf of op. Only one Recover runs at a time; callers that waited
// for it find the sidecar recovered and skip their own.
func (c *Client) recoverFor(ctx context.Context, op string, cause error) error {
	if c.opts.ListActive == nil {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonNotRecovered, Attempts: 1, cause: cause,
			Message: "the sidecar has not recovered and this client has no ListActive callback to recover it",
		}
	}
	c.recoverMu.Lock()
	defer c.recoverMu.Unlock()
	info, err := c.getInfo(ctx)
	if err != nil {
		return err
	}
	if info.Recovered {
		return nil
	}
	active, err := c.opts.ListActive(ctx)
	if err != nil {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
			Message: fmt.Sprintf("listing active allocations to recover the sidecar: %v", err),
		}
	}
	if _, err := c.Recover(ctx, active); err != nil {
		var e *Error
		if errors.As(err, &e) {
			e.Op = "Recover (needed by " + op + ")"
		}
		return err
	}
	return nil
}

// getInfo calls GetInfo and notes a restart, without triggering recovery.
func (c *Client) getInfo(ctx context.Context) (Info, error) {
	var resp *pb.GetInfoResponse
	err := c.call(ctx, "GetInfo", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.GetInfo(ctx, &pb.GetInfoRequest{})
		return err
	})
	if err != nil {
		return Info{}, err
	}
	info := infoFromPB(resp)
	inc := info.incarnation()
	c.mu.Lock()
	if c.seen != nil && *c.seen != inc {
		c.restarts++
	}
	c.seen = &inc
	c.mu.Unlock()
	return info, nil
}

// GetInfo returns the sidecar's identity. When it shows a sidecar that has not recovered (a
// restart, or the first start of the node) and a ListActive callback is configured, the client
// recovers it first and returns the identity after recovery.
func (c *Client) GetInfo(ctx context.Context) (Info, error) {
	info, err := c.getInfo(ctx)
	if err != nil || info.Recovered || c.opts.ListActive == nil {
		return info, err
	}
	if err := c.recoverFor(ctx, "GetInfo", nil); err != nil {
		return Info{}, err
	}
	return c.getInfo(ctx)
}

// EnsureRecovered is what the plugin calls at startup before serving kubelet: it returns once
// the sidecar has recovered, recovering it with ListActive when needed.
func (c *Client) EnsureRecovered(ctx context.Context) (Info, error) {
	info, err := c.GetInfo(ctx)
	if err != nil {
		return Info{}, err
	}
	if !info.Recovered {
		return Info{}, newError("EnsureRecovered", codes.FailedPrecondition, ReasonNotRecovered,
			"the sidecar has not recovered and no ListActive callback is configured", nil)
	}
	return info, nil
}

// Recover sends the plugin's active allocations for startup recovery. It is idempotent.
func (c *Client) Recover(ctx context.Context, active []*pb.ActiveAllocation) (RecoverReport, error) {
	req := &pb.RecoverRequest{Active: active}
	var resp *pb.RecoverResponse
	err := c.call(ctx, "Recover", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Recover(ctx, req)
		return err
	})
	if err != nil {
		return RecoverReport{}, err
	}
	return recoverReportFromPB(resp), nil
}

// Allocate realizes the reservations of one container, all or nothing. UNAVAILABLE answers
// (and a connection lost mid-call) are retried with the identical request, so the allocation
// key is the same and a call that already succeeded server-side answers ALREADY_ALLOCATED.
// The result always holds exactly one device per requested device, in request order; any
// other answer is an INVALID_RESPONSE error, never a partial success.
func (c *Client) Allocate(ctx context.Context, req AllocateRequest) (AllocateResult, error) {
	if err := validateAllocate(req); err != nil {
		return AllocateResult{}, err
	}
	pbReq := req.toPB()
	var resp *pb.AllocateResponse
	err := c.withRecovery(ctx, "Allocate", c.opts.AllocateTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Allocate(ctx, pbReq)
		return err
	})
	if err != nil {
		return AllocateResult{}, err
	}
	return allocateResult(req, resp)
}

func validateAllocate(req AllocateRequest) error {
	bad := func(msg string, args ...any) error {
		return newError("Allocate", codes.InvalidArgument, ReasonInvalidRequest, fmt.Sprintf(msg, args...), nil)
	}
	if req.Pod.UID == "" {
		return bad("pod UID is empty")
	}
	if len(req.Devices) == 0 {
		return bad("no devices requested for pod %s container %d", req.Pod.UID, req.ContainerIndex)
	}
	seen := make(map[uint32]bool, len(req.Devices))
	for _, d := range req.Devices {
		if seen[d.DeviceIndex] {
			return bad("device index %d requested twice", d.DeviceIndex)
		}
		seen[d.DeviceIndex] = true
		if d.GPUUUID == "" || d.Profile == "" || d.Placement.Size == 0 {
			return bad("device %d: GPU UUID, profile and a placement of size > 0 are required", d.DeviceIndex)
		}
	}
	return nil
}

// allocateResult checks that the answer covers every requested device with the requested
// reservation and a complete runtime identity.
func allocateResult(req AllocateRequest, resp *pb.AllocateResponse) (AllocateResult, error) {
	invalid := func(msg string, args ...any) (AllocateResult, error) {
		return AllocateResult{}, newError("Allocate", codes.Internal, ReasonInvalidResponse, fmt.Sprintf(msg, args...), nil)
	}
	byIndex := make(map[uint32]*pb.AllocatedDevice, len(resp.GetDevices()))
	for _, d := range resp.GetDevices() {
		if _, dup := byIndex[d.GetDeviceIndex()]; dup {
			return invalid("device %d answered twice", d.GetDeviceIndex())
		}
		byIndex[d.GetDeviceIndex()] = d
	}
	if len(byIndex) != len(req.Devices) {
		return invalid("asked for %d devices, got %d", len(req.Devices), len(byIndex))
	}
	out := AllocateResult{Devices: make([]AllocatedDevice, 0, len(req.Devices)), Reclaimed: instanceRefsFromPB(resp.GetReclaimed())}
	for _, want := range req.Devices {
		got, ok := byIndex[want.DeviceIndex]
		if !ok {
			return invalid("device %d missing from the answer", want.DeviceIndex)
		}
		dev := AllocatedDevice{
			DeviceIndex:       got.GetDeviceIndex(),
			GPUUUID:           got.GetGpuUuid(),
			Profile:           got.GetProfile(),
			Placement:         placementFromPB(got.GetPlacement()),
			MigUUID:           got.GetMigUuid(),
			GPUInstanceID:     got.GetGpuInstanceId(),
			ComputeInstanceID: got.GetComputeInstanceId(),
			CDIDevice:         got.GetCdiDevice(),
			Outcome:           outcomeFromPB(got.GetOutcome()),
		}
		if dev.GPUUUID != want.GPUUUID || dev.Profile != want.Profile || dev.Placement != want.Placement {
			return invalid("device %d: asked for %s %s at %s, got %s %s at %s", want.DeviceIndex,
				want.GPUUUID, want.Profile, want.Placement, dev.GPUUUID, dev.Profile, dev.Placement)
		}
		if dev.MigUUID == "" || dev.Outcome == OutcomeUnspecified {
			return invalid("device %d: answer has no MIG UUID or no outcome", want.DeviceIndex)
		}
		out.Devices = append(out.Devices, dev)
	}
	return out, nil
}

// Release reports a confirmed release of a pod: its ACTIVE instances become IDLE. Prefer
// ReleaseByPodList, which is level-triggered and cannot lose a release.
func (c *Client) Release(ctx context.Context, podUID string) ([]InstanceRef, error) {
	if podUID == "" {
		return nil, newError("Release", codes.InvalidArgument, ReasonInvalidRequest, "pod UID is empty", nil)
	}
	req := &pb.ReleaseRequest{PodUid: podUID}
	var resp *pb.ReleaseResponse
	err := c.withRecovery(ctx, "Release", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Release(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	return instanceRefsFromPB(resp.GetReleased()), nil
}

// SyncActive sends a pod list taken after generation was read. It is not retried after a
// recovery: a restarted sidecar numbers generations afresh, so the caller must read the
// generation again (ReleaseByPodList does).
func (c *Client) SyncActive(ctx context.Context, generation uint64, active []*pb.ActiveAllocation) (SyncResult, error) {
	req := &pb.SyncActiveRequest{Generation: generation, Active: active}
	var resp *pb.SyncActiveResponse
	err := c.call(ctx, "SyncActive", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SyncActive(ctx, req)
		return err
	})
	if err != nil {
		return SyncResult{}, err
	}
	return SyncResult{
		Generation:  generation,
		Idled:       instanceRefsFromPB(resp.GetIdled()),
		Reactivated: instanceRefsFromPB(resp.GetReactivated()),
	}, nil
}

// ReleaseByPodList is the plugin's release path: read the generation, then list pods, then
// SyncActive with that generation. Reading the generation first is the fence: an Allocate that
// completes while the list is being taken has a later generation, so the sidecar keeps it
// ACTIVE even though the list does not show it yet. A failed list sends nothing.
func (c *Client) ReleaseByPodList(ctx context.Context, listActive ListActiveFunc) (SyncResult, error) {
	if listActive == nil {
		return SyncResult{}, newError("ReleaseByPodList", codes.InvalidArgument, ReasonInvalidRequest, "no pod-list callback", nil)
	}
	for try := 0; ; try++ {
		info, err := c.GetInfo(ctx)
		if err != nil {
			return SyncResult{}, err
		}
		active, err := listActive(ctx)
		if err != nil {
			return SyncResult{}, &Error{
				Op: "ReleaseByPodList", Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
				Message: fmt.Sprintf("pod list failed, nothing released: %v", err),
			}
		}
		res, err := c.SyncActive(ctx, info.Generation, active)
		if try == 0 && IsReason(err, ReasonNotRecovered) && c.opts.ListActive != nil {
			// The sidecar restarted between GetInfo and SyncActive: recover, then start over
			// with a fresh generation and a fresh list.
			if rerr := c.recoverFor(ctx, "ReleaseByPodList", err); rerr != nil {
				return SyncResult{}, rerr
			}
			continue
		}
		return res, err
	}
}

// ListGpus returns the node's GPUs with their MIG mode.
func (c *Client) ListGpus(ctx context.Context) ([]GPU, error) {
	var resp *pb.ListGpusResponse
	err := c.call(ctx, "ListGpus", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.ListGpus(ctx, &pb.ListGpusRequest{})
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]GPU, 0, len(resp.GetGpus()))
	for _, g := range resp.GetGpus() {
		out = append(out, GPU{
			Index: g.GetIndex(), UUID: g.GetUuid(), Minor: g.GetMinor(), Model: g.GetModel(),
			MemoryMB: g.GetMemoryMb(), MigMode: migModeFromPB(g.GetMigMode()), Busy: g.GetBusy(),
		})
	}
	return out, nil
}

// DiscoverProfiles returns the profiles of one GPU (allowed names only; nil = all).
func (c *Client) DiscoverProfiles(ctx context.Context, gpuUUID string, allowed []string) ([]Profile, error) {
	req := &pb.DiscoverProfilesRequest{GpuUuid: gpuUUID, AllowedProfiles: allowed}
	var resp *pb.DiscoverProfilesResponse
	err := c.call(ctx, "DiscoverProfiles", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.DiscoverProfiles(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]Profile, 0, len(resp.GetProfiles()))
	for _, p := range resp.GetProfiles() {
		pls := make([]Placement, 0, len(p.GetPlacements()))
		for _, pl := range p.GetPlacements() {
			pls = append(pls, placementFromPB(pl))
		}
		out = append(out, Profile{
			Name: p.GetName(), GIProfileID: p.GetGiProfileId(), CIProfileID: p.GetCiProfileId(),
			SliceCount: p.GetSliceCount(), MemoryMB: p.GetMemoryMb(), CorePercent: p.GetCorePercent(),
			InstanceCount: p.GetInstanceCount(), Placements: pls,
		})
	}
	return out, nil
}

// GetState returns the sidecar's full view for operators. It passes the contract message
// through unchanged: it is read by tools, not by allocation logic.
func (c *Client) GetState(ctx context.Context) (*pb.GetStateResponse, error) {
	var resp *pb.GetStateResponse
	err := c.call(ctx, "GetState", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.GetState(ctx, &pb.GetStateRequest{})
		return err
	})
	return resp, err
}

// SetMigMode enables or disables MIG mode on one GPU.
func (c *Client) SetMigMode(ctx context.Context, gpuUUID string, enabled bool) (SetMigModeResult, error) {
	req := &pb.SetMigModeRequest{GpuUuid: gpuUUID, Enabled: enabled}
	var resp *pb.SetMigModeResponse
	err := c.withRecovery(ctx, "SetMigMode", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SetMigMode(ctx, req)
		return err
	})
	if err != nil {
		return SetMigModeResult{}, err
	}
	return SetMigModeResult{MigMode: migModeFromPB(resp.GetMigMode()), NeedsReset: resp.GetNeedsReset()}, nil
}
