package dra_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// A publish that failed is retried at the next poll, not at the next Refresh (an hour here) or the
// sidecar's next change (none comes): Run must not take the slices it could not hand over for
// published.
func TestAFailedPublishIsRetriedAtTheNextPollWithNoChangeOfTheSidecar(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, socket := fakesidecar.Start(t, "GPU-a")
	c, err := migclient.New(ctx, socket, migclient.Options{AllowSimulatedBackend: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	d, err := dra.New(c, fake.NewClientset(), dra.Options{NodeName: "node-retry", RecoverSidecar: true,
		Poll: 20 * time.Millisecond, MinInterval: time.Millisecond, Refresh: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if err := d.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		calls []resourceslice.DriverResources
		done  = make(chan struct{})
	)
	go d.Run(ctx, func(_ context.Context, res resourceslice.DriverResources) error {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, res)
		if len(calls) == 1 {
			return errors.New("the helper refused it")
		}
		if len(calls) == 2 {
			close(done)
		}
		return nil
	})
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatalf("the failed publish was never retried: %d call(s)", len(calls))
	}
	mu.Lock()
	defer mu.Unlock()
	if !apiequality.Semantic.DeepEqual(calls[0], calls[1]) || len(calls[1].Pools[dra.PoolName("node-retry")].Slices) == 0 {
		t.Fatalf("the retry handed other slices than the failed publish")
	}
}
