package kube

import (
	"context"
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
)

func pod(uid string, phase corev1.PodPhase, value string) corev1.Pod {
	return corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{UID: types.UID("uid-" + uid), Namespace: "ns", Name: uid,
			Annotations: map[string]string{annotation.Key: value}},
		Spec:   corev1.PodSpec{InitContainers: []corev1.Container{{Name: "init"}}, Containers: []corev1.Container{{Name: "main"}}},
		Status: corev1.PodStatus{Phase: phase},
	}
}

const (
	allocated = `[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"MIG-x","gpuInstanceID":9,"computeInstanceID":0}]`
	pending   = `[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-b","profile":"2g.20gb","placement":{"start":0,"size":2}}]`
)

func TestActiveAllocationsKeepsLivePodsPendingOnesIncluded(t *testing.T) {
	gone := pod("gone", corev1.PodRunning, allocated)
	gone.DeletionTimestamp = &metav1.Time{}
	got, err := ActiveAllocations([]corev1.Pod{
		pod("running", corev1.PodRunning, allocated), pod("queued", corev1.PodPending, pending),
		pod("done", corev1.PodSucceeded, allocated), pod("failed", corev1.PodFailed, allocated), gone,
		pod("plain", corev1.PodRunning, ""),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("want the running and the queued pod's allocations, got %v", got)
	}
	run, queue := got[0], got[1]
	if run.GetPod().GetUid() != "uid-running" || run.GetContainerName() != "main" || run.GetMigUuid() != "MIG-x" || run.GetGpuInstanceId() != 9 {
		t.Fatalf("running pod: %v", run)
	}
	if queue.GetContainerName() != "init" || queue.GetMigUuid() != "" || queue.GetPlacement().GetSize() != 2 {
		t.Fatalf("queued pod: %v", queue)
	}
}

func TestAMalformedAnnotationFailsTheWholeList(t *testing.T) {
	_, err := ActiveAllocations([]corev1.Pod{pod("ok", corev1.PodRunning, allocated), pod("bad", corev1.PodRunning, `[{"profile":"1g.10gb"}]`)})
	if !errors.Is(err, annotation.ErrInvalid) {
		t.Fatalf("want ErrInvalid, got %v", err)
	}
}

type lister struct {
	selector string
	pods     []corev1.Pod
	err      error
}

func (l *lister) List(_ context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	l.selector = opts.FieldSelector
	return &corev1.PodList{Items: l.pods}, l.err
}

func TestNodeAllocationsListsTheNodesPodsAndFailsClosed(t *testing.T) {
	l := &lister{pods: []corev1.Pod{pod("running", corev1.PodRunning, allocated)}}
	got, err := NodeAllocations(l, "node-1")(context.Background())
	if err != nil || len(got) != 1 || l.selector != "spec.nodeName=node-1" {
		t.Fatalf("%v %v, selector %q", got, err, l.selector)
	}
	l.err = errors.New("apiserver down")
	if _, err := NodeAllocations(l, "node-1")(context.Background()); err == nil {
		t.Fatal("a failed list was taken for an empty one")
	}
	if _, err := NodeAllocations(l, "")(context.Background()); err == nil {
		t.Fatal("no node name listed every pod")
	}
}

func TestOwnerIsThePendingPodsContainerAndDevice(t *testing.T) {
	p := pod("running", corev1.PodPending, pending)
	o := Owner(&p, "main", 1, 2)
	if o.PodUID != "uid-running" || o.PodNamespace != "ns" || o.PodName != "running" || o.ContainerName != "main" || o.ContainerIndex != 1 || o.DeviceIndex != 2 {
		t.Fatalf("owner %+v", o)
	}
}
