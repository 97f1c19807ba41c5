package kubeapi_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami/kube"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

func TestMain(m *testing.M) { os.Exit(kubeapi.Main(m)) }

// A namespace per test keeps the tests of one server apart; the node is per test too.
func namespace(t *testing.T, admin kubernetes.Interface) string {
	t.Helper()
	name := strings.ToLower(strings.NewReplacer("_", "-", "/", "-").Replace(t.Name()))
	if len(name) > 50 { // a name is at most 63 characters: a prefix, and a hash of the whole
		name = fmt.Sprintf("%s-%08x", strings.Trim(name[:40], "-"), crc32.ChecksumIEEE([]byte(name)))
	}
	ctx := context.Background()
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
		Annotations: map[string]string{"hami.io/node-nvidia-register": "[...]"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return name
}

// grant binds the plugin's ServiceAccount to a ClusterRole with rules, as a chart would.
func grant(t *testing.T, admin kubernetes.Interface, name string, rules []rbacv1.PolicyRule) {
	t.Helper()
	ctx := context.Background()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: kubeapi.PluginAccount, Namespace: kubeapi.PluginNamespace}}}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = admin.RbacV1().ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{})
		_ = admin.RbacV1().ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{})
	})
}

// adapterRules are the requests the adapter and the publisher make, and nothing else: the pod LIST of
// a reconcile pass, the runtime-identity patch of an Allocate, the idle annotation's node patch.
var adapterRules = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"list", "patch"}},
	{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"patch"}},
}

// scheduled creates a pod on node the way HAMi's scheduler leaves it: bound, its reservation (one
// device of container "main", not yet allocated) in the annotation.
func scheduled(t *testing.T, admin kubernetes.Interface, ns, node, name string, placement annotation.Placement) *corev1.Pod {
	t.Helper()
	value, err := annotation.Encode([]annotation.Allocation{{ContainerIndex: 0, DeviceIndex: 0, GPUUUID: "GPU-a",
		Profile: "1g.10gb", Placement: &placement}})
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Annotations: map[string]string{annotation.Key: value}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "main", Image: "busybox"}}}}
	created, err := admin.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return created
}

// plugin is the part of HAMi's device plugin these tests play, over one clientset: the adapter
// (kube.Dial), the publisher (kube.PatchIdle) and Allocate's annotateMigRuntimeInfo, which merges the
// runtime identity into the pod's annotation with a merge patch of that one key.
type plugin struct {
	cs        kubernetes.Interface
	node      string
	m         *hami.Manager
	publisher *hami.Publisher
}

func dial(t *testing.T, cs kubernetes.Interface, node string) *plugin {
	t.Helper()
	_, socket := fakesidecar.Start(t, "GPU-a")
	m, err := kube.Dial(context.Background(), socket, cs.CoreV1().Pods(""), node, kube.AllowSimulatedBackend(),
		kube.WithClientOptions(migclient.Options{CallTimeout: 10 * time.Second, AllocateTimeout: 10 * time.Second, MaxAttempts: 3}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Shutdown)
	return &plugin{cs: cs, node: node, m: m, publisher: hami.NewPublisher(m.Client(), kube.PatchIdle(cs.CoreV1().Nodes(), node))}
}

// granted is the setting of a test of the plugin's writes: the server, its admin client, a
// namespace (also the node's name) where the plugin's user holds the adapter's rules, and the plugin
// dialled as that user.
func granted(t *testing.T) (*kubeapi.Server, kubernetes.Interface, string, *plugin) {
	t.Helper()
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	ns := namespace(t, admin)
	grant(t, admin, ns, adapterRules)
	return s, admin, ns, dial(t, s.Client(t, kubeapi.PluginUser), ns)
}

// start is one pod start as HAMi's Allocate does it with the adapter (the reconcile pass, one
// EnsureAllocation, the runtime-identity patch), then the publisher's pass.
func (p *plugin) start(ctx context.Context, pod *corev1.Pod) error {
	if err := p.m.ReconcileNodePods(); err != nil {
		return err
	}
	allocs, err := annotation.Parse(pod.Annotations[annotation.Key])
	if err != nil {
		return err
	}
	a := allocs[0]
	at := nvml.GpuInstancePlacement{Start: a.Placement.Start, Size: a.Placement.Size}
	if _, _, err := p.m.EnsureAllocation(kube.Owner(pod, "main", 0, 0), 0, a.Profile, at); err != nil {
		return err
	}
	info, ok := p.m.AllocationRuntimeInfo(0, a.Profile, at)
	if !ok {
		return errors.New("no runtime info after EnsureAllocation")
	}
	if err := p.annotate(ctx, pod, allocs, info); err != nil {
		return err
	}
	_, err = p.publisher.Publish(ctx)
	return err
}

func (p *plugin) annotate(ctx context.Context, pod *corev1.Pod, allocs []annotation.Allocation, info hami.RuntimeInfo) error {
	patched, err := annotation.WithRuntimeIdentity(allocs, 0, []annotation.Identity{{DeviceIndex: 0, MigUUID: info.MigUUID,
		GPUInstanceID: info.GIID, ComputeInstanceID: info.CIID}})
	if err != nil {
		return err
	}
	value, err := annotation.Encode(patched)
	if err != nil {
		return err
	}
	return p.patchPod(ctx, pod, value)
}

func (p *plugin) patchPod(ctx context.Context, pod *corev1.Pod, value string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{annotation.Key: value}}})
	if err != nil {
		return err
	}
	_, err = p.cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// stop is what the plugin does after a pod went: the next reconcile pass and the publisher's pass.
func (p *plugin) stop(ctx context.Context) error {
	if err := p.m.ReconcileNodePods(); err != nil {
		return err
	}
	_, err := p.publisher.Publish(ctx)
	return err
}

func idle(t *testing.T, cs kubernetes.Interface, node string) map[string][]register.IdleInstance {
	t.Helper()
	n, err := cs.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Annotations["hami.io/node-nvidia-register"] != "[...]" {
		t.Fatalf("the node's other annotations changed: %v", n.Annotations)
	}
	out := map[string][]register.IdleInstance{}
	if err := json.Unmarshal([]byte(n.Annotations[register.IdleKey]), &out); err != nil {
		t.Fatalf("%s: %v", register.IdleKey, err)
	}
	return out
}

// fakeWrites counts the write actions client-go's fake clientset recorded, by "verb resource".
func fakeWrites(cs *fake.Clientset) map[string]int {
	out := map[string]int{}
	for _, a := range cs.Actions() {
		switch a.GetVerb() {
		case "create", "update", "patch", "delete":
			out[a.GetVerb()+" "+a.GetResource().Resource]++
		}
	}
	return out
}

// TestAPodStartAndStopCostTheWritesTheAuditLogCounts: the API writes of the plugin's ServiceAccount
// per pod start and stop, from the API server's own audit log, beside what client-go's fake
// clientset records for the same calls. A start writes the pod's runtime identity once and nothing
// on the node (a new instance is not idle); a start that reuses an idle instance also patches the
// node; a stop writes the node's idle annotation once (the instance went IDLE) and nothing on a pod.
// bench/README.md quotes these counts beside HAMi v2.10's own.
func TestAPodStartAndStopCostTheWritesTheAuditLogCounts(t *testing.T) {
	s, admin, ns, p := granted(t)
	ctx := context.Background()
	if err := p.stop(ctx); err != nil { // the plugin's start: a first pass and the first publish
		t.Fatal(err)
	}

	fakeCS := fake.NewClientset()
	if _, err := fakeCS.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	fp := dial(t, fakeCS, ns)
	if err := fp.stop(ctx); err != nil {
		t.Fatal(err)
	}

	pods := map[string]*corev1.Pod{}
	steps := []struct {
		what, pod string
		start     bool
		want      map[string]int
	}{
		{"a pod starts on a new instance", "a", true, map[string]int{"patch pods": 1}},
		{"the pod stops; its instance goes idle", "a", false, map[string]int{"patch nodes": 1}},
		{"a pod starts on the idle instance", "b", true, map[string]int{"patch pods": 1, "patch nodes": 1}},
		{"the pod stops", "b", false, map[string]int{"patch nodes": 1}},
	}
	for _, st := range steps {
		mark := s.Mark(t)
		fakeCS.ClearActions()
		if st.start {
			pods[st.pod] = scheduled(t, admin, ns, ns, st.pod, annotation.Placement{Start: 0, Size: 1})
			fakePod := pods[st.pod].DeepCopy()
			fakePod.ResourceVersion = ""
			if _, err := fakeCS.CoreV1().Pods(ns).Create(ctx, fakePod, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			fakeCS.ClearActions()
			if err := p.start(ctx, pods[st.pod]); err != nil {
				t.Fatalf("%s: %v", st.what, err)
			}
			if err := fp.start(ctx, fakePod); err != nil {
				t.Fatalf("%s (fake clientset): %v", st.what, err)
			}
		} else {
			// The default grace period: with no kubelet the pod stays, its deletionTimestamp set,
			// which the adapter reads as released, as HAMi does.
			if err := admin.CoreV1().Pods(ns).Delete(ctx, st.pod, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := fakeCS.CoreV1().Pods(ns).Delete(ctx, st.pod, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			fakeCS.ClearActions()
			if err := p.stop(ctx); err != nil {
				t.Fatalf("%s: %v", st.what, err)
			}
			if err := fp.stop(ctx); err != nil {
				t.Fatal(err)
			}
		}
		events := mark.Events(t, kubeapi.PluginUser)
		got := kubeapi.Writes(events)
		t.Logf("%s: API writes %v (audit log), %v (fake clientset); every request %v", st.what, got, fakeWrites(fakeCS), keys(events))
		if !maps.Equal(got, st.want) {
			t.Errorf("%s: the audit log shows writes %v, want %v", st.what, got, st.want)
		}
		if f := fakeWrites(fakeCS); !maps.Equal(f, st.want) {
			t.Errorf("%s: the fake clientset recorded writes %v, want %v", st.what, f, st.want)
		}
		for _, e := range events {
			if e.ResponseStatus == nil || e.ResponseStatus.Code >= 300 {
				t.Errorf("%s: %s was refused: %+v", st.what, e.Key(), e.ResponseStatus)
			}
		}
	}

	// What the server holds: pod b's annotation has its runtime identity, the node lists the idle
	// instance, and HAMi's own node annotation is as it was.
	got, err := admin.CoreV1().Pods(ns).Get(ctx, "b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	allocs, err := annotation.Parse(got.Annotations[annotation.Key])
	if err != nil || len(allocs) != 1 || !allocs[0].HasRuntimeIdentity() {
		t.Fatalf("pod b's annotation %q: %v", got.Annotations[annotation.Key], err)
	}
	if inv := idle(t, admin, ns); len(inv["GPU-a"]) != 1 || inv["GPU-a"][0].MigUUID != allocs[0].MigUUID {
		t.Fatalf("the node's idle inventory %v, want pod b's instance %s", inv, allocs[0].MigUUID)
	}
}

func keys(events []kubeapi.Event) []string {
	out := make([]string, 0, len(events))
	for _, e := range events {
		out = append(out, e.Key())
	}
	return out
}

// TestThePublisherWritesTheNodeOnlyWhenTheInventoryChanges: passes over an unchanged inventory cost
// no write; a change costs one node patch however many passes follow.
func TestThePublisherWritesTheNodeOnlyWhenTheInventoryChanges(t *testing.T) {
	s, admin, ns, p := granted(t)
	ctx := context.Background()
	pod := scheduled(t, admin, ns, ns, "a", annotation.Placement{Start: 2, Size: 1})
	if err := p.start(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if err := admin.CoreV1().Pods(ns).Delete(ctx, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	mark := s.Mark(t)
	if err := p.m.ReconcileNodePods(); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if _, err := p.publisher.Publish(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := kubeapi.Writes(mark.Events(t, kubeapi.PluginUser)); !maps.Equal(got, map[string]int{"patch nodes": 1}) {
		t.Fatalf("one change, five passes: writes %v, want one node patch", got)
	}
	if inv := idle(t, admin, ns); len(inv["GPU-a"]) != 1 {
		t.Fatalf("idle inventory %v", inv)
	}
}

// TestTheServerRefusesAnOversizedAnnotationAndThePodKeepsItsOwn: the API server refuses annotations
// over 256 KiB in all (422), which client-go's fake clientset accepts; the pod keeps the annotation
// it had, so the next reconcile pass still sees its reservation.
func TestTheServerRefusesAnOversizedAnnotationAndThePodKeepsItsOwn(t *testing.T) {
	_, admin, ns, p := granted(t)
	ctx := context.Background()
	pod := scheduled(t, admin, ns, ns, "a", annotation.Placement{Start: 0, Size: 1})
	before := pod.Annotations[annotation.Key]
	oversized := strings.Repeat("x", 256*1024+1)
	err := p.patchPod(ctx, pod, oversized)
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "262144 bytes") {
		t.Fatalf("an oversized annotation: %v, want 422 Invalid naming the limit", err)
	}
	got, err := admin.CoreV1().Pods(ns).Get(ctx, "a", metav1.GetOptions{})
	if err != nil || got.Annotations[annotation.Key] != before {
		t.Fatalf("the pod's annotation changed: %v", err)
	}
	active, err := kube.NodeAllocations(admin.CoreV1().Pods(""), ns)(ctx)
	if err != nil || len(active) != 1 || active[0].GetPod().GetName() != "a" {
		t.Fatalf("the reservation after the refused patch: %v %v", active, err)
	}

	fakeCS := fake.NewClientset(got.DeepCopy())
	fp := &plugin{cs: fakeCS}
	if err := fp.patchPod(ctx, got, oversized); err != nil {
		t.Fatalf("the fake clientset refused it too (then this test shows nothing): %v", err)
	}
}

// TestTheFieldSelectorListsOnlyTheNodesPods: the reconcile pass's spec.nodeName selector, which the
// server evaluates (the fake clientset ignores field selectors and returns every pod).
func TestTheFieldSelectorListsOnlyTheNodesPods(t *testing.T) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	ns := namespace(t, admin)
	ctx := context.Background()
	scheduled(t, admin, ns, ns, "here", annotation.Placement{Start: 0, Size: 1})
	scheduled(t, admin, ns, "elsewhere", "there", annotation.Placement{Start: 1, Size: 1})
	active, err := kube.NodeAllocations(admin.CoreV1().Pods(""), ns)(ctx)
	if err != nil || len(active) != 1 || active[0].GetPod().GetName() != "here" {
		t.Fatalf("the node's allocations %v %v, want pod here's only", active, err)
	}
}
