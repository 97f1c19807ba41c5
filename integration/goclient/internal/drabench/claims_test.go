package drabench_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/scrape"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestMain(m *testing.M) { os.Exit(kubeapi.Main(m)) }

// The environment bench/dra_claims.py runs the benchmark with.
const (
	envSocket  = "DRA_BENCH_SOCKET"  // the sidecar's socket
	envTrace   = "DRA_BENCH_TRACE"   // the trace, a JSON list of claims
	envOut     = "DRA_BENCH_OUT"     // where the results go, as JSON
	envDestroy = "DRA_BENCH_DESTROY" // "1": the plugin destroys a claim's instances at unprepare
	envSettle  = "DRA_BENCH_SETTLE"  // "0": no wait for the node to settle before an arrival
	envKeep    = "DRA_BENCH_KEEP"    // "0": the plugin names nothing to keep free (KeepFree)
	node       = "bench-node"
	namespace  = "bench"
	waitFor    = 2 * time.Minute // the longest a pod may take to be scheduled, a loaded machine's
	retryWait  = 5 * time.Second // how long an unschedulable pod may take to be tried again and bound
)

// claim is one claim of the trace: it arrives and leaves at trace times (only their order matters).
type claim struct {
	UID     string  `json:"uid"`
	Profile string  `json:"profile"`
	Arrive  float64 `json:"arrive"`
	Leave   float64 `json:"leave"`
}

// result is what became of one claim.
type result struct {
	UID       string  `json:"uid"`
	Profile   string  `json:"profile"`
	Refused   bool    `json:"refused"`             // the scheduler found no device for it
	Retried   bool    `json:"retried,omitempty"`   // it was unschedulable at first, then tried again
	OverIdle  int     `json:"over_idle"`           // IDLE instances overlapping (not at) its device before its prepare
	Device    string  `json:"device,omitempty"`    // the device the scheduler allocated
	Warm      bool    `json:"warm,omitempty"`      // that device was published warm
	Reused    bool    `json:"reused,omitempty"`    // its prepare reused an IDLE instance (the plugin's warm hits moved)
	ScheduleS float64 `json:"schedule_s"`          // claim and pod created to pod bound (or reported unschedulable)
	PrepareS  float64 `json:"prepare_s,omitempty"` // NodePrepareResources
	// PrepareError is the plugin's refusal of a claim the scheduler allocated (its pod never starts).
	PrepareError string `json:"prepare_error,omitempty"`
}

type event struct {
	at     float64
	arrive bool
	claim  int
}

func BenchmarkClaimTrace(b *testing.B) {
	socket, tracePath, out := os.Getenv(envSocket), os.Getenv(envTrace), os.Getenv(envOut)
	if socket == "" || tracePath == "" || out == "" {
		b.Skipf("bench/dra_claims.py runs this with %s, %s and %s", envSocket, envTrace, envOut)
	}
	data, err := os.ReadFile(tracePath)
	if err != nil {
		b.Fatal(err)
	}
	var trace []claim
	if err := json.Unmarshal(data, &trace); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	s := kubeapi.GetWithScheduler(b)
	admin := s.Client(b, kubeapi.AdminUser)
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}},
		metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	c, err := migclient.New(ctx, socket, migclient.Options{CallTimeout: time.Minute, AllocateTimeout: time.Minute,
		AllowSimulatedBackend: true, ListActive: dra.RecoverNoPods})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	settle, keepFree := os.Getenv(envSettle) != "0", os.Getenv(envKeep) != "0" && os.Getenv(envDestroy) != "1"
	asked := map[string]bool{} // the profiles of the claims prepared so far, when the plugin keeps their next free
	reg := prometheus.NewRegistry()
	metrics, err := dra.NewMetrics(reg)
	if err != nil {
		b.Fatal(err)
	}
	opts := dra.Options{NodeName: node, RecoverSidecar: true, DestroyAtUnprepare: os.Getenv(envDestroy) == "1", Metrics: metrics}
	if !keepFree {
		opts.KeepFreeWithin = -1
	}
	n := fakekubelet.Start(ctx, b, s, c, opts)
	kubeapi.ReadyNode(ctx, b, admin, node)

	var events []event
	for i, cl := range trace {
		events = append(events, event{cl.Arrive, true, i}, event{cl.Leave, false, i})
	}
	sort.SliceStable(events, func(i, j int) bool { return events[i].at < events[j].at })
	results := make([]result, len(trace))
	live := map[int]*resourceapi.ResourceClaim{}
	b.ResetTimer()
	for range b.N {
		for _, e := range events {
			cl := trace[e.claim]
			if !e.arrive {
				if prepared, ok := live[e.claim]; ok {
					leave(ctx, b, n, prepared)
					delete(live, e.claim)
				}
				continue
			}
			warm := published(ctx, b, n)
			if settle {
				warm = settled(ctx, b, n, c, asked, opts.DestroyAtUnprepare)
			}
			if keepFree {
				asked[cl.Profile] = true
			}
			hits := warmHits(b, reg)
			r, prepared := arrive(ctx, b, n, s, c, cl, warm)
			r.Reused = warmHits(b, reg) > hits
			results[e.claim] = r
			if prepared != nil {
				live[e.claim] = prepared
			}
		}
		for _, i := range slices.Sorted(maps.Keys(live)) {
			leave(ctx, b, n, live[i])
			delete(live, i)
		}
	}
	b.StopTimer()
	encoded, err := json.MarshalIndent(results, "", " ")
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(out, encoded, 0o600); err != nil {
		b.Fatal(err)
	}
}

// warmHits is the plugin's count of devices prepared on an IDLE instance.
func warmHits(b *testing.B, reg *prometheus.Registry) float64 {
	b.Helper()
	hits, ok := scrape.Value(scrape.Gathered(b, reg), dra.MetricPreparedDevices, map[string]string{"warm": "true"})
	if !ok {
		b.Fatalf("no %s{warm=\"true\"} among the plugin's metrics", dra.MetricPreparedDevices)
	}
	return hits
}

// settled waits until the node is at rest, and returns the published devices' warmth by name:
// the slices show as warm exactly the IDLE instances the sidecar reports and the ones claims hold
// (which go IDLE at their unprepare, unless the plugin destroys them then), and the trim has freed
// what the plugin asked it to keep free: for each profile claims asked for (asked), its first
// published device that is neither warm, nor tainted, nor over an instance a claim holds overlaps
// no IDLE instance. The trace's arrivals are tens of seconds apart in trace time, which leaves the
// sidecar the second or two its background trim takes; the replay does not wait that long between
// events by itself.
func settled(ctx context.Context, b *testing.B, n *fakekubelet.Node, c *migclient.Client, asked map[string]bool, destroy bool) map[string]bool {
	b.Helper()
	warm := map[string]bool{}
	n.Devices(ctx, b, func(devices []resourceapi.Device) bool {
		st, err := c.GetState(ctx)
		if err != nil {
			b.Fatal(err)
		}
		view := dra.ViewOf(st)
		want := maps.Clone(view.Warm)
		if !destroy {
			maps.Copy(want, view.Held)
		}
		overlaps := func(ps []migclient.Placement, p dra.Placed) bool {
			return slices.ContainsFunc(ps, p.Placement.Overlaps)
		}
		held := map[string][]migclient.Placement{}
		for p := range view.Held {
			held[p.GPUUUID] = append(held[p.GPUUUID], p.Placement)
		}
		got := map[dra.Placed]bool{}
		clear(warm)
		cold := map[string]bool{} // profiles whose first cold device was seen
		free := true
		for _, d := range devices {
			p := placed(d)
			if a := d.Attributes[dra.AttrWarm].BoolValue; a != nil && *a {
				got[p] = true
				warm[d.Name] = true
				continue
			}
			if !asked[p.Profile] || len(d.Taints) > 0 || overlaps(held[p.GPUUUID], p) || cold[p.Profile] {
				continue
			}
			cold[p.Profile] = true
			free = free && !overlaps(view.Idle[p.GPUUUID], p)
		}
		return len(devices) > 0 && maps.Equal(got, want) && free
	})
	return warm
}

// published is the warmth of the devices published now, by name, with no wait.
func published(ctx context.Context, b *testing.B, n *fakekubelet.Node) map[string]bool {
	b.Helper()
	warm := map[string]bool{}
	n.Devices(ctx, b, func(devices []resourceapi.Device) bool {
		for _, d := range devices {
			if a := d.Attributes[dra.AttrWarm].BoolValue; a != nil && *a {
				warm[d.Name] = true
			}
		}
		return len(devices) > 0
	})
	return warm
}

func placed(d resourceapi.Device) dra.Placed {
	start, size := d.Attributes[dra.AttrPlacementStart].IntValue, d.Attributes[dra.AttrPlacementSize].IntValue
	return dra.Placed{GPUUUID: *d.Attributes[dra.AttrGPUUUID].StringValue, Profile: *d.Attributes[dra.AttrProfile].StringValue,
		Placement: migclient.Placement{Start: uint32(*start), Size: uint32(*size)}}
}

// arrive creates cl's claim and pod, waits for the scheduler, and prepares the claim as kubelet
// would; the claim is nil when the scheduler refused it (its pod and claim are deleted then).
func arrive(ctx context.Context, b *testing.B, n *fakekubelet.Node, s *kubeapi.Server, c *migclient.Client, cl claim,
	warm map[string]bool,
) (result, *resourceapi.ResourceClaim) {
	b.Helper()
	r := result{UID: cl.UID, Profile: cl.Profile}
	admin := n.Admin
	selector := fmt.Sprintf(`device.attributes[%q].%s == %q`, dra.DefaultDriverName, dra.AttrProfile, cl.Profile)
	request := resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: dra.DefaultDriverName,
		Selectors:       []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: selector}}}}}
	start := time.Now()
	kubeapi.PodWithClaim(b, admin, namespace, cl.UID, request)
	bound := false
	err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, waitFor, true, func(ctx context.Context) (bool, error) {
		got, err := admin.CoreV1().Pods(namespace).Get(ctx, cl.UID, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		bound = got.Spec.NodeName != ""
		return bound || slices.ContainsFunc(got.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodScheduled && c.Reason == corev1.PodReasonUnschedulable
		}), nil
	})
	if err == nil && !bound {
		// Unschedulable at one attempt: the scheduler tries the pod again when a claim or a slice
		// it may fit after changes (a departed claim's deletion it had not seen yet, a pool it saw
		// half rewritten), after its backoff. Refused only if it still does not fit once that
		// could have happened, with no other event meanwhile.
		r.Retried = true
		_ = wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, retryWait, true, func(ctx context.Context) (bool, error) {
			got, err := admin.CoreV1().Pods(namespace).Get(ctx, cl.UID, metav1.GetOptions{})
			bound = err == nil && got.Spec.NodeName != ""
			return bound, err
		})
	}
	r.ScheduleS = time.Since(start).Seconds()
	if err != nil {
		b.Fatalf("claim %s (%s): the scheduler neither bound nor refused its pod: %v; its log ends:\n%s", cl.UID, cl.Profile, err,
			s.LogTail("kube-scheduler"))
	}
	if !bound {
		r.Refused = true
		remove(ctx, b, admin, cl.UID)
		return r, nil
	}
	allocated, err := admin.ResourceV1().ResourceClaims(namespace).Get(ctx, cl.UID, metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	if allocated.Status.Allocation == nil || len(allocated.Status.Allocation.Devices.Results) != 1 {
		b.Fatalf("claim %s: bound but allocated %+v", cl.UID, allocated.Status.Allocation)
	}
	r.Device = allocated.Status.Allocation.Devices.Results[0].Device
	r.Warm = warm[r.Device]
	r.OverIdle = overIdle(ctx, b, n, c, allocated.Status.Allocation.Devices.Results[0])
	start = time.Now()
	answer, err := n.Prepare(ctx, allocated)
	r.PrepareS = time.Since(start).Seconds()
	if err == nil && answer.GetError() != "" {
		// Refused: the claim's pod would never start (DRA does not allocate a claim again). Counted,
		// not fatal, so a run shows how often; the pod and the claim go as a stuck pod's would.
		r.PrepareError = answer.GetError()
		remove(ctx, b, admin, cl.UID)
		return r, nil
	}
	if err != nil || len(fakekubelet.CDIDevices(answer)) != 1 {
		b.Fatalf("prepare claim %s (%s on %s): %v %v", cl.UID, cl.Profile, r.Device, err, answer)
	}
	return r, allocated
}

// overIdle counts the IDLE instances the sidecar reports overlapping the allocated device other
// than one exactly at it: what its prepare destroys unless the trim does first.
func overIdle(ctx context.Context, b *testing.B, n *fakekubelet.Node, c *migclient.Client, r resourceapi.DeviceRequestAllocationResult) int {
	b.Helper()
	d, ok := n.Driver.Model().Lookup(r.Pool, r.Device)
	if !ok {
		b.Fatalf("device %s/%s is not the plugin's", r.Pool, r.Device)
	}
	st, err := c.GetState(ctx)
	if err != nil {
		b.Fatal(err)
	}
	view, count := dra.ViewOf(st), 0
	for _, p := range view.Idle[d.GPUUUID] {
		if p != d.Placement && p.Overlaps(d.Placement) {
			count++
		}
	}
	return count
}

// leave unprepares a claim and deletes its pod and the claim.
func leave(ctx context.Context, b *testing.B, n *fakekubelet.Node, prepared *resourceapi.ResourceClaim) {
	b.Helper()
	if err := n.Unprepare(ctx, prepared); err != nil {
		b.Fatal(err)
	}
	remove(ctx, b, n.Admin, prepared.Name)
}

// remove deletes pod name at once (no kubelet confirms it) and then its claim.
func remove(ctx context.Context, b *testing.B, admin kubernetes.Interface, name string) {
	b.Helper()
	if err := admin.CoreV1().Pods(namespace).Delete(ctx, name, *metav1.NewDeleteOptions(0)); err != nil {
		b.Fatal(err)
	}
	if err := kubeapi.DeleteClaim(ctx, admin, namespace, name); err != nil {
		b.Fatal(err)
	}
}
