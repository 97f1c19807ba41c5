package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakekubelet"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
)

func TestMain(m *testing.M) { os.Exit(kubeapi.Main(m)) }

func TestWithoutANodeNameTheCommandRefusesToStart(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	if err := run(context.Background(), []string{"--socket", "/nonexistent"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--node-name") {
		t.Fatalf("run without a node: %v", err)
	}
}

// A sidecar on the simulated backend is refused, and the refusal names the flag an operator sets,
// not the Go field behind it.
func TestASimulatedSidecarIsRefusedNamingTheFlag(t *testing.T) {
	s := kubeapi.Get(t)
	fake, socket := fakesidecar.Start(t, "GPU-a")
	fake.Unrecover()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := run(ctx, []string{"--node-name", "node-sim", "--socket", socket, "--kubeconfig", s.Kubeconfig(t, kubeapi.AdminUser),
		"--registry-dir", dir, "--plugin-dir", filepath.Join(dir, "plugin"), "--recover-sidecar"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "set --allow-simulated-backend only for tests and demos") ||
		strings.Contains(err.Error(), "Options.") {
		t.Fatalf("run against a simulated sidecar without the flag: %v", err)
	}
}

// The command's flags reach the plugin: only the GPU and profile named are published, the plugin
// registers with kubelet in the directories given, and it stops cleanly with its context.
func TestTheCommandServesTheGPUsAndProfilesItIsGiven(t *testing.T) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	if _, err := admin.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-c"}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	fake, socket := fakesidecar.Start(t, "GPU-a", "GPU-b")
	fake.Unrecover() // the plugin is the sidecar's only client here: --recover-sidecar
	dir, err := os.MkdirTemp("", "dra")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	registry := filepath.Join(dir, "reg")
	if err := os.Mkdir(registry, 0o750); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--node-name", "node-c", "--socket", socket, "--kubeconfig", s.Kubeconfig(t, kubeapi.AdminUser),
			"--registry-dir", registry, "--plugin-dir", filepath.Join(dir, "plugin"), "--gpus", "GPU-b",
			"--profiles", "2g.20gb", "--recover-sidecar", "--allow-simulated-backend"}, io.Discard)
	}()
	node := &fakekubelet.Node{Name: "node-c", Admin: admin}
	devices := node.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) == 3 })
	for _, d := range devices {
		if !strings.HasPrefix(d.Name, "gpu1-2g-20gb-at") || *d.Attributes[dra.AttrGPUUUID].StringValue != "GPU-b" {
			t.Fatalf("published %s of %s", d.Name, *d.Attributes[dra.AttrGPUUUID].StringValue)
		}
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(registry, dra.DefaultDriverName+"-reg.sock")); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
	kubelet := fakekubelet.Register(ctx, t, registry, dra.DefaultDriverName)
	if !strings.HasPrefix(kubelet.Info.GetEndpoint(), filepath.Join(dir, "plugin")) {
		t.Fatalf("the plugin serves at %s", kubelet.Info.GetEndpoint())
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after its context ended: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("run did not return after its context ended")
	}
}
