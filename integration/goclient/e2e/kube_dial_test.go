// kube.Dial as HAMi's CI uses it: against a real sidecar on the simulated backend, with the
// opt-in in the environment, the pods in client-go's fake clientset; and the device-level
// rollback through the adapter, seen in the sidecar's state and on the simulated hardware.
package e2e

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami/kube"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func TestKubeDialAcceptsTheSimulatorOnlyWithTheOptInAndReleasesExactlyWhatItTook(t *testing.T) {
	socket := env(t, "MIGSIDECAR_SOCKET")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pods := fake.NewSimpleClientset()
	quick := kube.WithClientOptions(migclient.Options{CallTimeout: 30 * time.Second, AllocateTimeout: 60 * time.Second})

	t.Setenv(kube.AllowSimulatedEnv, "")
	if _, err := kube.Dial(ctx, socket, pods.CoreV1().Pods(""), "node-1", quick); !migclient.IsReason(err, migclient.ReasonSimulatedBackend) {
		t.Fatalf("without the opt-in: %v", err)
	}
	t.Setenv(kube.AllowSimulatedEnv, "true")
	m, err := kube.Dial(ctx, socket, pods.CoreV1().Pods(""), "node-1", quick)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	gpus, err := m.Client().ListGpus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gpu := int(gpus[0].Index)
	owner := func(uid string, device int) hami.Owner {
		return hami.Owner{PodUID: uid, PodNamespace: "e2e", PodName: "pod-" + uid, ContainerName: "main", DeviceIndex: device}
	}
	at := func(start uint32) nvml.GpuInstancePlacement { return nvml.GpuInstancePlacement{Start: start, Size: 1} }

	// A container with two devices; the rollback of device 1 leaves device 0 as it was.
	dev0, _, err := m.EnsureAllocation(owner("a", 0), gpu, "1g.10gb", at(0))
	if err != nil {
		t.Fatal(err)
	}
	dev1, _, err := m.EnsureAllocation(owner("a", 1), gpu, "1g.10gb", at(1))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Release(owner("a", 1), dev1); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, m.Client()); len(s) != 1 || s[dev0] != pb.InstanceState_ACTIVE {
		t.Fatalf("after releasing device 1: %v", s)
	}
	if uuids, _ := hardware(t); !slices.Equal(uuids, []string{dev0}) {
		t.Fatalf("hardware after releasing device 1: %v", uuids)
	}

	// Pod a goes (the reconciler idles device 0), pod b reuses it, and a's repeated Release
	// (a retried rollback) changes nothing of b's.
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "e2e", Name: "pod-b", UID: "b"}, Spec: corev1.PodSpec{NodeName: "node-1"}}
	if _, err := pods.CoreV1().Pods("e2e").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, m.Client()); s[dev0] != pb.InstanceState_IDLE {
		t.Fatalf("after pod a went: %v", s)
	}
	reused, took, err := m.EnsureAllocation(owner("b", 0), gpu, "1g.10gb", at(0))
	if err != nil || !took || reused != dev0 {
		t.Fatalf("reuse: %s %t %v", reused, took, err)
	}
	for range 2 {
		if err := m.Release(owner("a", 0), dev0); err != nil {
			t.Fatal(err)
		}
	}
	// Through another adapter (a plugin restarted, or a second one), a's rollback is a's too.
	releaseThroughAnother(ctx, t, socket, pods.CoreV1().Pods(""), owner("a", 0), dev0, quick)
	if s := states(ctx, t, m.Client()); len(s) != 1 || s[dev0] != pb.InstanceState_ACTIVE {
		t.Fatalf("pod b's instance after Releases not its own: %v", s)
	}
	st, err := m.Client().GetState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if in.GetMigUuid() == dev0 && in.GetOwner().GetPod().GetUid() != "b" {
				t.Fatalf("dev0 held by %v", in.GetOwner())
			}
		}
	}
	// b's own rollback gives it back IDLE; once more changes nothing.
	if err := m.Release(owner("b", 0), dev0); err != nil {
		t.Fatal(err)
	}
	if err := m.Release(owner("b", 0), dev0); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, m.Client()); len(s) != 1 || s[dev0] != pb.InstanceState_IDLE {
		t.Fatalf("after b's rollback: %v", s)
	}
}

// TestARolledBackInstanceHandedToAnotherPodStaysItsThroughEveryRelease: one adapter hands the
// cached instance X to pod d and rolls it back (IDLE), then hands X to pod e; d's rollback
// repeated, through that adapter or another, leaves e's instance ACTIVE, e's, and on the GPU.
func TestARolledBackInstanceHandedToAnotherPodStaysItsThroughEveryRelease(t *testing.T) {
	socket := env(t, "MIGSIDECAR_SOCKET")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t.Setenv(kube.AllowSimulatedEnv, "true")
	pods := fake.NewSimpleClientset()
	quick := kube.WithClientOptions(migclient.Options{CallTimeout: 30 * time.Second, AllocateTimeout: 60 * time.Second})
	m, err := kube.Dial(ctx, socket, pods.CoreV1().Pods(""), "node-1", quick)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	gpus, err := m.Client().ListGpus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gpu := int(gpus[0].Index)
	owner := func(uid string) hami.Owner {
		return hami.Owner{PodUID: uid, PodNamespace: "e2e", PodName: "pod-" + uid, ContainerName: "main"}
	}
	at := nvml.GpuInstancePlacement{Start: 2, Size: 1}

	// X is cached: pod c had it and went.
	x, _, err := m.EnsureAllocation(owner("c"), gpu, "1g.10gb", at)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Client().Release(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	// d takes X and rolls it back; e takes X.
	if got, took, err := m.EnsureAllocation(owner("d"), gpu, "1g.10gb", at); err != nil || !took || got != x {
		t.Fatalf("d: %s %t %v", got, took, err)
	}
	if err := m.Release(owner("d"), x); err != nil {
		t.Fatal(err)
	}
	if s := states(ctx, t, m.Client()); s[x] != pb.InstanceState_IDLE {
		t.Fatalf("after d's rollback: %v", s)
	}
	if got, took, err := m.EnsureAllocation(owner("e"), gpu, "1g.10gb", at); err != nil || !took || got != x {
		t.Fatalf("e: %s %t %v", got, took, err)
	}
	// d's rollback again, through the same adapter and through another.
	if err := m.Release(owner("d"), x); err != nil {
		t.Fatal(err)
	}
	releaseThroughAnother(ctx, t, socket, pods.CoreV1().Pods(""), owner("d"), x, quick)

	st, err := m.Client().GetState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var holder string
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if in.GetMigUuid() == x && in.GetState() == pb.InstanceState_ACTIVE {
				holder = in.GetOwner().GetPod().GetUid()
			}
		}
	}
	if holder != "e" {
		t.Fatalf("X after d's repeated rollback: held by %q, want ACTIVE for e", holder)
	}
	if uuids, _ := hardware(t); !slices.Contains(uuids, x) {
		t.Fatalf("X is gone from the GPU: %v", uuids)
	}
}

// releaseThroughAnother sends owner's Release of migUUID through a second adapter on node-1 (a
// plugin restarted, or a second one), which never handed it out, and shuts that adapter down.
func releaseThroughAnother(ctx context.Context, t *testing.T, socket string, pods kube.PodLister, owner hami.Owner, migUUID string, opts ...kube.Option) {
	t.Helper()
	other, err := kube.Dial(ctx, socket, pods, "node-1", opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Shutdown()
	if err := other.Release(owner, migUUID); err != nil {
		t.Fatal(err)
	}
}

// TestALateRollbackLeavesTheNextPodsInstanceActive is G1 and G2 at a real sidecar. Pod a takes X
// (a reused IDLE instance); X goes IDLE again, by a's own rollback (G1: the rollback is then
// repeated) or by a reconcile pass after a's pod was deleted (G2: a's rollback arrives late, for
// the first time); pod b reuses X, through the same adapter or another one; then a's Release of
// X, naming a, arrives. b's X stays ACTIVE, b's, and on the GPU.
func TestALateRollbackLeavesTheNextPodsInstanceActive(t *testing.T) {
	socket := env(t, "MIGSIDECAR_SOCKET")
	t.Setenv(kube.AllowSimulatedEnv, "true")
	quick := kube.WithClientOptions(migclient.Options{CallTimeout: 30 * time.Second, AllocateTimeout: 60 * time.Second})
	for i, tc := range []struct {
		name         string
		undoneFirst  bool // G1: a's rollback ran before b's hand-out, and is repeated
		otherAdapter bool // b's hand-out goes through a second adapter over the same socket
	}{
		{name: "G1 through the same adapter", undoneFirst: true},
		{name: "G2 through the same adapter"},
		{name: "G2 through another adapter", otherAdapter: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			pods := fake.NewSimpleClientset()
			m, err := kube.Dial(ctx, socket, pods.CoreV1().Pods(""), "node-1", quick)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Shutdown()
			gpus, err := m.Client().ListGpus(ctx)
			if err != nil {
				t.Fatal(err)
			}
			gpu := int(gpus[0].Index)
			owner := func(uid string) hami.Owner {
				uid = fmt.Sprintf("%s-%d", uid, i)
				return hami.Owner{PodUID: uid, PodNamespace: "e2e", PodName: "pod-" + uid, ContainerName: "main"}
			}
			at := nvml.GpuInstancePlacement{Start: uint32(4 + i), Size: 1}

			// X is cached: pod c had it and went.
			x, _, err := m.EnsureAllocation(owner("c"), gpu, "1g.10gb", at)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.Client().Release(ctx, owner("c").PodUID); err != nil {
				t.Fatal(err)
			}
			if got, took, err := m.EnsureAllocation(owner("a"), gpu, "1g.10gb", at); err != nil || !took || got != x {
				t.Fatalf("a: %s %t %v", got, took, err)
			}
			if tc.undoneFirst {
				if err := m.Release(owner("a"), x); err != nil {
					t.Fatal(err)
				}
			} else if err := m.ReconcileNodePods(); err != nil { // a's pod is gone: no pod lists it
				t.Fatal(err)
			}
			if s := states(ctx, t, m.Client()); s[x] != pb.InstanceState_IDLE {
				t.Fatalf("X before b: %v", s)
			}
			giver := m
			if tc.otherAdapter {
				other, err := kube.Dial(ctx, socket, pods.CoreV1().Pods(""), "node-1", quick)
				if err != nil {
					t.Fatal(err)
				}
				defer other.Shutdown()
				giver = other
			}
			if got, took, err := giver.EnsureAllocation(owner("b"), gpu, "1g.10gb", at); err != nil || !took || got != x {
				t.Fatalf("b: %s %t %v", got, took, err)
			}
			if err := m.Release(owner("a"), x); err != nil { // a's rollback, late
				t.Fatal(err)
			}
			st, err := m.Client().GetState(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var holder string
			for _, g := range st.GetGpus() {
				for _, in := range g.GetInstances() {
					if in.GetMigUuid() == x && in.GetState() == pb.InstanceState_ACTIVE {
						holder = in.GetOwner().GetPod().GetUid()
					}
				}
			}
			if holder != owner("b").PodUID {
				t.Fatalf("X after a's late rollback: held by %q, want ACTIVE for %s", holder, owner("b").PodUID)
			}
			if uuids, _ := hardware(t); !slices.Contains(uuids, x) {
				t.Fatalf("X is gone from the GPU: %v", uuids)
			}
			if _, err := m.Client().Release(ctx, owner("b").PodUID); err != nil { // leave the GPU to the next case
				t.Fatal(err)
			}
		})
	}
}
