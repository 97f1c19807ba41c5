package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
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
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/scrape"
)

// operatorMetric is a metric of the plugin as the operator's files name it.
var operatorMetric = regexp.MustCompile(`\bhami_mig_dra_[a-z0-9_]+\b`)

func freeAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	address := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return address
}

// The command's --metrics-address serves the plugin's metrics, and after prepares and an unprepare
// through the kubelet's own API they count what happened: a claim whose device was created, one
// that reused the IDLE instance the first left (a warm hit), one allocated a device the plugin
// does not publish (a failure), the unprepare, and the node's slices as published, the IDLE
// instance's device warm.
func TestTheCommandServesItsMetricsAfterRealPrepares(t *testing.T) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const node, ns = "node-m", "metrics"
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	fake, socket := fakesidecar.Start(t, "GPU-a")
	fake.Unrecover()
	dir, err := os.MkdirTemp("", "dra") // Unix socket paths are short: not under t.TempDir
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	registry := filepath.Join(dir, "reg")
	if err := os.Mkdir(registry, 0o750); err != nil {
		t.Fatal(err)
	}
	address := freeAddress(t)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--node-name", node, "--socket", socket, "--kubeconfig", s.Kubeconfig(t, kubeapi.AdminUser),
			"--registry-dir", registry, "--plugin-dir", filepath.Join(dir, "plugin"), "--profiles", "1g.10gb",
			"--recover-sidecar", "--allow-simulated-backend", "--metrics-address", address}, io.Discard)
	}()
	n := &fakekubelet.Node{Name: node, Admin: admin}
	devices := n.Devices(ctx, t, func(ds []resourceapi.Device) bool { return len(ds) > 0 })
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(registry, dra.DefaultDriverName+"-reg.sock")); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
	n.Kubelet = fakekubelet.Register(ctx, t, registry, dra.DefaultDriverName)
	pool, device := dra.PoolName(node), devices[0].Name

	a := n.Claim(ctx, t, ns, "a", [2]string{pool, device})
	if resp, err := n.Prepare(ctx, a); err != nil || resp.GetError() != "" {
		t.Fatalf("prepare a: %+v %v", resp, err)
	}
	if err := n.Unprepare(ctx, a); err != nil {
		t.Fatalf("unprepare a: %v", err)
	}
	b := n.Claim(ctx, t, ns, "b", [2]string{pool, device})
	if resp, err := n.Prepare(ctx, b); err != nil || resp.GetError() != "" {
		t.Fatalf("prepare b: %+v %v", resp, err)
	}
	c := n.Claim(ctx, t, ns, "c", [2]string{pool, "gpu0-not-published-at0"})
	if resp, err := n.Prepare(ctx, c); err != nil || !strings.Contains(resp.GetError(), "not one this plugin publishes") {
		t.Fatalf("prepare c: %+v %v", resp, err)
	}

	want := []struct {
		family string
		labels map[string]string
		value  float64
	}{
		{dra.MetricPrepares, map[string]string{"result": "success", "reason": ""}, 2},
		{dra.MetricPrepares, map[string]string{"result": "failure", "reason": "OTHER"}, 1},
		{dra.MetricPrepareDuration, map[string]string{"result": "success"}, 2},
		{dra.MetricPrepareDuration, map[string]string{"result": "failure"}, 1},
		{dra.MetricPreparesInFlight, map[string]string{}, 0},
		{dra.MetricPreparedDevices, map[string]string{"warm": "true"}, 1},
		{dra.MetricPreparedDevices, map[string]string{"warm": "false"}, 1},
		{dra.MetricUnprepares, map[string]string{"result": "success", "reason": ""}, 1},
		{dra.MetricRepublishErrors, map[string]string{"stage": "state"}, 0},
	}
	families := scrape.Page(ctx, t, address)
	for _, w := range want {
		if got, ok := scrape.Value(families, w.family, w.labels); !ok || got != w.value {
			t.Errorf("%s%v = %v (found %v), want %v", w.family, w.labels, got, ok, w.value)
		}
	}
	// The slices were published at start, and again with the device warm while a was unprepared.
	if got, ok := scrape.Value(families, dra.MetricSlicePublishes, map[string]string{}); !ok || got < 1 {
		t.Errorf("%s = %v (found %v), want at least 1", dra.MetricSlicePublishes, got, ok)
	}
	warm, _ := scrape.Value(families, dra.MetricPublishedDevices, map[string]string{"warm": "true"})
	cold, _ := scrape.Value(families, dra.MetricPublishedDevices, map[string]string{"warm": "false"})
	if int(warm+cold) != len(devices) {
		t.Errorf("published devices: %v warm + %v not, want %d in all", warm, cold, len(devices))
	}
	// Every metric of the plugin that the alerts and the dashboard read is one it serves.
	for _, file := range []string{"../../../../deploy/prometheus-rules.yaml", "../../../../deploy/grafana-dashboard.json"} {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		named := operatorMetric.FindAllString(string(text), -1)
		if len(named) == 0 {
			t.Errorf("%s names none of the plugin's metrics", file)
		}
		for _, name := range named {
			family := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_count"), "_sum")
			if _, ok := families[family]; !ok {
				t.Errorf("%s reads %s, which the plugin does not serve", file, name)
			}
		}
	}
	if t.Failed() {
		for name, f := range families {
			if strings.HasPrefix(name, "hami_mig_dra_") {
				t.Log(fmt.Sprint(f))
			}
		}
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
