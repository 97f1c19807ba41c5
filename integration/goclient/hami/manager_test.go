package hami

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func lazy(t *testing.T) (*fakesidecar.Server, *Lazy) {
	t.Helper()
	s, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	none := func(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil }
	l, err := DialLazy(context.Background(), socket, migclient.Options{CallTimeout: 5 * time.Second,
		AllocateTimeout: 5 * time.Second, MaxAttempts: 3, AllowSimulatedBackend: true, ListActive: none})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Shutdown)
	return s, l
}

func own(uid string, device int) Owner {
	return Owner{PodUID: uid, PodNamespace: "ns", PodName: uid, ContainerName: "c", DeviceIndex: device}
}

func TestReleaseUndoesTheContainerAReusedInstanceGoesIdleACreatedOneIsDestroyed(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	reused, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || !took || reused != cached.MigUUID {
		t.Fatalf("reuse: %s %t %v", reused, took, err)
	}
	created, err := l.EnsureAllocation(own("p", 1), 1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2})
	if err != nil || !created.Created || created.Reused {
		t.Fatalf("create: %+v %v", created, err)
	}
	if name, ok := m.CDIDevice(created.MigUUID); !ok || name == "" {
		t.Fatalf("CDI device of %s: %q %t", created.MigUUID, name, ok)
	}
	info, ok := m.AllocationRuntimeInfo(1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2})
	if !ok || info.MigUUID != created.MigUUID {
		t.Fatalf("runtime info %+v %t", info, ok)
	}
	// HAMi's rollback: Release for each device it took, naming the owner it took it for.
	for i, uuid := range []string{reused, created.MigUUID} {
		if err := m.Release(own("p", i), uuid); err != nil {
			t.Fatal(err)
		}
	}
	got := s.Instances()
	if len(got) != 1 || got[0].MigUUID != cached.MigUUID || got[0].State != pb.InstanceState_IDLE {
		t.Fatalf("after rollback: %+v", got)
	}
	if _, ok := m.AllocationRuntimeInfo(1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2}); ok {
		t.Fatal("the destroyed instance still has runtime info")
	}
	if err := m.Release(own("p", 0), "MIG-unknown"); err != nil {
		t.Fatalf("unknown MIG UUID: %v", err)
	}
}

func TestARepeatedEnsureAllocationIsNotTakenAgain(t *testing.T) {
	_, l := lazy(t)
	m := l.Manager()
	first, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil || !took {
		t.Fatal(took, err)
	}
	again, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil || took || again != first {
		t.Fatalf("repeat: %s %t %v, want %s not taken", again, took, err, first)
	}
	if _, _, err := m.EnsureAllocation(own("p", -1), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1}); err == nil {
		t.Fatal("a negative device index was sent")
	}
	if _, _, err := m.EnsureAllocation(own("p", 1), 9, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1}); err == nil {
		t.Fatal("an unknown GPU index was sent")
	}
}

func TestTheAdapterRetriesAnOverloadedSidecarAndFailsClosedWhenItStaysFull(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	at := nvml.GpuInstancePlacement{Start: 3, Size: 1}
	s.OverloadNext(2) // within the adapter's 3 attempts
	first, took, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", at)
	if err != nil || !took || first == "" {
		t.Fatalf("after two OVERLOADED answers: %s %t %v", first, took, err)
	}
	s.OverloadNext(3) // every attempt refused
	_, took, err = m.EnsureAllocation(own("q", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1})
	if err == nil || took || !migclient.IsReason(err, migclient.ReasonOverloaded) {
		t.Fatalf("a sidecar full for every attempt: %t %v, want the OVERLOADED error", took, err)
	}
	if got := s.Instances(); len(got) != 1 || got[0].MigUUID != first {
		t.Fatalf("the refused allocation left something behind: %+v", got)
	}
}

func TestAdoptAllocationAcceptsOnlyTheIdentityTheSidecarHoldsActive(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	res, err := l.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	info, _ := m.AllocationRuntimeInfo(0, "1g.10gb", nvml.GpuInstancePlacement{Start: 3, Size: 1})
	at := nvml.GpuInstancePlacement{Start: 3, Size: 1}
	if err := m.AdoptAllocation(0, "1g.10gb", res.MigUUID, at, info.GIID, info.CIID); err != nil {
		t.Fatal(err)
	}
	if err := l.AdoptAllocation(0, "1g.10gb", res.MigUUID, at, info.GIID+1, info.CIID); !errors.Is(err, ErrNotLive) {
		t.Fatalf("wrong GI ID adopted: %v", err)
	}
	idle := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 5, Size: 1, State: pb.InstanceState_IDLE})
	if err := m.AdoptAllocation(0, "1g.10gb", idle.MigUUID, nvml.GpuInstancePlacement{Start: 5, Size: 1}, idle.GI, idle.CI); !errors.Is(err, ErrNotLive) {
		t.Fatalf("an IDLE instance adopted as live: %v", err)
	}
}

func TestResetIdleGPUsEnablesMigOnIdleGPUsAndKeepsTheCache(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	if done, err := l.DisableIdleGPUs(1, nil); err != nil || !slices.Equal(done, []int{0}) {
		t.Fatalf("disable GPU 0: %v %v", done, err)
	}
	reset, err := m.ResetIdleGPUs(2, map[int]struct{}{})
	if err != nil || !slices.Equal(reset, []int{0, 1}) || !s.MigEnabled("GPU-a") {
		t.Fatalf("reset %v %v, MIG on GPU-a %t", reset, err, s.MigEnabled("GPU-a"))
	}
	if got := s.Instances(); len(got) != 1 || got[0].State != pb.InstanceState_IDLE {
		t.Fatalf("the idle cache is gone: %+v", got)
	}
	s.ResetNeeded("GPU-a")
	if _, err := l.DisableIdleGPUs(1, nil); !errors.Is(err, ErrNeedsReset) {
		t.Fatalf("a disable pending a reset: %v", err)
	}
}

func TestDisableIdleGPUsRefusesABusyMigGPUAndDoesNotTakeTheAnswerForTheMode(t *testing.T) {
	s, l := lazy(t)
	if done, err := l.DisableIdleGPUs(2, map[int]struct{}{0: {}}); err == nil || len(done) != 0 || !s.MigEnabled("GPU-a") {
		t.Fatalf("a busy MIG GPU: %v %v", done, err)
	}
	s.IgnoreMigMode("GPU-a")
	if done, err := l.DisableIdleGPUs(1, nil); err == nil || errors.Is(err, ErrNeedsReset) || len(done) != 0 {
		t.Fatalf("disabled %v, %v; want none and an error naming the mode read back", done, err)
	}
}

func TestTheLazyExtrasAndShutdown(t *testing.T) {
	_, l := lazy(t)
	if got, err := l.RetryErrorAllocations(nil); err != nil || len(got) != 0 {
		t.Fatalf("retry: %v %v", got, err)
	}
	if err := l.RestoreAllocations(2, nil, nil, true); err == nil {
		t.Fatal("adoptExisting differing from the sidecar's was accepted")
	}
	if err := l.RestoreAllocations(2, nil, nil, false); err != nil {
		t.Fatal(err)
	}
	if err := l.ReconcileActiveAllocations(nil); err != nil {
		t.Fatal(err)
	}
	l.MarkIdle(own("p", 0), "MIG-unknown")
	if _, ok := l.CDIDevice("MIG-unknown"); ok {
		t.Fatal("a CDI device for an unknown MIG UUID")
	}
	l.Shutdown()
	l.Shutdown()
	if _, err := l.Manager().ResetIdleGPUs(1, nil); !errors.Is(err, ErrShutdown) {
		t.Fatalf("after Shutdown: %v", err)
	}
}

func stateOf(s *fakesidecar.Server, mig string) (pb.InstanceState, string) {
	for _, in := range s.Instances() {
		if in.MigUUID == mig {
			if in.Owner != nil {
				return in.State, in.Owner.PodUID
			}
			return in.State, ""
		}
	}
	return pb.InstanceState_INSTANCE_STATE_UNSPECIFIED, ""
}

func TestReleaseUndoesOnlyTheDeviceItsOwnerStillHolds(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	dev0, _, err := m.EnsureAllocation(own("a", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || dev0 != cached.MigUUID {
		t.Fatal(dev0, err)
	}
	dev1, _, err := m.EnsureAllocation(own("a", 1), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 1, Size: 1})
	if err != nil {
		t.Fatal(err)
	}

	// Device 1 of the container is released: device 0 stays ACTIVE for pod a.
	if err := m.Release(own("a", 1), dev1); err != nil {
		t.Fatal(err)
	}
	if st, _ := stateOf(s, dev1); st != pb.InstanceState_INSTANCE_STATE_UNSPECIFIED {
		t.Fatalf("the created device 1 is still there: %v", st)
	}
	if st, holder := stateOf(s, dev0); st != pb.InstanceState_ACTIVE || holder != "a" {
		t.Fatalf("device 0 after releasing device 1: %v %q", st, holder)
	}
	// A Release naming the wrong device of the same container changes nothing.
	if err := m.Release(own("a", 1), dev0); err != nil {
		t.Fatal(err)
	}
	if st, holder := stateOf(s, dev0); st != pb.InstanceState_ACTIVE || holder != "a" {
		t.Fatalf("device 0 after a Release naming device 1: %v %q", st, holder)
	}
	if err := m.Release(own("a", 0), dev0); err != nil {
		t.Fatal(err)
	}
	if st, _ := stateOf(s, dev0); st != pb.InstanceState_IDLE {
		t.Fatalf("device 0 after its release: %v", st)
	}
}

// TestALateRollbackLeavesTheNextPodsInstanceActive is G1 and G2, through this adapter and
// through another one over the same sidecar: pod a's rollback of X arrives (again, or for the
// first time) after X went IDLE and pod b reused it; b's X stays ACTIVE and b's every time.
func TestALateRollbackLeavesTheNextPodsInstanceActive(t *testing.T) {
	at := nvml.GpuInstancePlacement{Start: 0, Size: 1}
	for _, tc := range []struct {
		name string
		// firstUndone: a's rollback ran once before b's hand-out (G1 repeats it; G2 sends it late).
		firstUndone bool
		// otherAdapter: b is handed X by another adapter (a second plugin, or this one restarted).
		otherAdapter bool
	}{
		{name: "G1: a repeated rollback through the same adapter", firstUndone: true},
		{name: "G2: a late first rollback through the same adapter"},
		{name: "G2: a late first rollback, b's hand-out through another adapter", otherAdapter: true},
		{name: "G1: a repeated rollback, b's hand-out through another adapter", firstUndone: true, otherAdapter: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, l := lazy(t)
			m := l.Manager()
			cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
			x, took, err := m.EnsureAllocation(own("a", 0), 0, "1g.10gb", at)
			if err != nil || !took || x != cached.MigUUID {
				t.Fatal(x, took, err)
			}
			if tc.firstUndone {
				if err := m.Release(own("a", 0), x); err != nil {
					t.Fatal(err)
				}
			} else if _, err := m.Client().UndoDevice(context.Background(), x, migclient.DeviceOwner{PodUID: "a"}); err != nil {
				t.Fatal(err) // a's pod deleted, a reconcile pass made X IDLE
			}
			if st, holder := stateOf(s, x); st != pb.InstanceState_IDLE || holder != "" {
				t.Fatalf("X before b: %v %q", st, holder)
			}
			giver := m
			if tc.otherAdapter {
				other, err := New(context.Background(), m.Client(), nil)
				if err != nil {
					t.Fatal(err)
				}
				giver = other
			}
			if again, took, err := giver.EnsureAllocation(own("b", 0), 0, "1g.10gb", at); err != nil || !took || again != x {
				t.Fatal(again, took, err)
			}
			if err := m.Release(own("a", 0), x); err != nil {
				t.Fatal(err)
			}
			l.MarkIdle(own("a", 0), x)
			if st, holder := stateOf(s, x); st != pb.InstanceState_ACTIVE || holder != "b" {
				t.Fatalf("b's X after a's late rollback: %v %q", st, holder)
			}
			if info, ok := giver.AllocationRuntimeInfo(0, "1g.10gb", at); !ok || info.MigUUID != x {
				t.Fatalf("b's runtime identity after a's late rollback: %+v %t", info, ok)
			}
		})
	}
}

func TestWatchFaultsReportsTheFaultsThatStandThenEachNewOneAndNoHealthyInstance(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	old := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 1, Size: 1, State: pb.InstanceState_IDLE})
	fresh := s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "2g.20gb", Start: 2, Size: 2, State: pb.InstanceState_IDLE})
	s.Fault(old.MigUUID, 48)

	type fault struct {
		mig string
		xid uint32
	}
	got := make(chan fault, 8)
	ctx, cancel := context.WithCancel(context.Background())
	watcher, err := New(ctx, m.Client(), nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- watcher.WatchFaults(func(mig string, xid uint32) { got <- fault{mig, xid} }) }()

	if f := <-got; f != (fault{old.MigUUID, 48}) {
		t.Fatalf("the standing fault: %+v", f)
	}
	for deadline := time.Now().Add(10 * time.Second); s.Following() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the watch never followed") // a bound on waiting, not a timing assertion
		}
	}
	s.Fault(fresh.MigUUID, 79)
	if f := <-got; f != (fault{fresh.MigUUID, 79}) {
		t.Fatalf("the new fault: %+v", f)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("a cancelled watch: %v", err)
	}
	if len(got) != 0 {
		t.Fatalf("a healthy instance was reported: %+v", <-got)
	}
}

// TestWatchFaultsBacksOffFromASidecarWithAsManyFollowersAsItAdmits: the sidecar refuses the
// first three following streams RESOURCE_EXHAUSTED OVERLOADED; the watch opens them again with
// backoff, gets the standing fault once admitted, and follows from then on.
func TestWatchFaultsBacksOffFromASidecarWithAsManyFollowersAsItAdmits(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	old := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	fresh := s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "2g.20gb", Start: 2, Size: 2, State: pb.InstanceState_IDLE})
	s.Fault(old.MigUUID, 48)
	s.RefuseFollowers(3)

	got := make(chan string, 8)
	ctx, cancel := context.WithCancel(context.Background())
	watcher, err := New(ctx, m.Client(), nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- watcher.WatchFaults(func(mig string, xid uint32) { got <- fmt.Sprint(mig, xid) }) }()

	select {
	case f := <-got:
		if f != fmt.Sprint(old.MigUUID, 48) {
			t.Fatalf("the standing fault: %s", f)
		}
	case err := <-done:
		t.Fatalf("the watch ended before it was admitted: %v", err)
	}
	if n := s.RefusedFollowers(); n != 3 {
		t.Fatalf("the sidecar refused %d following streams, want 3 before the one admitted", n)
	}
	for deadline := time.Now().Add(10 * time.Second); s.Following() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the watch never followed") // a bound on waiting, not a timing assertion
		}
	}
	s.Fault(fresh.MigUUID, 79)
	if f := <-got; f != fmt.Sprint(fresh.MigUUID, 79) {
		t.Fatalf("the new fault: %s", f)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("a cancelled watch: %v", err)
	}
}

// updateResponseForCDI's lines in docs/porting-hami.md: every device of the container by its CDI
// name, then the driver's names once, for a created and for a reused (IDLE) instance alike.
func TestTheCDINamesOfAContainerAreItsDevicesAndTheDriverOnce(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	if names := m.DriverCDIDevices(); len(names) != 0 {
		t.Fatalf("driver CDI names before any Allocate: %v", names)
	}
	const driver = "k8s.hami.io/mig-driver=common"
	s.SetDriverCDIDevices(driver)
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	reused, _, err := m.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || reused != cached.MigUUID {
		t.Fatalf("reuse: %s %v", reused, err)
	}
	created, _, err := m.EnsureAllocation(own("p", 1), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 1, Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	var devices []string
	var migDevices bool
	for _, id := range []string{reused, created} {
		if name, ok := m.CDIDevice(id); ok {
			devices = append(devices, name)
			migDevices = true
		}
	}
	if migDevices {
		devices = append(devices, m.DriverCDIDevices()...)
	}
	want := []string{"k8s.device-plugin.nvidia.com/dynamic-mig=" + reused, "k8s.device-plugin.nvidia.com/dynamic-mig=" + created, driver}
	if !slices.Equal(devices, want) {
		t.Fatalf("the container's CDI names %v, want %v", devices, want)
	}
	if names := l.DriverCDIDevices(); !slices.Equal(names, []string{driver}) {
		t.Fatalf("Lazy.DriverCDIDevices %v", names)
	}
}
