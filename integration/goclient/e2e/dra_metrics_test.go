package e2e

import (
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/scrape"
)

// sample is the value of family's series with exactly labels; -1 when there is none.
func sample(families map[string]*dto.MetricFamily, family string, labels map[string]string) float64 {
	if v, ok := scrape.Value(families, family, labels); ok {
		return v
	}
	return -1
}

// The DRA plugin's metrics, served as the command serves them, count what the sidecar did for the
// claims the kubelet prepared: a create, a warm reuse of the instance the first claim's unprepare
// left IDLE, a claim refused PLACEMENT_BUSY by the sidecar because the reused instance is held,
// and the unprepare; the published devices are the node's slices.
func TestTheDRAPluginsMetricsCountTheSidecarsAnswersToRealPrepares(t *testing.T) {
	ctx, _, _, gpus := setup(t)
	reg, metrics, err := dra.NewRegistry()
	if err != nil {
		t.Fatal(err)
	}
	address, err := dra.ServeMetrics(ctx, "127.0.0.1:0", reg, func(err error) { t.Error(err) })
	if err != nil {
		t.Fatal(err)
	}
	node := draNode(ctx, t, "node-m", gpus[0], dra.Options{Metrics: metrics, Profiles: []string{"1g.10gb"}})
	pool, device := dra.PoolName("node-m"), dra.DeviceName(gpus[0].Index, "1g.10gb", 0)

	a := node.Claim(ctx, t, "default", "metrics-a", [2]string{pool, device})
	created := prepared(ctx, t, node, a)
	if err := node.Unprepare(ctx, a); err != nil {
		t.Fatal(err)
	}
	b := node.Claim(ctx, t, "default", "metrics-b", [2]string{pool, device})
	if reused := prepared(ctx, t, node, b); reused != created {
		t.Fatalf("claim b got %s, not the IDLE %s claim a left", reused, created)
	}
	busy := node.Claim(ctx, t, "default", "metrics-busy", [2]string{pool, device})
	if resp, err := node.Prepare(ctx, busy); err != nil || !strings.Contains(resp.GetError(), "PLACEMENT_BUSY") {
		t.Fatalf("a claim on the placement claim b holds: %+v %v", resp, err)
	}

	families := scrape.Page(ctx, t, address)
	for _, w := range []struct {
		family string
		labels map[string]string
		value  float64
	}{
		{dra.MetricPrepares, map[string]string{"result": "success", "reason": ""}, 2},
		{dra.MetricPrepares, map[string]string{"result": "failure", "reason": "PLACEMENT_BUSY"}, 1},
		{dra.MetricPrepareDuration, map[string]string{"result": "success"}, 2},
		{dra.MetricPrepareDuration, map[string]string{"result": "failure"}, 1},
		{dra.MetricPreparedDevices, map[string]string{"warm": "true"}, 1},
		{dra.MetricPreparedDevices, map[string]string{"warm": "false"}, 1},
		{dra.MetricUnprepares, map[string]string{"result": "success", "reason": ""}, 1},
		{dra.MetricPreparesInFlight, map[string]string{}, 0},
	} {
		if got := sample(families, w.family, w.labels); got != w.value {
			t.Errorf("%s%v = %v, want %v", w.family, w.labels, got, w.value)
		}
	}
	published := node.Devices(ctx, t, func([]resourceapi.Device) bool { return true })
	if got := sample(families, dra.MetricPublishedDevices, map[string]string{"warm": "true"}) +
		sample(families, dra.MetricPublishedDevices, map[string]string{"warm": "false"}); int(got) != len(published) {
		t.Errorf("published devices %v, the node's slices hold %d", got, len(published))
	}
	if got := sample(families, dra.MetricSlicePublishes, map[string]string{}); got < 1 {
		t.Errorf("%s = %v after the slices were published", dra.MetricSlicePublishes, got)
	}
}
