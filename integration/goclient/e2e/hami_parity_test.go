// HAMi's lazy-lifecycle scenarios that need the simulated hardware to misbehave (an ERROR
// instance in a request's way, a pending reservation guarding one) or to hold a real IDLE
// instance (placement order for hami.io/node-nvidia-register), through the hami adapter.
package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// sim runs the simulator's command line on the sidecar's hardware and returns its output.
func sim(t *testing.T, args ...string) string {
	t.Helper()
	line := env(t, "MIGSIDECAR_SIM_CMD") + " " + strings.Join(args, " ")
	out, err := exec.Command("/bin/sh", "-c", line).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	return string(out)
}

// hardware is what the simulated driver holds: the MIG UUIDs of its compute instances and its
// GPU instances as "index@start:size". A GI whose CI is gone (a destroy that failed half way)
// shows only in the second.
func hardware(t *testing.T) (migUUIDs, gis []string) {
	t.Helper()
	var doc struct {
		Gpus []struct {
			Index int `json:"index"`
			Gis   []struct {
				Placement struct{ Start, Size uint32 } `json:"placement"`
				Cis       []struct {
					MigUUID string `json:"mig_uuid"`
				} `json:"cis"`
			} `json:"gis"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal([]byte(sim(t, "list", "--json")), &doc); err != nil {
		t.Fatal(err)
	}
	for _, g := range doc.Gpus {
		for _, gi := range g.Gis {
			gis = append(gis, fmt.Sprintf("%d@%d:%d", g.Index, gi.Placement.Start, gi.Placement.Size))
			for _, ci := range gi.Cis {
				migUUIDs = append(migUUIDs, ci.MigUUID)
			}
		}
	}
	slices.Sort(migUUIDs)
	slices.Sort(gis)
	return migUUIDs, gis
}

// onlyLive fails the test unless the hardware holds exactly one instance: migUUID at gi.
func onlyLive(t *testing.T, migUUID, gi string) {
	t.Helper()
	if uuids, gis := hardware(t); !slices.Equal(uuids, []string{migUUID}) || !slices.Equal(gis, []string{gi}) {
		t.Fatalf("hardware: MIG devices %v, GPU instances %v; want only %s at %s", uuids, gis, migUUID, gi)
	}
}

// noFaultsLeft fails the test unless every injected fault fired: the failure the scenario is
// about really happened.
func noFaultsLeft(t *testing.T) {
	t.Helper()
	if out := sim(t, "faults"); strings.Contains(out, "destroy-gi") {
		t.Fatalf("the injected destroy fault never fired:\n%s", out)
	}
}

func specNames(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(env(t, "MIGSIDECAR_CDI_DIR"), "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, string(b))
	}
	return out
}

func owner(uid string) hami.Owner {
	return hami.Owner{PodUID: uid, PodNamespace: "e2e", PodName: "pod-" + uid, ContainerName: "main"}
}

// TestAnErrorInstanceAtTheExactKeyIsRetriedInsideEnsureAllocation is HAMi's
// TestMIGErrorAtExactKeyRetriesReclamation: the rollback's destroy failed, so the instance at
// the container's own reservation is ERROR; the kubelet's next Allocate of that container
// destroys it inside the call and creates a new one. Needs a quiet reconciler, which would
// otherwise destroy the ERROR instance first.
func TestAnErrorInstanceAtTheExactKeyIsRetriedInsideEnsureAllocation(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	m, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	a, gpu := owner("exact"), int(gpus[0].Index)
	first, err := m.EnsureAllocation(a, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1})
	if err != nil || !first.Created {
		t.Fatalf("first Allocate: %+v %v", first, err)
	}
	sim(t, "fault", "destroy-gi", "UNKNOWN", "--times", "1")
	if err := m.Release(a, first.MigUUID); err != nil { // a later device of the container failed
		t.Logf("undo: %v", err)
	}
	noFaultsLeft(t)
	if s := states(ctx, t, c); len(s) != 1 || s[first.MigUUID] != pb.InstanceState_ERROR {
		t.Fatalf("after the failed rollback: %v", s)
	}

	again, err := m.EnsureAllocation(a, gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 4, Size: 1})
	if err != nil {
		t.Fatalf("Allocate at the ERROR instance's key: %v", err)
	}
	if !again.Created || again.MigUUID == first.MigUUID || !slices.Equal(again.Reclaimed, []string{first.MigUUID}) {
		t.Fatalf("want a new instance and the ERROR one reclaimed, got %+v (broken %s)", again, first.MigUUID)
	}
	onlyLive(t, again.MigUUID, fmt.Sprintf("%d@4:1", gpu))
	if s := states(ctx, t, c); len(s) != 1 || s[again.MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("states after the retry: %v", s)
	}
	for _, spec := range specNames(t) {
		if strings.Contains(spec, first.MigUUID) {
			t.Fatalf("a CDI spec still names the destroyed instance:\n%s", spec)
		}
	}
}

// TestAnErrorInstanceOverlappingThePlacementIsRetriedInsideEnsureAllocation: the reclaim of
// the IDLE instances under a 3g.40gb fails its first destroy, which leaves that instance ERROR
// and answers UNAVAILABLE; the client's retry of the same request destroys the ERROR instance
// inline and creates, so the one EnsureAllocation succeeds. Needs a quiet reconciler.
func TestAnErrorInstanceOverlappingThePlacementIsRetriedInsideEnsureAllocation(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	m, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	gpu := int(gpus[0].Index)
	var cached []string
	for i, uid := range []string{"cached-4", "cached-5"} {
		req := request(uid, dev(gpus[0], "1g.10gb", uint32(4+i), 1))
		cached = append(cached, allocate(ctx, t, c, p, req).Devices[0].MigUUID)
		p.forget(uid)
	}
	if err := m.ReconcileActiveAllocations(nil); err != nil {
		t.Fatalf("release: %v", err)
	}
	if s := states(ctx, t, c); s[cached[0]] != pb.InstanceState_IDLE || s[cached[1]] != pb.InstanceState_IDLE {
		t.Fatalf("after the release: %v", s)
	}
	sim(t, "fault", "destroy-gi", "UNKNOWN", "--times", "1")

	got, err := m.EnsureAllocation(owner("big"), gpu, "3g.40gb", nvml.GpuInstancePlacement{Start: 4, Size: 4})
	if err != nil {
		t.Fatalf("Allocate over an instance whose destroy failed: %v", err)
	}
	noFaultsLeft(t)
	if !got.Created || len(got.Reclaimed) == 0 {
		t.Fatalf("result %+v", got)
	}
	for _, r := range got.Reclaimed {
		if !slices.Contains(cached, r) {
			t.Fatalf("reclaimed %s, which was not in the way (%v)", r, cached)
		}
	}
	onlyLive(t, got.MigUUID, fmt.Sprintf("%d@4:4", gpu))
	if s := states(ctx, t, c); len(s) != 1 || s[got.MigUUID] != pb.InstanceState_ACTIVE {
		t.Fatalf("states after the Allocate: %v", s)
	}
}

// TestAPendingReservationKeepsTheReconcilerOffTheErrorInstanceAtIt is HAMi's
// TestMIGCleanupRetryPreservesActiveReservation: two ERROR instances, one at exactly the spot
// the scheduler reserved for a pod not yet allocated. The reconciler (every 0.2 s here)
// destroys the other once destroys work again and leaves the reserved one to the pod's own
// Allocate, which destroys it inline and creates.
func TestAPendingReservationKeepsTheReconcilerOffTheErrorInstanceAtIt(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	m, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	gpu := int(gpus[0].Index)
	// The guarded one first: the table keeps insertion order, so a reconciler round that
	// destroyed the unguarded one had already passed the guarded one.
	var broken []string
	sim(t, "fault", "destroy-gi", "UNKNOWN", "--times", "1000000")
	for _, uid := range []string{"guarded", "unguarded"} {
		start := map[string]uint32{"guarded": 0, "unguarded": 4}[uid]
		res, err := m.EnsureAllocation(owner(uid), gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: start, Size: 1})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Release(owner(uid), res.MigUUID); err != nil {
			t.Logf("undo %s: %v", uid, err)
		}
		broken = append(broken, res.MigUUID)
	}
	guarded, unguarded := broken[0], broken[1]
	if s := states(ctx, t, c); s[guarded] != pb.InstanceState_ERROR || s[unguarded] != pb.InstanceState_ERROR {
		t.Fatalf("want both ERROR: %v", s)
	}
	p.mu.Lock()
	p.active["queued"] = []*pb.ActiveAllocation{{Pod: &pb.PodRef{Uid: "queued", Namespace: "e2e", Name: "pod-queued"},
		ContainerName: "main", GpuUuid: gpus[0].UUID, Profile: "1g.10gb", Placement: &pb.Placement{Start: 0, Size: 1}}}
	p.mu.Unlock()
	if err := m.ReconcileActiveAllocations(nil); err != nil {
		t.Fatalf("SyncActive with a pending reservation: %v", err)
	}
	sim(t, "faults", "--clear")

	for states(ctx, t, c)[unguarded] == pb.InstanceState_ERROR { // bounded by ctx's deadline
		select {
		case <-ctx.Done():
			t.Fatalf("the reconciler never destroyed the unguarded ERROR instance: %v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	if s := states(ctx, t, c); len(s) != 1 || s[guarded] != pb.InstanceState_ERROR {
		t.Fatalf("after the reconciler: %v", s)
	}
	if _, gis := hardware(t); !slices.Equal(gis, []string{fmt.Sprintf("%d@0:1", gpu)}) {
		t.Fatalf("GPU instances after the reconciler: %v, want only the guarded one's", gis)
	}

	res, err := m.EnsureAllocation(owner("queued"), gpu, "1g.10gb", nvml.GpuInstancePlacement{Start: 0, Size: 1})
	if err != nil || !res.Created || !slices.Equal(res.Reclaimed, []string{guarded}) {
		t.Fatalf("the reservation's own Allocate: %+v %v", res, err)
	}
	onlyLive(t, res.MigUUID, fmt.Sprintf("%d@0:1", gpu))
}

// TestTheRegisterHelperPublishesAnIdleInstanceFirstAndItsReclaimLast: with a real IDLE
// 1g.10gb at 3:1 and an ACTIVE one at 0:1, the 1g.10gb placements HAMi publishes start with
// 3:1 (REUSE), and the 2g.20gb ones end with 0:2 (BLOCKED) after 2:2 (RECLAIM); the
// idle-inventory annotation names the IDLE instance.
func TestTheRegisterHelperPublishesAnIdleInstanceFirstAndItsReclaimLast(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	allocate(ctx, t, c, p, request("busy", dev(gpus[0], "1g.10gb", 0, 1)))
	idle := allocate(ctx, t, c, p, request("cached", dev(gpus[0], "1g.10gb", 3, 1))).Devices[0].MigUUID
	p.forget("cached")
	if _, err := c.ReleaseByPodList(ctx, p.list); err != nil {
		t.Fatal(err)
	}
	m, err := hami.NewLazy(ctx, c, p.list)
	if err != nil {
		t.Fatal(err)
	}
	profiles, _, err := m.Manager().DiscoverProfiles(int(gpus[0].Index), []string{"1g.10gb", "2g.20gb"})
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string][]register.Placement{}
	for _, pr := range profiles {
		byName[pr.Name] = pr.Placements
	}
	one, two := byName["1g.10gb"], byName["2g.20gb"]
	if len(one) != 7 || one[0] != (register.Placement{Start: 3, Size: 1}) || one[len(one)-1] != (register.Placement{Start: 0, Size: 1}) {
		t.Fatalf("1g.10gb placements: want 3:1 first (REUSE) and 0:1 last (BLOCKED), got %v", one)
	}
	if len(two) < 3 || two[len(two)-1] != (register.Placement{Start: 0, Size: 2}) || two[len(two)-2] != (register.Placement{Start: 2, Size: 2}) {
		t.Fatalf("2g.20gb placements: want ... 2:2 (RECLAIM), 0:2 (BLOCKED), got %v", two)
	}
	st, err := c.GetState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	value, err := register.EncodeIdle(register.IdleFromState(st))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"` + gpus[0].UUID + `":[{"profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"` + idle + `"}]}`
	if value != want {
		t.Fatalf("%s = %s, want %s", register.IdleKey, value, want)
	}
}
