package kube

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// node is one node's pods in client-go's fake clientset, which records every API action.
func node(t *testing.T, pods ...corev1.Pod) *fake.Clientset {
	t.Helper()
	objs := make([]corev1.Pod, 0, len(pods))
	for _, p := range pods {
		p.Spec.NodeName = "node-1"
		objs = append(objs, p)
	}
	cs := fake.NewSimpleClientset()
	for i := range objs {
		if _, err := cs.CoreV1().Pods(objs[i].Namespace).Create(context.Background(), &objs[i], metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cs.ClearActions()
	return cs
}

func podLists(cs *fake.Clientset) int {
	n := 0
	for _, a := range cs.Actions() {
		if a.GetVerb() == "list" && a.GetResource().Resource == "pods" {
			n++
		}
	}
	return n
}

func quick() Option {
	return WithClientOptions(migclient.Options{CallTimeout: 5 * time.Second, AllocateTimeout: 5 * time.Second, MaxAttempts: 3})
}

func TestDialRefusesASimulatedSidecarUnlessTheOptInIsGiven(t *testing.T) {
	_, socket := fakesidecar.Start(t, "GPU-a") // the fake reports the simulated backend
	cs := node(t)
	t.Setenv(AllowSimulatedEnv, "")
	// The refusal names the opt-in as HAMi's operator sets it, not the client's Go field.
	if _, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick()); !migclient.IsReason(err, migclient.ReasonSimulatedBackend) ||
		!strings.Contains(err.Error(), "set "+AllowSimulatedEnv+"=true only") {
		t.Fatalf("without the opt-in: %v", err)
	}
	t.Setenv(AllowSimulatedEnv, "yes please")
	if _, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick()); err == nil {
		t.Fatal("a malformed opt-in was taken")
	}
	t.Setenv(AllowSimulatedEnv, "false")
	if _, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick()); !migclient.IsReason(err, migclient.ReasonSimulatedBackend) {
		t.Fatalf("opt-in false: %v", err)
	}
	t.Setenv(AllowSimulatedEnv, "true")
	m, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick())
	if err != nil {
		t.Fatal(err)
	}
	m.Shutdown()
	t.Setenv(AllowSimulatedEnv, "")
	m, err = Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	m.Shutdown()
}

// TestTheSteadyStateCostsOnePodListPerPassAndTwoSidecarCallsPerAllocate counts what one
// reconcile pass and one single-device Allocate of HAMi's plugin cost with the adapter: API
// actions with client-go's fake clientset, sidecar calls with the fake sidecar.
func TestTheSteadyStateCostsOnePodListPerPassAndTwoSidecarCallsPerAllocate(t *testing.T) {
	s, socket := fakesidecar.Start(t, "GPU-a")
	queued := pod("p", corev1.PodPending, `[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":3,"size":1}}]`)
	cs := node(t, queued)
	m, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	// Warm up: the first pass reads the generation (GetInfo), as a new connection must.
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}

	for pass := range 3 {
		cs.ClearActions()
		s.ResetCalls()
		// GetContainerDeviceStrArray: the reconcile, then one EnsureAllocation; then
		// annotateMigRuntimeInfo, and the CDI name for the response.
		if err := m.ReconcileNodePods(); err != nil {
			t.Fatal(err)
		}
		owner := hami.Owner{PodUID: string(queued.UID), PodNamespace: "ns", PodName: "p", ContainerName: "main", ContainerIndex: 1, DeviceIndex: pass}
		at := nvml.GpuInstancePlacement{Start: uint32(pass), Size: 1}
		mig, took, err := m.EnsureAllocation(owner, 0, "1g.10gb", at)
		if err != nil || !took {
			t.Fatal(mig, took, err)
		}
		if info, ok := m.AllocationRuntimeInfo(0, "1g.10gb", at); !ok || info.MigUUID != mig {
			t.Fatalf("runtime info %+v %t", info, ok)
		}
		if name, ok := m.CDIDevice(mig); !ok || name == "" {
			t.Fatalf("CDI device %q %t", name, ok)
		}
		calls, total := s.Calls(), 0
		for _, n := range calls {
			total += n
		}
		if total > 2 || calls["Allocate"] != 1 || calls["SyncActive"] != 1 || calls["GetState"] != 0 || calls["GetInfo"] != 0 {
			t.Fatalf("pass %d: sidecar calls %v, want Allocate 1 and SyncActive 1 only", pass, calls)
		}
		if n := podLists(cs); n != 1 {
			t.Fatalf("pass %d: %d pod LISTs, want HAMi's one (actions %v)", pass, n, cs.Actions())
		}
	}
}

func TestAReleasedPodsInstanceGoesIdleThroughTheCheapPass(t *testing.T) {
	s, socket := fakesidecar.Start(t, "GPU-a")
	running := pod("r", corev1.PodRunning, `[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1}}]`)
	cs := node(t, running)
	m, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	at := nvml.GpuInstancePlacement{Start: 0, Size: 1}
	mig, _, err := m.EnsureAllocation(Owner(&running, "main", 1, 0), 0, "1g.10gb", at)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	if got := s.Instances(); len(got) != 1 || got[0].State.String() != "ACTIVE" {
		t.Fatalf("a live pod's instance: %+v", got)
	}
	if err := cs.CoreV1().Pods("ns").Delete(context.Background(), "r", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.ResetCalls()
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	if got := s.Instances(); len(got) != 1 || got[0].MigUUID != mig || got[0].State.String() != "IDLE" {
		t.Fatalf("after the pod went: %+v", got)
	}
	if calls := s.Calls(); calls["GetInfo"] != 0 || calls["SyncActive"] != 1 {
		t.Fatalf("the pass cost %v", calls)
	}
	if _, ok := m.AllocationRuntimeInfo(0, "1g.10gb", at); ok {
		t.Fatal("an IDLE instance is still reported as realized")
	}
}

// TestPluginRestartsInOneProcessShareOneConnection is HAMi's restart loop: a new plugin, and a
// new manager, per restart, in one process, the old one never shut down.
func TestPluginRestartsInOneProcessShareOneConnection(t *testing.T) {
	s, socket := fakesidecar.Start(t, "GPU-a")
	cs := node(t)
	first, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	goroutines := runtime.NumGoroutine()
	managers := []*hami.Manager{first}
	for range 20 {
		m, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
		if err != nil {
			t.Fatal(err)
		}
		if err := m.ReconcileNodePods(); err != nil {
			t.Fatal(err)
		}
		managers = append(managers, m)
	}
	if n := s.OpenConns(); n != 1 {
		t.Fatalf("%d connections open after 21 Dials, want 1", n)
	}
	if n := runtime.NumGoroutine(); n > goroutines+2 {
		t.Fatalf("goroutines grew from %d to %d over 20 restarts", goroutines, n)
	}
	for _, m := range managers {
		m.Shutdown()
	}
	for s.OpenConns() != 0 { // the server sees the close when the client's goes; the test's deadline bounds this
		time.Sleep(10 * time.Millisecond)
	}
}

// TestARuntimeIdentityAnotherAdapterReleasedIsNotReportedAfterTheNextPass: an older plugin's
// adapter in the same process keeps reconciling and idles an instance the new one allocated; the
// new one's next pass drops what no live pod's annotation names, so annotateMigRuntimeInfo never
// writes a released instance into the next pod's reservation.
func TestARuntimeIdentityAnotherAdapterReleasedIsNotReportedAfterTheNextPass(t *testing.T) {
	s, socket := fakesidecar.Start(t, "GPU-a")
	cs := node(t)
	old, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	defer old.Shutdown()
	m, err := Dial(context.Background(), socket, cs.CoreV1().Pods(""), "node-1", quick(), AllowSimulatedBackend())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Shutdown()
	kept, gone := nvml.GpuInstancePlacement{Start: 0, Size: 1}, nvml.GpuInstancePlacement{Start: 1, Size: 1}
	a := pod("a", corev1.PodRunning, "")
	b := pod("b", corev1.PodRunning, "")
	migB, _, err := m.EnsureAllocation(Owner(&b, "main", 1, 0), 0, "1g.10gb", kept)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.EnsureAllocation(Owner(&a, "main", 1, 0), 0, "1g.10gb", gone); err != nil {
		t.Fatal(err)
	}
	b.Annotations[annotation.Key] = `[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":0,"size":1},"migUUID":"` + migB + `","gpuInstanceID":1,"computeInstanceID":0}]`
	b.Spec.NodeName = "node-1"
	if _, err := cs.CoreV1().Pods("ns").Create(context.Background(), &b, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := old.ReconcileNodePods(); err != nil { // pod a is not listed: the old adapter idles its instance
		t.Fatal(err)
	}
	if err := m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	if _, ok := m.AllocationRuntimeInfo(0, "1g.10gb", gone); ok {
		t.Fatal("an instance another adapter released is still reported as realized")
	}
	s.ResetCalls()
	if info, ok := m.AllocationRuntimeInfo(0, "1g.10gb", kept); !ok || info.MigUUID != migB {
		t.Fatalf("pod b's instance: %+v %t", info, ok)
	}
	if calls := s.Calls(); calls["GetState"] != 0 {
		t.Fatalf("pod b's runtime identity was read with %v", calls)
	}
}
