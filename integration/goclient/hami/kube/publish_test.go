package kube

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/schedule"
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

func TestTheIdleAnnotationIsGoneWhenThePublisherStopsAndRemoveIdleTakesAStaleOneOff(t *testing.T) {
	for _, tc := range []struct {
		name string
		dial func(ctx context.Context, socket string, pods PodLister) (hami.IdlePublisher, error)
	}{
		{name: "v2.10 adapter", dial: func(ctx context.Context, socket string, pods PodLister) (hami.IdlePublisher, error) {
			return Dial(ctx, socket, pods, "node-1", quick(), AllowSimulatedBackend())
		}},
		{name: "lazy adapter", dial: func(ctx context.Context, socket string, pods PodLister) (hami.IdlePublisher, error) {
			return DialLazy(ctx, socket, pods, "node-1", quick(), AllowSimulatedBackend())
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, socket := fakesidecar.Start(t, "GPU-a")
			s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 3, Size: 1, State: pb.InstanceState_IDLE})
			cs := node(t)
			if _, err := cs.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1",
				Annotations: map[string]string{"hami.io/node-nvidia-register": "[...]"}}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			p, err := tc.dial(ctx, socket, cs.CoreV1().Pods(""))
			if err != nil {
				t.Fatal(err)
			}
			annotation := func() (string, bool) {
				n, err := cs.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if n.Annotations["hami.io/node-nvidia-register"] != "[...]" {
					t.Fatalf("HAMi's own annotation changed: %v", n.Annotations)
				}
				v, ok := n.Annotations[register.IdleKey]
				return v, ok
			}
			stopped := make(chan struct{})
			go func() {
				defer close(stopped)
				p.PublishIdle(ctx, PatchIdle(cs.CoreV1().Nodes(), "node-1"), func(err error) { t.Error(err) })
			}()
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if v, ok := annotation(); ok {
					idle, err := schedule.DecodeIdle(v)
					if err != nil || len(idle["GPU-a"]) != 1 {
						t.Fatalf("published %q: %v", v, err)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("nothing published")
				}
			}
			cancel()
			<-stopped
			if v, ok := annotation(); ok {
				t.Fatalf("the stopped publisher left %s=%q", register.IdleKey, v)
			}

			// A stale one (a publisher killed before it could remove it) is taken off by RemoveIdle,
			// and removing what is not there is no error.
			if err := PatchIdle(cs.CoreV1().Nodes(), "node-1")(context.Background(), "{}"); err != nil {
				t.Fatal(err)
			}
			for range 2 {
				if err := RemoveIdle(context.Background(), cs.CoreV1().Nodes(), "node-1"); err != nil {
					t.Fatal(err)
				}
				if v, ok := annotation(); ok {
					t.Fatalf("RemoveIdle left %q", v)
				}
			}
		})
	}
}
