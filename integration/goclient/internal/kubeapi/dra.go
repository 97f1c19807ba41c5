package kubeapi

import (
	"context"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// What the tests of Dynamic Resource Allocation do with the server and its scheduler (the package
// documentation says why each step is needed when nothing but the two runs).

// Settle is how long a test waits for the scheduler to bind a pod, on a loaded machine.
const Settle = 2 * time.Minute

// ReadyNode writes the status of node name that kubelet would (Ready, room for pods) and lifts the
// not-ready taint admission gave it, so the scheduler places pods there.
func ReadyNode(ctx context.Context, t testing.TB, client kubernetes.Interface, name string) {
	t.Helper()
	node, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Status.Allocatable = corev1.ResourceList{corev1.ResourcePods: resource.MustParse("110"),
		corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("64Gi")}
	node.Status.Capacity = node.Status.Allocatable
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}
	if node, err = client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The API server's admission taints a new node not-ready; the node lifecycle controller, which
	// does not run here, would lift it once the node reports Ready.
	node.Spec.Taints = nil
	if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// DeviceClass creates DeviceClass name selecting every device of driver, unless it exists.
func DeviceClass(ctx context.Context, t testing.TB, client kubernetes.Interface, name, driver string) {
	t.Helper()
	class := &resourcev1.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{
			{CEL: &resourcev1.CELDeviceSelector{Expression: `device.driver == "` + driver + `"`}}}}}
	if _, err := client.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}

// PodWithClaim creates a ResourceClaim with request and a pod using it, neither bound nor allocated:
// the scheduler does both. A ResourceClaimTemplate would need kube-controller-manager, which does not
// run here, to create the pod's claim. The pod is deleted at the test's end.
func PodWithClaim(t testing.TB, client kubernetes.Interface, ns, name string, request resourcev1.DeviceRequest) {
	t.Helper()
	ctx := context.Background()
	claim := &resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{request}}}}
	if _, err := client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PodSpec{
		ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &name}},
		Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/main",
			Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}},
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")}}}}}}
	if _, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// No kubelet deletes a bound pod once it is marked deleted, so it is deleted at once.
	t.Cleanup(func() {
		_ = client.CoreV1().Pods(ns).Delete(ctx, name, *metav1.NewDeleteOptions(0))
	})
}

// Bound waits (up to Settle) for the scheduler to bind pod ns/name (of PodWithClaim) to node and
// returns its claim, allocated and reserved for the pod.
func (s *Server) Bound(t testing.TB, ns, name, node string) *resourcev1.ResourceClaim {
	t.Helper()
	admin := s.Client(t, AdminUser)
	ctx := context.Background()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, Settle, true, func(ctx context.Context) (bool, error) {
		var err error
		pod, err = admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && pod.Spec.NodeName != "", err
	})
	if err != nil {
		t.Fatalf("pod %s not scheduled: %v (status %+v); the scheduler's log ends:\n%s", name, err, pod.Status.Conditions, s.LogTail("kube-scheduler"))
	}
	if pod.Spec.NodeName != node {
		t.Fatalf("pod %s bound to %s, want %s", name, pod.Spec.NodeName, node)
	}
	claim, err := admin.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if claim.Status.Allocation == nil || !slices.ContainsFunc(claim.Status.ReservedFor,
		func(r resourcev1.ResourceClaimConsumerReference) bool { return r.UID == pod.UID }) {
		t.Fatalf("pod %s bound but its claim is not allocated and reserved for it: %+v", name, claim.Status)
	}
	return claim
}

// Unschedulable waits (up to Settle) for the scheduler to report pod ns/name (of PodWithClaim) as
// not fitting anywhere, and checks that it is unbound and Pending and its claim holds nothing.
func Unschedulable(t testing.TB, admin kubernetes.Interface, ns, name string) {
	t.Helper()
	ctx := context.Background()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, Settle, true, func(ctx context.Context) (bool, error) {
		var err error
		pod, err = admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && slices.ContainsFunc(pod.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable
		}), err
	})
	if err != nil {
		t.Fatalf("pod %s never reported unschedulable: %v (status %+v)", name, err, pod.Status)
	}
	if pod.Spec.NodeName != "" || pod.Status.Phase != corev1.PodPending {
		t.Fatalf("pod %s: node %q, phase %s; want unbound and Pending", name, pod.Spec.NodeName, pod.Status.Phase)
	}
	claim, err := admin.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if claim.Status.Allocation != nil {
		t.Fatalf("claim of unschedulable pod %s is allocated: %+v", name, claim.Status.Allocation)
	}
}
