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
	// HAMi's rollback: Release for each device it took. The first undoes the container.
	for _, uuid := range []string{created.MigUUID, reused} {
		if err := m.Release(uuid); err != nil {
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
	if err := m.Release("MIG-unknown"); err != nil {
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
	l.MarkIdle("MIG-unknown")
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
	if err := m.Release(dev1); err != nil {
		t.Fatal(err)
	}
	if st, _ := stateOf(s, dev1); st != pb.InstanceState_INSTANCE_STATE_UNSPECIFIED {
		t.Fatalf("the created device 1 is still there: %v", st)
	}
	if st, holder := stateOf(s, dev0); st != pb.InstanceState_ACTIVE || holder != "a" {
		t.Fatalf("device 0 after releasing device 1: %v %q", st, holder)
	}

	// Device 0 goes back IDLE; pod b reuses it; a repeated Release of it (a retried rollback)
	// leaves pod b's instance alone.
	if err := m.Release(dev0); err != nil {
		t.Fatal(err)
	}
	if st, _ := stateOf(s, dev0); st != pb.InstanceState_IDLE {
		t.Fatalf("device 0 after its release: %v", st)
	}
	s.ResetCalls()
	if err := m.Release(dev0); err != nil {
		t.Fatal(err)
	}
	if n := s.Calls()["UndoDevice"]; n != 0 {
		t.Fatalf("a repeated Release sent %d UndoDevice", n)
	}
	if again, _, err := m.EnsureAllocation(own("b", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1}); err != nil || again != dev0 {
		t.Fatal(again, err)
	}
	// Another adapter over the same sidecar (a second plugin, or this one restarted) never
	// handed dev0 out: its Release changes nothing.
	other, err := NewLazy(context.Background(), m.Client(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Release(dev0); err != nil {
		t.Fatal(err)
	}
	other.MarkIdle(dev0)
	if st, holder := stateOf(s, dev0); st != pb.InstanceState_ACTIVE || holder != "b" {
		t.Fatalf("pod b's instance after Releases that were not its own: %v %q", st, holder)
	}
}

// TestTheSidecarGuardsAStaleOwner: an owner that no longer holds the instance (it went IDLE and
// to another pod behind this adapter's back, through another adapter) is refused by the
// sidecar, not by the adapter's memory.
func TestTheSidecarGuardsAStaleOwner(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	mig, _, err := m.EnsureAllocation(own("a", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 2, Size: 1})
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewLazy(context.Background(), m.Client(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Client().UndoDevice(context.Background(), mig, migclient.DeviceOwner{PodUID: "a"}); err != nil {
		t.Fatal(err)
	}
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 2, Size: 1, State: pb.InstanceState_IDLE, MigUUID: mig + "-again"})
	if _, err := other.EnsureAllocation(own("b", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 2, Size: 1}); err != nil {
		t.Fatal(err)
	}
	s.ResetCalls()
	if err := m.Release(mig + "-again"); err != nil { // never handed out by m
		t.Fatal(err)
	}
	if n := s.Calls()["UndoDevice"]; n != 0 {
		t.Fatalf("a MIG UUID m never handed out sent %d UndoDevice", n)
	}
	res, err := m.Client().UndoDevice(context.Background(), mig+"-again", migclient.DeviceOwner{PodUID: "a"})
	if err != nil || res.Skipped != migclient.UndoSkipOtherOwner {
		t.Fatalf("a stale owner: %+v %v", res, err)
	}
	if st, holder := stateOf(s, mig+"-again"); st != pb.InstanceState_ACTIVE || holder != "b" {
		t.Fatalf("pod b's instance: %v %q", st, holder)
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

// TestARolledBackHandOutIsNeverReleasedAgainOntoALaterOwner: the same adapter hands the cached
// instance to pod d, rolls it back (IDLE), hands it to pod e; a second Release of that MIG UUID
// (d's rollback repeated) leaves e's instance ACTIVE and e's, and sends nothing.
func TestARolledBackHandOutIsNeverReleasedAgainOntoALaterOwner(t *testing.T) {
	s, l := lazy(t)
	m := l.Manager()
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	at := nvml.GpuInstancePlacement{Start: 0, Size: 1}
	x, took, err := m.EnsureAllocation(own("d", 0), 0, "1g.10gb", at)
	if err != nil || !took || x != cached.MigUUID {
		t.Fatal(x, took, err)
	}
	if err := m.Release(x); err != nil {
		t.Fatal(err)
	}
	if st, holder := stateOf(s, x); st != pb.InstanceState_IDLE || holder != "" {
		t.Fatalf("after d's rollback: %v %q", st, holder)
	}
	if again, took, err := m.EnsureAllocation(own("e", 0), 0, "1g.10gb", at); err != nil || !took || again != x {
		t.Fatal(again, took, err)
	}
	s.ResetCalls()
	if err := m.Release(x); err != nil {
		t.Fatal(err)
	}
	l.MarkIdle(x)
	if n := s.Calls()["UndoDevice"]; n != 0 {
		t.Fatalf("Releases after the rollback sent %d UndoDevice", n)
	}
	if st, holder := stateOf(s, x); st != pb.InstanceState_ACTIVE || holder != "e" {
		t.Fatalf("pod e's instance after d's repeated rollback: %v %q", st, holder)
	}
}
