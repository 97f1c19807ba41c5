// Package fakesidecar is an in-process MigSidecar server for unit tests of the Go client and the
// HAMi adapter. It keeps an instance table with the contract's states and answers the v1
// additions (UndoAllocate, ReclaimIdle, RankPlacements, SetMigMode.reclaim_idle) the way the
// proto's comments specify them, so tests can assert outcomes (what the table holds
// afterwards) rather than calls. It is far simpler than the sidecar: no NVML, no records.
package fakesidecar

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Key is an allocation key: pod UID, container index, device index; or, for a claim's
// instance, claim UID and device index (PodUID empty).
type Key struct {
	PodUID         string
	ContainerIndex uint32
	DeviceIndex    uint32
	ClaimUID       string
}

// Instance is one row of the fake's table.
type Instance struct {
	GPU       string
	Profile   string
	Start     uint32
	Size      uint32
	MigUUID   string
	GI, CI    uint32
	State     pb.InstanceState
	Owner     *Key
	Created   bool // the owning Allocate created it (UndoAllocate destroys it) rather than reused it
	Processes bool // a process runs on it (ReclaimIdle answers INSTANCE_IN_USE)
	// Activated is the generation at which it last became ACTIVE: SyncActive idles it only for a
	// list fenced at that generation or later, as the sidecar does.
	Activated uint64
	Xid       uint32 // the critical Xid that faulted it (Fault); 0 while healthy
	// Claim names the claim that holds it, with Owner.ClaimUID (GetState reports it).
	Claim *pb.ClaimRef
	// Foreign: a GI no record owns (GetState lists it among the GPU's foreign ones); Allocate
	// refuses a placement over it, as over any instance not IDLE.
	Foreign bool
}

// Server is the fake. Its fields are guarded by mu; tests use the methods.
type Server struct {
	pb.UnimplementedMigSidecarServer

	mu    sync.Mutex
	gpus  []string
	migOn map[string]bool
	// migPending is a GPU's pending MIG mode; it differs from migOn after a change that needs a
	// reset (ResetNeeded).
	migPending  map[string]bool
	resetNeeded map[string]bool // MIG mode changes on this GPU wait for a reset
	modeIgnored map[string]bool // SetMigMode on this GPU answers success and changes nothing
	instances   []*Instance
	unreadable  map[string]string // GPU UUID -> GetState's unreadable
	nextGI      uint32
	recovered   bool
	recovers    []*pb.RecoverRequest
	// Unavailable, when > 0, makes that many next mutating calls answer UNAVAILABLE NVML_ERROR.
	unavailable   int
	overloaded    int
	refuseFollow  int                             // following WatchHealth streams still to refuse OVERLOADED
	refusedFollow int                             // following WatchHealth streams refused so far
	generation    uint64                          // the fence: one more at every activation and every idle
	revision      uint64                          // GetInfo's: one more whenever the table read differently
	driverCDI     []string                        // AllocateResponse.driver_cdi_devices (SetDriverCDIDevices)
	printed       string                          // the table as the last GetInfo read it
	calls         map[string]int                  // RPCs received, by method name
	watchers      []chan *pb.InstanceHealthUpdate // following WatchHealth streams
	conns         int                             // client connections open now
}

// profiles is the fake's profile table: name -> size and legal starts (an 8-slice GPU).
var profiles = map[string]struct {
	size   uint32
	starts []uint32
}{
	"1g.10gb": {1, []uint32{0, 1, 2, 3, 4, 5, 6}},
	"2g.20gb": {2, []uint32{0, 2, 4}},
	"3g.40gb": {4, []uint32{0, 4}},
	"7g.80gb": {8, []uint32{0}},
}

// Start serves a fake with the given GPU UUIDs (MIG enabled on each) on a socket in a temp dir
// and returns it with the socket path.
func Start(t *testing.T, gpus ...string) (*Server, string) {
	t.Helper()
	s := &Server{gpus: gpus, migOn: map[string]bool{}, migPending: map[string]bool{}, resetNeeded: map[string]bool{},
		modeIgnored: map[string]bool{}, nextGI: 1, recovered: true, calls: map[string]int{}}
	for _, g := range gpus {
		s.migOn[g] = true
		s.migPending[g] = true
	}
	socket := filepath.Join(t.TempDir(), "fake.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		s.mu.Lock()
		s.calls[filepath.Base(info.FullMethod)]++
		s.mu.Unlock()
		return h(ctx, req)
	}))
	pb.RegisterMigSidecarServer(srv, s)
	go func() { _ = srv.Serve(&counting{Listener: lis, s: s}) }()
	t.Cleanup(srv.Stop)
	return s, socket
}

// counting counts the connections the fake serves, so a test can see one left open.
type counting struct {
	net.Listener
	s *Server
}

func (l *counting) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.s.mu.Lock()
	l.s.conns++
	l.s.mu.Unlock()
	return &countedConn{Conn: c, s: l.s}, nil
}

type countedConn struct {
	net.Conn
	s    *Server
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		c.s.conns--
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}

// Calls returns how many calls of each RPC the fake received, by method name ("Allocate").
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

// ResetCalls forgets the calls counted so far.
func (s *Server) ResetCalls() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = map[string]int{}
}

// OpenConns is the number of client connections open now.
func (s *Server) OpenConns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conns
}

// Generation is the fake's current generation.
func (s *Server) Generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.generation
}

func fail(code codes.Code, reason, msg string, md map[string]string) error {
	st, err := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "migsidecar.hami.io", Metadata: md})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

// Put adds an instance to the table as it is (for IDLE or ERROR set-ups) and returns it.
func (s *Server) Put(in Instance) *Instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in.GI == 0 {
		in.GI = s.nextGI
		s.nextGI++
	}
	if in.MigUUID == "" {
		in.MigUUID = fmt.Sprintf("MIG-fake-%s-%d", in.GPU, in.GI)
	}
	p := &in
	s.instances = append(s.instances, p)
	return p
}

// Unreadable makes GetState answer gpu unreadable with why, as the sidecar does for a lost GPU;
// "" makes it readable again.
func (s *Server) Unreadable(gpu, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unreadable == nil {
		s.unreadable = map[string]string{}
	}
	if why == "" {
		delete(s.unreadable, gpu)
		return
	}
	s.unreadable[gpu] = why
}

// Instances returns a copy of the table, sorted by MIG UUID.
func (s *Server) Instances() []Instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Instance, 0, len(s.instances))
	for _, in := range s.instances {
		out = append(out, *in)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].MigUUID < out[j].MigUUID })
	return out
}

// MigEnabled reports the fake's MIG mode of one GPU.
func (s *Server) MigEnabled(gpu string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.migOn[gpu]
}

// ResetNeeded makes MIG mode changes on gpu pending until a reset, as on a GPU that cannot
// change mode in place: the answer says needs_reset and ListGpus shows the pending mode.
func (s *Server) ResetNeeded(gpu string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resetNeeded[gpu] = true
}

// IgnoreMigMode makes SetMigMode on gpu answer as if it applied the change while changing
// nothing, so a client that believes the answer without reading the mode back is caught.
func (s *Server) IgnoreMigMode(gpu string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.modeIgnored[gpu] = true
}

// Unrecover makes the fake answer NOT_RECOVERED until the next Recover.
func (s *Server) Unrecover() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recovered = false
}

// Recovers returns the Recover requests received.
func (s *Server) Recovers() []*pb.RecoverRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*pb.RecoverRequest(nil), s.recovers...)
}

// FailNext makes the next n mutating calls answer UNAVAILABLE NVML_ERROR.
func (s *Server) FailNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unavailable = n
}

// OverloadNext makes the next n mutating calls answer RESOURCE_EXHAUSTED OVERLOADED, as the
// sidecar refuses a call past the ones it admits (nothing done).
func (s *Server) OverloadNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.overloaded = n
}

// RefuseFollowers makes the next n following WatchHealth streams answer RESOURCE_EXHAUSTED
// OVERLOADED, as the sidecar refuses a follower past --max-followers (nothing sent).
func (s *Server) RefuseFollowers(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refuseFollow = n
}

// RefusedFollowers is the number of following WatchHealth streams refused so far.
func (s *Server) RefusedFollowers() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refusedFollow
}

// gate is the check every mutating call passes first; the caller holds mu.
func (s *Server) gate() error {
	if !s.recovered {
		return fail(codes.FailedPrecondition, "NOT_RECOVERED", "not recovered", nil)
	}
	if s.overloaded > 0 {
		s.overloaded--
		return fail(codes.ResourceExhausted, "OVERLOADED", "the sidecar holds 64 calls already", nil)
	}
	if s.unavailable > 0 {
		s.unavailable--
		return fail(codes.Unavailable, "NVML_ERROR", "injected NVML error", nil)
	}
	return nil
}

func (s *Server) knownGPU(gpu string) error {
	for _, g := range s.gpus {
		if g == gpu {
			return nil
		}
	}
	return fail(codes.NotFound, "UNKNOWN_GPU", "unknown GPU "+gpu, nil)
}

func ref(in *Instance) *pb.InstanceRef {
	return &pb.InstanceRef{GpuUuid: in.GPU, Profile: in.Profile, Placement: &pb.Placement{Start: in.Start, Size: in.Size},
		MigUuid: in.MigUUID, GpuInstanceId: in.GI, ComputeInstanceId: in.CI}
}

func overlaps(in *Instance, start, size uint32) bool {
	return in.Start < start+size && start < in.Start+in.Size
}

func (s *Server) remove(in *Instance) {
	for i, x := range s.instances {
		if x == in {
			s.instances = append(s.instances[:i], s.instances[i+1:]...)
			return
		}
	}
}

// GetInfo is the RPC of that name, over the fake's table.
func (s *Server) GetInfo(context.Context, *pb.GetInfoRequest) (*pb.GetInfoResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var table strings.Builder
	for _, in := range s.instances {
		fmt.Fprintf(&table, "%+v %+v;", *in, in.Owner)
	}
	fmt.Fprintf(&table, "%v", s.unreadable)
	if table.String() != s.printed {
		s.printed = table.String()
		s.revision++
	}
	return &pb.GetInfoResponse{ApiVersion: "v1", Backend: "simulated", BootId: "fake", Recovered: s.recovered,
		Generation: s.generation, Revision: s.revision, StartedAt: timestamppb.New(time.Unix(1000, 0))}, nil
}

// Destroy removes an instance as the sidecar's background work does (a trim, the reconciler): no
// generation moves, only GetInfo's revision.
func (s *Server) Destroy(migUUID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, in := range s.instances {
		if in.MigUUID == migUUID {
			s.remove(in)
			return
		}
	}
}

// ListGpus is the RPC of that name, over the fake's table.
func (s *Server) ListGpus(context.Context, *pb.ListGpusRequest) (*pb.ListGpusResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &pb.ListGpusResponse{}
	for i, g := range s.gpus {
		out.Gpus = append(out.Gpus, &pb.Gpu{Index: uint32(i), Uuid: g, Model: "NVIDIA H100 80GB HBM3",
			MigMode: &pb.MigMode{Current: s.migOn[g], Pending: s.migPending[g]}})
	}
	return out, nil
}

// DiscoverProfiles is the RPC of that name, over the fake's table (only the allowed profiles, if named).
func (s *Server) DiscoverProfiles(_ context.Context, req *pb.DiscoverProfilesRequest) (*pb.DiscoverProfilesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.knownGPU(req.GetGpuUuid()); err != nil {
		return nil, err
	}
	names := make([]string, 0, len(profiles))
	for n := range profiles {
		if len(req.GetAllowedProfiles()) == 0 || slices.Contains(req.GetAllowedProfiles(), n) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	out := &pb.DiscoverProfilesResponse{}
	for _, n := range names {
		p := profiles[n]
		prof := &pb.Profile{Name: n, SliceCount: p.size, MemoryMb: uint64(p.size) * 10000, CorePercent: p.size * 100 / 8,
			InstanceCount: uint32(len(p.starts))}
		for _, st := range p.starts {
			prof.Placements = append(prof.Placements, &pb.Placement{Start: st, Size: p.size})
		}
		out.Profiles = append(out.Profiles, prof)
	}
	return out, nil
}

// Recover is the RPC of that name, over the fake's table.
func (s *Server) Recover(_ context.Context, req *pb.RecoverRequest) (*pb.RecoverResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recovers = append(s.recovers, req)
	s.recovered = true
	return &pb.RecoverResponse{}, nil
}

// SyncActive is the RPC of that name, over the fake's table.
func (s *Server) SyncActive(_ context.Context, req *pb.SyncActiveRequest) (*pb.SyncActiveResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	if req.GetGeneration() > s.generation {
		return nil, fail(codes.InvalidArgument, "INVALID_REQUEST", "generation never handed out", nil)
	}
	listed := map[Key]bool{}
	for _, a := range req.GetActive() {
		listed[Key{PodUID: a.GetPod().GetUid(), ContainerIndex: a.GetContainerIndex(), DeviceIndex: a.GetDeviceIndex()}] = true
	}
	out := &pb.SyncActiveResponse{}
	for _, in := range s.instances {
		if in.State == pb.InstanceState_ACTIVE && in.Owner != nil && in.Owner.ClaimUID == "" && !listed[*in.Owner] &&
			in.Activated <= req.GetGeneration() {
			in.State = pb.InstanceState_IDLE
			s.generation++
			out.Idled = append(out.Idled, ref(in))
		}
	}
	out.Generation = s.generation
	return out, nil
}

// Allocate is the RPC of that name, over the fake's table.
func (s *Server) Allocate(_ context.Context, req *pb.AllocateRequest) (*pb.AllocateResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	out := &pb.AllocateResponse{}
	for _, d := range req.GetDevices() {
		key := Key{PodUID: req.GetPod().GetUid(), ContainerIndex: req.GetContainerIndex(), DeviceIndex: d.GetDeviceIndex()}
		if req.GetClaim() != nil {
			key = Key{ClaimUID: req.GetClaim().GetUid(), DeviceIndex: d.GetDeviceIndex()}
		}
		start, size := d.GetPlacement().GetStart(), d.GetPlacement().GetSize()
		if !s.migOn[d.GetGpuUuid()] {
			return nil, fail(codes.FailedPrecondition, "MIG_DISABLED", "MIG disabled on "+d.GetGpuUuid(), nil)
		}
		var got *Instance
		outcome := pb.Outcome_CREATED
		for _, in := range s.instances {
			if in.GPU != d.GetGpuUuid() || !overlaps(in, start, size) {
				continue
			}
			same := in.Profile == d.GetProfile() && in.Start == start && in.Size == size
			switch {
			case same && in.State == pb.InstanceState_ACTIVE && in.Owner != nil && *in.Owner == key:
				got, outcome = in, pb.Outcome_ALREADY_ALLOCATED
			case same && in.State == pb.InstanceState_IDLE:
				got, outcome = in, pb.Outcome_REUSED
			}
		}
		if got == nil {
			for _, in := range append([]*Instance(nil), s.instances...) {
				if in.GPU != d.GetGpuUuid() || !overlaps(in, start, size) {
					continue
				}
				if in.State != pb.InstanceState_IDLE {
					md := map[string]string{"mig_uuid": in.MigUUID, "blocker": in.State.String()}
					switch {
					case in.Owner != nil && in.Owner.ClaimUID != "":
						md["claim_uid"] = in.Owner.ClaimUID
					case in.Owner != nil:
						md["pod_uid"] = in.Owner.PodUID
					}
					return nil, fail(codes.FailedPrecondition, "PLACEMENT_BUSY", "placement busy", md)
				}
				out.Reclaimed = append(out.Reclaimed, ref(in))
				s.remove(in)
			}
			got = &Instance{GPU: d.GetGpuUuid(), Profile: d.GetProfile(), Start: start, Size: size, GI: s.nextGI}
			got.MigUUID = fmt.Sprintf("MIG-fake-%s-%d", got.GPU, got.GI)
			s.nextGI++
			s.instances = append(s.instances, got)
		}
		if outcome != pb.Outcome_ALREADY_ALLOCATED {
			got.Created = outcome == pb.Outcome_CREATED
			s.generation++
			got.Activated = s.generation
		}
		got.State, got.Owner, got.Claim = pb.InstanceState_ACTIVE, &key, req.GetClaim()
		out.Devices = append(out.Devices, &pb.AllocatedDevice{DeviceIndex: d.GetDeviceIndex(), GpuUuid: got.GPU,
			Profile: got.Profile, Placement: d.GetPlacement(), MigUuid: got.MigUUID, GpuInstanceId: got.GI,
			ComputeInstanceId: got.CI, CdiDevice: "k8s.device-plugin.nvidia.com/dynamic-mig=" + got.MigUUID, Outcome: outcome})
	}
	out.Generation = s.generation
	if len(out.Devices) > 0 {
		out.DriverCdiDevices = append([]string(nil), s.driverCDI...)
	}
	return out, nil
}

// SetDriverCDIDevices makes every later Allocate answer these CDI names of the node's driver, as a
// sidecar that publishes its driver spec does.
func (s *Server) SetDriverCDIDevices(names ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.driverCDI = append([]string(nil), names...)
}

// UndoAllocate is the RPC of that name, over the fake's table.
func (s *Server) UndoAllocate(_ context.Context, req *pb.UndoAllocateRequest) (*pb.UndoAllocateResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	out := &pb.UndoAllocateResponse{}
	for _, in := range append([]*Instance(nil), s.instances...) {
		if in.State != pb.InstanceState_ACTIVE || in.Owner == nil ||
			in.Owner.PodUID != req.GetPodUid() || in.Owner.ContainerIndex != req.GetContainerIndex() {
			continue
		}
		if in.Created {
			s.remove(in)
			out.Destroyed = append(out.Destroyed, ref(in))
		} else {
			in.State, in.Owner = pb.InstanceState_IDLE, nil
			s.generation++
			out.Idled = append(out.Idled, ref(in))
		}
	}
	return out, nil
}

// UndoDevice is the RPC of that name, over the fake's table.
func (s *Server) UndoDevice(_ context.Context, req *pb.UndoDeviceRequest) (*pb.UndoDeviceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	if req.GetMigUuid() == "" || req.GetPodUid() == "" {
		return nil, fail(codes.InvalidArgument, "INVALID_REQUEST", "MIG UUID and pod UID are required", nil)
	}
	out := &pb.UndoDeviceResponse{}
	var in *Instance
	for _, x := range s.instances {
		if x.MigUUID == req.GetMigUuid() {
			in = x
		}
	}
	want := Key{PodUID: req.GetPodUid(), ContainerIndex: req.GetContainerIndex(), DeviceIndex: req.GetDeviceIndex()}
	switch {
	case in == nil:
		out.Skipped = pb.UndoSkip_UNDO_SKIP_UNKNOWN_INSTANCE
	case in.State != pb.InstanceState_ACTIVE || in.Owner == nil:
		out.Skipped, out.Detail = pb.UndoSkip_UNDO_SKIP_NOT_ACTIVE, in.State.String()
	case *in.Owner != want:
		out.Skipped, out.Detail = pb.UndoSkip_UNDO_SKIP_OTHER_OWNER, "held by "+in.Owner.PodUID
	case in.Created:
		s.remove(in)
		out.Destroyed = ref(in)
	default:
		in.State, in.Owner = pb.InstanceState_IDLE, nil
		s.generation++
		out.Idled = ref(in)
	}
	out.Generation = s.generation
	return out, nil
}

// reclaimable checks ReclaimIdle's preconditions on one GPU; the caller holds mu.
func (s *Server) reclaimable(gpu string, named []string) ([]*Instance, error) {
	var picked []*Instance
	if len(named) == 0 {
		for _, in := range s.instances {
			if in.GPU == gpu && in.State == pb.InstanceState_IDLE {
				picked = append(picked, in)
			}
		}
	}
	for _, m := range named {
		var found *Instance
		for _, in := range s.instances {
			if in.GPU == gpu && in.MigUUID == m {
				found = in
			}
		}
		switch {
		case found == nil:
			return nil, fail(codes.NotFound, "UNKNOWN_INSTANCE", "no instance "+m+" on "+gpu, map[string]string{"mig_uuid": m})
		case found.State != pb.InstanceState_IDLE:
			return nil, fail(codes.FailedPrecondition, "NOT_IDLE", m+" is "+found.State.String(), map[string]string{"mig_uuid": m})
		}
		picked = append(picked, found)
	}
	for _, in := range picked {
		if in.Processes {
			return nil, fail(codes.Unavailable, "INSTANCE_IN_USE", in.MigUUID+" runs processes", map[string]string{"mig_uuid": in.MigUUID})
		}
	}
	return picked, nil
}

// ReclaimIdle is the RPC of that name, over the fake's table.
func (s *Server) ReclaimIdle(_ context.Context, req *pb.ReclaimIdleRequest) (*pb.ReclaimIdleResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	if err := s.knownGPU(req.GetGpuUuid()); err != nil {
		return nil, err
	}
	picked, err := s.reclaimable(req.GetGpuUuid(), req.GetMigUuids())
	if err != nil {
		return nil, err
	}
	out := &pb.ReclaimIdleResponse{}
	for _, in := range picked {
		s.remove(in)
		out.Reclaimed = append(out.Reclaimed, ref(in))
	}
	return out, nil
}

// SetMigMode is the RPC of that name, over the fake's table.
func (s *Server) SetMigMode(_ context.Context, req *pb.SetMigModeRequest) (*pb.SetMigModeResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	gpu := req.GetGpuUuid()
	if err := s.knownGPU(gpu); err != nil {
		return nil, err
	}
	if !req.GetEnabled() {
		for _, in := range s.instances {
			if in.GPU == gpu && (in.State != pb.InstanceState_IDLE || !req.GetReclaimIdle()) {
				return nil, fail(codes.FailedPrecondition, "PLACEMENT_BUSY", "GPU holds "+in.State.String()+" "+in.MigUUID,
					map[string]string{"mig_uuid": in.MigUUID, "blocker": in.State.String()})
			}
		}
		picked, err := s.reclaimable(gpu, nil)
		if err != nil {
			return nil, err
		}
		for _, in := range picked {
			s.remove(in)
		}
	}
	switch {
	case s.modeIgnored[gpu]:
		return &pb.SetMigModeResponse{MigMode: &pb.MigMode{Current: req.GetEnabled(), Pending: req.GetEnabled()}}, nil
	case s.resetNeeded[gpu]:
		s.migPending[gpu] = req.GetEnabled()
		return &pb.SetMigModeResponse{MigMode: &pb.MigMode{Current: s.migOn[gpu], Pending: req.GetEnabled()},
			NeedsReset: s.migOn[gpu] != req.GetEnabled()}, nil
	}
	s.migOn[gpu], s.migPending[gpu] = req.GetEnabled(), req.GetEnabled()
	return &pb.SetMigModeResponse{MigMode: &pb.MigMode{Current: req.GetEnabled(), Pending: req.GetEnabled()}}, nil
}

// RankPlacements is the RPC of that name, over the fake's table.
func (s *Server) RankPlacements(_ context.Context, req *pb.RankPlacementsRequest) (*pb.RankPlacementsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.recovered {
		return nil, fail(codes.FailedPrecondition, "NOT_RECOVERED", "not recovered", nil)
	}
	if err := s.knownGPU(req.GetGpuUuid()); err != nil {
		return nil, err
	}
	p, ok := profiles[req.GetProfile()]
	if !ok {
		return nil, fail(codes.InvalidArgument, "UNKNOWN_PROFILE", "unknown profile "+req.GetProfile(), nil)
	}
	var used uint32
	for _, in := range s.instances {
		if in.GPU == req.GetGpuUuid() && in.State != pb.InstanceState_IDLE {
			used += in.Size
		}
	}
	out := &pb.RankPlacementsResponse{}
	for _, st := range p.starts {
		rp := &pb.RankedPlacement{Placement: &pb.Placement{Start: st, Size: p.size}, Cost: pb.PlacementCost_FREE,
			FreeSlicesAfter: 8 - used - p.size}
		for _, in := range s.instances {
			if in.GPU != req.GetGpuUuid() || !overlaps(in, st, p.size) {
				continue
			}
			switch {
			case in.State != pb.InstanceState_IDLE:
				rp.Cost, rp.Blocker = pb.PlacementCost_BLOCKED, in.State.String()
			case in.Profile == req.GetProfile() && in.Start == st && rp.Cost != pb.PlacementCost_BLOCKED:
				rp.Cost, rp.IdleMigUuid = pb.PlacementCost_REUSE, in.MigUUID
			case rp.Cost == pb.PlacementCost_FREE || rp.Cost == pb.PlacementCost_RECLAIM:
				rp.Cost = pb.PlacementCost_RECLAIM
				rp.Reclaim = append(rp.Reclaim, ref(in))
			}
		}
		out.Placements = append(out.Placements, rp)
	}
	sort.SliceStable(out.Placements, func(i, j int) bool { return out.Placements[i].Cost < out.Placements[j].Cost })
	return out, nil
}

// GetState is the RPC of that name, over the fake's table.
func (s *Server) GetState(context.Context, *pb.GetStateRequest) (*pb.GetStateResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &pb.GetStateResponse{Generation: s.generation}
	for i, g := range s.gpus {
		gs := &pb.GpuState{Gpu: &pb.Gpu{Index: uint32(i), Uuid: g}, Unreadable: s.unreadable[g]}
		for _, in := range s.instances {
			if in.GPU == g && in.Foreign {
				gs.Foreign = append(gs.Foreign, &pb.ForeignInstance{Profile: in.Profile, GpuInstanceId: in.GI, MigUuid: in.MigUUID,
					Placement: &pb.Placement{Start: in.Start, Size: in.Size}})
				continue
			}
			if in.GPU == g {
				gs.Instances = append(gs.Instances, &pb.Instance{GpuUuid: g, Profile: in.Profile,
					Placement: &pb.Placement{Start: in.Start, Size: in.Size}, MigUuid: in.MigUUID,
					GpuInstanceId: in.GI, ComputeInstanceId: in.CI, State: in.State, Owner: owner(in),
					Health:    health(in),
					CdiDevice: "k8s.device-plugin.nvidia.com/dynamic-mig=" + in.MigUUID})
			}
		}
		out.Gpus = append(out.Gpus, gs)
	}
	return out, nil
}

func health(in *Instance) pb.InstanceHealth {
	if in.Xid != 0 {
		return pb.InstanceHealth_FAULTED
	}
	return pb.InstanceHealth_HEALTHY
}

func owner(in *Instance) *pb.Owner {
	k := in.Owner
	switch {
	case k == nil:
		return nil
	case k.ClaimUID != "":
		return &pb.Owner{Kind: pb.OwnerKind_OWNER_KIND_CLAIM, Claim: in.Claim, DeviceIndex: k.DeviceIndex}
	}
	return &pb.Owner{Kind: pb.OwnerKind_OWNER_KIND_POD, Pod: &pb.PodRef{Uid: k.PodUID}, ContainerIndex: k.ContainerIndex,
		DeviceIndex: k.DeviceIndex}
}

// Release is the RPC of that name, over the fake's table: the pod's (or the claim's) ACTIVE
// instances become IDLE, a faulted one is destroyed instead.
func (s *Server) Release(_ context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.gate(); err != nil {
		return nil, err
	}
	if (req.GetPodUid() == "") == (req.GetClaimUid() == "") {
		return nil, fail(codes.InvalidArgument, "INVALID_REQUEST", "exactly one of pod_uid and claim_uid", nil)
	}
	out := &pb.ReleaseResponse{}
	for _, in := range append([]*Instance(nil), s.instances...) {
		if in.State != pb.InstanceState_ACTIVE || in.Owner == nil || in.Owner.PodUID != req.GetPodUid() ||
			in.Owner.ClaimUID != req.GetClaimUid() {
			continue
		}
		out.Released = append(out.Released, ref(in))
		s.generation++
		if in.Xid != 0 {
			s.remove(in)
			continue
		}
		in.State, in.Owner = pb.InstanceState_IDLE, nil
	}
	return out, nil
}

// Following is the number of WatchHealth streams that follow changes now.
func (s *Server) Following() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.watchers)
}

// Fault marks the instance with migUUID faulted by xid, as a critical Xid does in the sidecar, and
// tells every following WatchHealth stream.
func (s *Server) Fault(migUUID string, xid uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, in := range s.instances {
		if in.MigUUID == migUUID && in.Xid == 0 {
			in.Xid = xid
			for _, w := range s.watchers {
				w <- healthOf(in, false)
			}
		}
	}
}

func healthOf(in *Instance, current bool) *pb.InstanceHealthUpdate {
	health := pb.InstanceHealth_HEALTHY
	if in.Xid != 0 {
		health = pb.InstanceHealth_FAULTED
	}
	return &pb.InstanceHealthUpdate{GpuUuid: in.GPU, Profile: in.Profile,
		Placement: &pb.Placement{Start: in.Start, Size: in.Size}, MigUuid: in.MigUUID, GpuInstanceId: in.GI,
		ComputeInstanceId: in.CI, Health: health, Xid: in.Xid, Current: current}
}

// WatchHealth is the RPC of that name, over the fake's table.
func (s *Server) WatchHealth(req *pb.WatchHealthRequest, stream pb.MigSidecar_WatchHealthServer) error {
	s.mu.Lock()
	s.calls["WatchHealth"]++
	if req.GetFollow() && s.refuseFollow > 0 {
		s.refuseFollow--
		s.refusedFollow++
		s.mu.Unlock()
		return fail(codes.ResourceExhausted, "OVERLOADED", "WatchHealth: 512 streams follow already",
			map[string]string{"method": "WatchHealth", "followers": "512"})
	}
	opening := make([]*pb.InstanceHealthUpdate, 0, len(s.instances))
	for _, in := range s.instances {
		opening = append(opening, healthOf(in, true))
	}
	changes := make(chan *pb.InstanceHealthUpdate, 64)
	if req.GetFollow() {
		s.watchers = append(s.watchers, changes)
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.watchers = slices.DeleteFunc(s.watchers, func(w chan *pb.InstanceHealthUpdate) bool { return w == changes })
	}()
	for _, u := range opening {
		if err := stream.Send(u); err != nil {
			return err
		}
	}
	if !req.GetFollow() {
		return nil
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case u := <-changes:
			if err := stream.Send(u); err != nil {
				return err
			}
		}
	}
}
