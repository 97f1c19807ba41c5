// Package kube builds what the hami adapter needs from HAMi's Kubernetes objects: the owner of
// an allocation from the pending pod, and the sidecar's active allocations from the node's pod
// list (annotation hami.io/vgpu-mig-allocations). It is the only package of this module that
// imports Kubernetes types, so the client and the adapter do not.
package kube

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// Owner is the owner of one reservation as GetContainerDeviceStrArray knows it: the pending
// pod, the container's name and index (init containers first) and the reservation's device
// index.
func Owner(pod *corev1.Pod, containerName string, containerIndex, deviceIndex int) hami.Owner {
	return hami.Owner{PodUID: string(pod.UID), PodNamespace: pod.Namespace, PodName: pod.Name,
		ContainerName: containerName, ContainerIndex: containerIndex, DeviceIndex: deviceIndex}
}

// Released reports whether a pod no longer holds its reservations, by HAMi's rule: it is being
// deleted, or it has finished. A pod absent from the list holds none either.
func Released(pod *corev1.Pod) bool {
	return pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// ActiveAllocations converts the pods' hami.io/vgpu-mig-allocations annotations into the
// sidecar's active allocations: every reservation of every pod not Released, the pending ones
// (scheduled, not allocated yet: no runtime identity) included, since they guard their
// placement. A malformed annotation fails the whole list: the sidecar reads an allocation
// missing from it as released.
func ActiveAllocations(pods []corev1.Pod) ([]*pb.ActiveAllocation, error) {
	var out []*pb.ActiveAllocation
	for i := range pods {
		pod := &pods[i]
		if Released(pod) {
			continue
		}
		allocs, err := annotation.Parse(pod.Annotations[annotation.Key])
		if err != nil {
			return nil, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
		if len(allocs) == 0 {
			continue
		}
		names := make([]string, 0, len(pod.Spec.InitContainers)+len(pod.Spec.Containers))
		for _, c := range pod.Spec.InitContainers {
			names = append(names, c.Name)
		}
		for _, c := range pod.Spec.Containers {
			names = append(names, c.Name)
		}
		active, err := annotation.Pod{UID: string(pod.UID), Namespace: pod.Namespace, Name: pod.Name,
			ContainerNames: names, Allocations: allocs}.ActiveAllocations(true)
		if err != nil {
			return nil, err
		}
		out = append(out, active...)
	}
	return out, nil
}

// PodLister is the List of a client-go PodInterface: HAMi passes
// client.GetClient().CoreV1().Pods("").
type PodLister interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
}

// NodeAllocations is the ListActive callback over a fresh list of the node's pods, read from
// the API server (not a cache), as HAMi's reconciler lists them.
func NodeAllocations(pods PodLister, nodeName string) migclient.ListActiveFunc {
	return func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		if nodeName == "" {
			return nil, fmt.Errorf("no node name to list the pods of")
		}
		list, err := pods.List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName})
		if err != nil {
			return nil, err
		}
		return ActiveAllocations(list.Items)
	}
}

// Dial is the sidecar adapter for HAMi v2.10's plugin, its pod list that of nodeName, with the
// client's defaults otherwise.
func Dial(ctx context.Context, socket string, pods PodLister, nodeName string) (*hami.Manager, error) {
	return hami.Dial(ctx, socket, migclient.Options{ListActive: NodeAllocations(pods, nodeName)})
}

// DialLazy is Dial for the lazy-lifecycle method set.
func DialLazy(ctx context.Context, socket string, pods PodLister, nodeName string) (*hami.Lazy, error) {
	return hami.DialLazy(ctx, socket, migclient.Options{ListActive: NodeAllocations(pods, nodeName)})
}
