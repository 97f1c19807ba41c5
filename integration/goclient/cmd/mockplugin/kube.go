package main

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami/kube"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// kubePods is the pod store of --kubeconfig: the pods live in an API server, as they do for the
// plugin. A schedule step creates the pod bound to --node with its annotation, an allocate step reads
// it from the server and merge-patches the runtime identity into the annotation (what HAMi's Allocate
// does), a delete step deletes it (a pod a kubelet has not confirmed keeps a deletionTimestamp, which
// releases it), and every release pass lists the node's pods with the adapter's own list
// (kube.NodeAllocations). After every step the publisher writes the node's idle annotation.
type kubePods struct {
	cs        kubernetes.Interface
	node      string
	publisher *hami.Publisher
}

func openKube(kubeconfig, node string) (*kubePods, error) {
	if node == "" {
		return nil, fmt.Errorf("--kubeconfig needs --node")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &kubePods{cs: cs, node: node}, nil
}

func (k *kubePods) listActive() migclient.ListActiveFunc {
	return kube.NodeAllocations(k.cs.CoreV1().Pods(""), k.node)
}

func (k *kubePods) create(ctx context.Context, sp *storedPod) error {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: sp.Namespace, Name: sp.Name, Annotations: sp.Annotation},
		Spec: corev1.PodSpec{NodeName: k.node}}
	for _, name := range sp.Containers {
		pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{Name: name, Image: "mockplugin"})
	}
	created, err := k.cs.CoreV1().Pods(sp.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	sp.UID = string(created.UID)
	return nil
}

func (k *kubePods) get(ctx context.Context, namespace, name string) (*storedPod, error) {
	pod, err := k.cs.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	sp := &storedPod{UID: string(pod.UID), Namespace: pod.Namespace, Name: pod.Name, Annotation: map[string]string{}}
	for _, c := range pod.Spec.InitContainers {
		sp.Containers = append(sp.Containers, c.Name)
	}
	for _, c := range pod.Spec.Containers {
		sp.Containers = append(sp.Containers, c.Name)
	}
	sp.Annotation[annotation.Key] = pod.Annotations[annotation.Key]
	return sp, nil
}

func (k *kubePods) annotate(ctx context.Context, sp *storedPod) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{annotation.Key: sp.Annotation[annotation.Key]}}})
	if err != nil {
		return err
	}
	_, err = k.cs.CoreV1().Pods(sp.Namespace).Patch(ctx, sp.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

func (k *kubePods) remove(ctx context.Context, namespace, name string) error {
	return k.cs.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{})
}

// publish is the publisher's pass after a step; the first one makes the publisher.
func (k *kubePods) publish(ctx context.Context, c *migclient.Client) error {
	if k.publisher == nil {
		k.publisher = hami.NewPublisher(c, kube.PatchIdle(k.cs.CoreV1().Nodes(), k.node))
	}
	_, err := k.publisher.Publish(ctx)
	return err
}
