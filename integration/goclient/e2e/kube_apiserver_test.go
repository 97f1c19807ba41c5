// The mock plugin (cmd/mockplugin) with its pods in a real API server (internal/kubeapi): pods
// created there, allocated through the real sidecar, the runtime identity patched into their
// annotation, the node's idle annotation published, a deleted pod released by the next pass.
package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

func TestMain(m *testing.M) { os.Exit(kubeapi.Main(m)) }

const kubeNode = "node-1"

// mockplugin runs the mock plugin's scenario against the sidecar and the API server.
func mockplugin(t *testing.T, kubeconfig, scenario string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "scenario.yaml")
	if err := os.WriteFile(path, []byte(scenario), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(env(t, "MIGSIDECAR_MOCKPLUGIN"), "--socket", env(t, "MIGSIDECAR_SOCKET"), "--scenario", path,
		"--kubeconfig", kubeconfig, "--node", kubeNode, "--allow-simulated-backend")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("mockplugin: %v\n%s", err, out)
	}
	t.Logf("mockplugin:\n%s", out)
}

func migUUID(t *testing.T, cs kubernetes.Interface, name string) (string, *corev1.Pod) {
	t.Helper()
	pod, err := cs.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	allocs, err := annotation.Parse(pod.Annotations[annotation.Key])
	if err != nil || len(allocs) != 1 || !allocs[0].HasRuntimeIdentity() {
		t.Fatalf("pod %s's annotation %q: %v", name, pod.Annotations[annotation.Key], err)
	}
	return allocs[0].MigUUID, pod
}

func idleOnNode(t *testing.T, cs kubernetes.Interface) []string {
	t.Helper()
	node, err := cs.CoreV1().Nodes().Get(context.Background(), kubeNode, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	value, ok := node.Annotations[register.IdleKey]
	if !ok {
		t.Fatalf("the node has no %s", register.IdleKey)
	}
	var idle map[string][]register.IdleInstance
	if err := json.Unmarshal([]byte(value), &idle); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, instances := range idle {
		for _, in := range instances {
			out = append(out, in.MigUUID)
		}
	}
	return out
}

func TestTheMockPluginRunsItsPodsThroughARealAPIServer(t *testing.T) {
	env(t, "MIGSIDECAR_SOCKET")
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	if _, err := admin.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: kubeNode}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubeconfig := s.Kubeconfig(t, kubeapi.AdminUser)

	// Pod a starts on a new instance and goes; the delete step's release pass lists the node's pods
	// from the server, where a has a deletionTimestamp (no kubelet confirms it), and idles its instance.
	mockplugin(t, kubeconfig, `steps:
  - schedule: {pod: a, containers: [{name: main, devices: [{gpu: 0, profile: 1g.10gb, placement: {start: 5, size: 1}}]}]}
  - allocate: {pod: a, container: 0}
    expect: {outcomes: [CREATED]}
  - delete: {pod: a}
    expect: {idled: 1}
`)
	mig, a := migUUID(t, admin, "a")
	if a.DeletionTimestamp == nil || a.Spec.NodeName != kubeNode {
		t.Fatalf("pod a: deletionTimestamp %v, node %q", a.DeletionTimestamp, a.Spec.NodeName)
	}
	if idle := idleOnNode(t, admin); len(idle) != 1 || idle[0] != mig {
		t.Fatalf("the node's idle annotation lists %v, want pod a's %s", idle, mig)
	}

	// Pod b, same reservation, reuses it: its annotation names the instance, the node lists none.
	mockplugin(t, kubeconfig, `steps:
  - schedule: {pod: b, containers: [{name: main, devices: [{gpu: 0, profile: 1g.10gb, placement: {start: 5, size: 1}}]}]}
  - allocate: {pod: b, container: 0}
    expect: {outcomes: [REUSED]}
`)
	if got, _ := migUUID(t, admin, "b"); got != mig {
		t.Fatalf("pod b runs on %s, want the idle %s", got, mig)
	}
	if idle := idleOnNode(t, admin); len(idle) != 0 {
		t.Fatalf("the node's idle annotation lists %v after the reuse", idle)
	}
}
