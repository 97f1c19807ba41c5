package kube

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// NodePatcher is the Patch of a client-go NodeInterface: HAMi passes
// client.GetClient().CoreV1().Nodes().
type NodePatcher interface {
	Patch(ctx context.Context, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions,
		subresources ...string) (*corev1.Node, error)
}

// PatchIdle is the hami.PatchFunc that writes the idle inventory annotation (register.IdleKey) on
// nodeName with a merge patch of that one key, as HAMi's util.PatchNodeAnnotations writes its own:
// every other annotation of the node is left as it is. The value "" removes the key.
func PatchIdle(nodes NodePatcher, nodeName string) hami.PatchFunc {
	return func(ctx context.Context, value string) error {
		if nodeName == "" {
			return fmt.Errorf("no node name to annotate")
		}
		var v any = value
		if value == "" {
			v = nil // a merge patch's null removes the key
		}
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
			"annotations": map[string]any{register.IdleKey: v}}})
		if err != nil {
			return err
		}
		_, err = nodes.Patch(ctx, nodeName, types.MergePatchType, patch, metav1.PatchOptions{})
		return err
	}
}

// RemoveIdle takes the idle inventory annotation off nodeName (nothing when it is not there). HAMi
// calls it when the plugin starts without the sidecar, so that a node switched back to the
// in-process manager keeps no inventory a stopped publisher left behind (a publisher that stops
// removes it itself, but a plugin killed or rolled out is not given the chance).
func RemoveIdle(ctx context.Context, nodes NodePatcher, nodeName string) error {
	return PatchIdle(nodes, nodeName)(ctx, "")
}
