package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// An Xid raised on the simulated driver reaches the plugin through the client's health stream,
// and GetState carries the same health.
func TestAnXidOnAnInstanceReachesTheClientsHealthStream(t *testing.T) {
	ctx, c, p, gpus := setup(t)
	hit := allocate(ctx, t, c, p, request("hit", dev(gpus[0], "1g.10gb", 0, 1))).Devices[0]
	fine := allocate(ctx, t, c, p, request("fine", dev(gpus[0], "1g.10gb", 1, 1))).Devices[0]

	watch, stop := context.WithCancel(ctx)
	defer stop()
	updates := make(chan migclient.HealthUpdate, 16)
	done := make(chan error, 1)
	go func() { done <- c.WatchHealth(watch, true, func(u migclient.HealthUpdate) { updates <- u }) }()
	next := func(what string) migclient.HealthUpdate {
		t.Helper()
		select {
		case u := <-updates:
			return u
		case err := <-done:
			t.Fatalf("the stream ended before %s: %v", what, err)
		case <-time.After(time.Minute):
			t.Fatalf("no update: %s", what)
		}
		return migclient.HealthUpdate{}
	}
	opening := map[string]migclient.HealthUpdate{}
	for range 2 {
		u := next("the health as it stands")
		opening[u.MigUUID] = u
	}
	for _, d := range []migclient.AllocatedDevice{hit, fine} {
		if u, ok := opening[d.MigUUID]; !ok || u.Faulted || !u.Current {
			t.Fatalf("opening update of %s: %+v (all: %+v)", d.MigUUID, u, opening)
		}
	}

	sim(t, "xid", "--gpu", fmt.Sprint(gpus[0].Index), "--gi", fmt.Sprint(hit.GPUInstanceID), "79")
	u := next("the Xid's change")
	if u.MigUUID != hit.MigUUID || !u.Faulted || u.Xid != 79 || u.Current || u.GPUInstanceID != hit.GPUInstanceID {
		t.Fatalf("change: %+v, want %s FAULTED by Xid 79", u, hit.MigUUID)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("a cancelled watch returned %v", err)
	}

	state, err := c.GetState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	faulted := map[string]uint32{}
	for _, g := range state.GetGpus() {
		for _, i := range g.GetInstances() {
			faulted[i.GetMigUuid()] = i.GetXid()
		}
	}
	if faulted[hit.MigUUID] != 79 || faulted[fine.MigUUID] != 0 {
		t.Fatalf("GetState's Xids: %v", faulted)
	}
}
