package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
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

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// scheduledPod is a pod as the schedule step leaves it: one container with one reservation.
func scheduledPod(t *testing.T) (*storedPod, []annotation.Allocation) {
	t.Helper()
	allocs := []annotation.Allocation{{
		ContainerIndex: 0, DeviceIndex: 0, GPUUUID: "GPU-a", Profile: "1g.10gb",
		Placement: &annotation.Placement{Start: 6, Size: 1},
	}}
	text, err := annotation.Encode(allocs)
	if err != nil {
		t.Fatal(err)
	}
	return &storedPod{
		UID: "uid-1", Namespace: "default", Name: "train", Containers: []string{"main"},
		Annotation: map[string]string{annotation.Key: text},
	}, allocs
}

func allocated(migUUID string) []migclient.AllocatedDevice {
	return []migclient.AllocatedDevice{{
		DeviceIndex: 0, GPUUUID: "GPU-a", Profile: "1g.10gb", Placement: migclient.Placement{Start: 6, Size: 1},
		MigUUID: migUUID, GPUInstanceID: 0, ComputeInstanceID: 0, Outcome: migclient.OutcomeCreated,
	}}
}

func TestAnAllocatedContainerGetsItsRuntimeIdentityInTheAnnotation(t *testing.T) {
	sp, allocs := scheduledPod(t)
	if err := recordIdentity(sp, allocs, 0, allocated("MIG-1fabbad4-1984-57cf-b48e-500e47c07038")); err != nil {
		t.Fatal(err)
	}
	pod, err := sp.parsed()
	if err != nil {
		t.Fatal(err)
	}
	got := pod.Allocations[0]
	if !got.HasRuntimeIdentity() || got.MigUUID != "MIG-1fabbad4-1984-57cf-b48e-500e47c07038" || *got.GPUInstanceID != 0 {
		t.Fatalf("runtime identity not recorded: %+v", got)
	}
}

func TestAnIdentityThatCannotBeWrittenLeavesTheAnnotationAsItWas(t *testing.T) {
	sp, allocs := scheduledPod(t)
	before := sp.Annotation[annotation.Key]
	if err := recordIdentity(sp, allocs, 0, allocated("GPU-a")); err == nil {
		t.Fatal("an identity that is no MIG UUID was written")
	}
	if got := sp.Annotation[annotation.Key]; got != before {
		t.Fatalf("annotation changed to %q, want the scheduler's %q", got, before)
	}
	if _, err := sp.parsed(); err != nil {
		t.Fatalf("the pod's annotation no longer parses: %v", err)
	}
}

// failingSidecar is a recovered sidecar on the simulated backend whose every Allocate fails with
// an NVML error, the answer the client retries; it counts the calls that reached it.
type failingSidecar struct {
	pb.UnimplementedMigSidecarServer

	mu        sync.Mutex
	getInfos  int
	allocates int
}

func (f *failingSidecar) GetInfo(context.Context, *pb.GetInfoRequest) (*pb.GetInfoResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.getInfos++
	return &pb.GetInfoResponse{
		ApiVersion: "v1", Backend: migclient.BackendSimulated, BootId: "boot-1", Recovered: true,
		StartedAt: timestamppb.New(time.Unix(1000, 0)),
	}, nil
}

func (f *failingSidecar) Allocate(context.Context, *pb.AllocateRequest) (*pb.AllocateResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.allocates++
	st, err := status.New(codes.Unavailable, "create compute instance: NVML_ERROR_UNKNOWN").WithDetails(&errdetails.ErrorInfo{
		Reason: migclient.ReasonNvmlError, Domain: migclient.ErrorDomain,
	})
	if err != nil {
		panic(err)
	}
	return nil, st.Err()
}

func (f *failingSidecar) calls() (getInfos, allocates int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.getInfos, f.allocates
}

// playAgainst runs the mock plugin with args on a one-pod scenario (schedule, allocate) against
// a failing sidecar, and returns what it printed, the sidecar and the run's error.
func playAgainst(t *testing.T, args ...string) ([]report, *failingSidecar, error) {
	t.Helper()
	dir := t.TempDir()
	socket := filepath.Join(dir, "sidecar.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	car := &failingSidecar{}
	srv := grpc.NewServer()
	pb.RegisterMigSidecarServer(srv, car)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	scenario := filepath.Join(dir, "scenario.yaml")
	if err := os.WriteFile(scenario, []byte(`steps:
  - schedule:
      pod: train
      containers:
        - name: main
          devices:
            - {gpuUUID: GPU-a, profile: 1g.10gb, placement: {start: 6, size: 1}}
  - allocate: {pod: train, container: 0}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	runErr := run(append([]string{"--socket", socket, "--scenario", scenario, "--json", "--allow-simulated-backend"}, args...), &out)
	var steps []report
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if line == "" {
			continue
		}
		var r report
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("output line %q: %v", line, err)
		}
		steps = append(steps, r)
	}
	return steps, car, runErr
}

func TestMaxAttemptsEndsAnAllocateAfterThatManyAnsweredCallsWithTheSidecarsReason(t *testing.T) {
	steps, car, err := playAgainst(t, "--max-attempts", "2", "--allocate-timeout", "1m")
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) != 3 || steps[2].Event != "allocate" || steps[2].Error == nil {
		t.Fatalf("want start, schedule and a failed allocate, got %+v", steps)
	}
	if steps[2].Error.Reason != migclient.ReasonNvmlError || steps[2].Error.Code != codes.Unavailable.String() {
		t.Fatalf("want the sidecar's UNAVAILABLE NVML_ERROR, got %+v", steps[2].Error)
	}
	if _, allocates := car.calls(); allocates != 2 {
		t.Fatalf("the sidecar saw %d Allocate calls, want 2", allocates)
	}
}

func TestANegativeMaxAttemptsIsRefusedBeforeAnythingIsSent(t *testing.T) {
	steps, car, err := playAgainst(t, "--max-attempts", "-1")
	if err == nil || !strings.Contains(err.Error(), "--max-attempts") {
		t.Fatalf("want an error naming --max-attempts, got %v", err)
	}
	if getInfos, allocates := car.calls(); len(steps) != 0 || getInfos != 0 || allocates != 0 {
		t.Fatalf("%d steps played, %d GetInfo and %d Allocate calls sent; want none", len(steps), getInfos, allocates)
	}
}
