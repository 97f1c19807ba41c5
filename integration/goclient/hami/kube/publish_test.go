package kube

import (
	"context"
	"encoding/json"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// nodes keeps one node's annotations as a merge patch leaves them.
type nodes struct{ annotations map[string]string }

func (n *nodes) Patch(_ context.Context, name string, pt types.PatchType, data []byte, _ metav1.PatchOptions,
	_ ...string) (*corev1.Node, error) {
	if pt != types.MergePatchType || name != "node-1" {
		return nil, &json.UnsupportedValueError{Str: string(pt) + " " + name}
	}
	var patch struct {
		Metadata struct {
			Annotations map[string]string `json:"annotations"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(data, &patch); err != nil {
		return nil, err
	}
	for k, v := range patch.Metadata.Annotations {
		n.annotations[k] = v
	}
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: n.annotations}}, nil
}

func TestPatchIdleWritesTheOneKeyAndLeavesHAMisAnnotations(t *testing.T) {
	n := &nodes{annotations: map[string]string{"hami.io/node-nvidia-register": "[...]"}}
	value := `{"GPU-a":[{"profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"MIG-x"}]}`
	if err := PatchIdle(n, "node-1")(context.Background(), value); err != nil {
		t.Fatal(err)
	}
	if n.annotations[register.IdleKey] != value || n.annotations["hami.io/node-nvidia-register"] != "[...]" || len(n.annotations) != 2 {
		t.Fatalf("node annotations %v", n.annotations)
	}
	if err := PatchIdle(n, "")(context.Background(), "{}"); err == nil || n.annotations[register.IdleKey] != value {
		t.Fatalf("no node name: %v, annotations %v", err, n.annotations)
	}
}
