package dra_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// gathered is the value of the series of family whose labels include want; -1 when there is none.
func gathered(t *testing.T, reg prometheus.Gatherer, family string, want map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != family {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			match := true
			for k, v := range want {
				match = match && labels[k] == v
			}
			if !match {
				continue
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

// Republishing counts what the API server refused and what it took: a publish that fails counts
// as a republish error of stage publish (tried again at the next refresh), the one that succeeds
// as a publish with the node's devices; the helper's own write failures, which it reports as
// recoverable through HandleError, count as publish errors too, its fatal ones do not.
func TestRepublishingCountsRefusedAndTakenPublishes(t *testing.T) {
	s := kubeapi.Get(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, socket := fakesidecar.Start(t, "GPU-a")
	c, err := migclient.New(ctx, socket, migclient.Options{CallTimeout: 5 * time.Second, AllowSimulatedBackend: true,
		ListActive: dra.RecoverNoPods})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	reg := prometheus.NewRegistry()
	metrics, err := dra.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dra.New(c, s.Client(t, kubeapi.AdminUser), dra.Options{NodeName: "node-r", RecoverSidecar: true, Metrics: metrics,
		Poll: 10 * time.Millisecond, MinInterval: time.Millisecond, Refresh: 20 * time.Millisecond, Fatal: func(error) {}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if err := d.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	published := make(chan resourceslice.DriverResources, 1)
	go d.Run(ctx, func(_ context.Context, res resourceslice.DriverResources) error {
		if calls.Add(1) <= 2 {
			return errors.New("the API server refused the slices")
		}
		select {
		case published <- res:
		default:
		}
		return nil
	})
	var res resourceslice.DriverResources
	select {
	case res = <-published:
	case <-ctx.Done():
		t.Fatal("never published")
	}
	devices := 0
	for _, pool := range res.Pools {
		for _, slice := range pool.Slices {
			devices += len(slice.Devices)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); gathered(t, reg, dra.MetricSlicePublishes, nil) < 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the publish was not counted")
		}
	}
	if got := gathered(t, reg, dra.MetricRepublishErrors, map[string]string{"stage": "publish"}); got != 2 {
		t.Errorf("publish errors %v, want the 2 refusals", got)
	}
	if got := gathered(t, reg, dra.MetricPublishedDevices, map[string]string{"warm": "false"}); int(got) != devices || devices == 0 {
		t.Errorf("published devices %v, the slices hold %d", got, devices)
	}

	d.HandleError(ctx, fmt.Errorf("update slice: %w", kubeletplugin.ErrRecoverable), "publishing")
	d.HandleError(ctx, errors.New("the gRPC server stopped"), "DRA gRPC server failed")
	if got := gathered(t, reg, dra.MetricRepublishErrors, map[string]string{"stage": "publish"}); got != 3 {
		t.Errorf("publish errors %v after the helper's recoverable failure and a fatal one, want 3", got)
	}
	for _, stage := range []string{"info", "sync", "state"} {
		if got := gathered(t, reg, dra.MetricRepublishErrors, map[string]string{"stage": stage}); got != 0 {
			t.Errorf("republish errors of stage %s: %v, want 0", stage, got)
		}
	}
}
