package register

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/schedule"
)

// ranked is a 2-slice placement at start with its cost.
func ranked(start uint32, cost migclient.PlacementCost) migclient.RankedPlacement {
	return migclient.RankedPlacement{Placement: migclient.Placement{Start: start, Size: 2}, Cost: cost}
}

var published = []Placement{{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}, {Start: 6, Size: 2}}

var advice = []migclient.RankedPlacement{
	ranked(4, migclient.CostReuse), ranked(6, migclient.CostFree),
	ranked(2, migclient.CostReclaim), ranked(0, migclient.CostBlocked),
}

func TestOrderPublishesReuseFirstReclaimAfterFreeAndBlockedLast(t *testing.T) {
	got := Order(published, advice, BlockedLast)
	want := []Placement{{Start: 4, Size: 2}, {Start: 6, Size: 2}, {Start: 2, Size: 2}, {Start: 0, Size: 2}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestOrderCanDropBlockedPlacements(t *testing.T) {
	got := Order(published, advice, BlockedDrop)
	want := []Placement{{Start: 4, Size: 2}, {Start: 6, Size: 2}, {Start: 2, Size: 2}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestAPlacementTheAdviceDoesNotRankGoesBeforeBlockedOnes(t *testing.T) {
	got := Order(published, advice[1:], BlockedLast) // 4:2 unranked
	want := []Placement{{Start: 6, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}, {Start: 0, Size: 2}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

type rankerFunc func(ctx context.Context, gpu, profile string) ([]migclient.RankedPlacement, error)

func (f rankerFunc) RankPlacements(ctx context.Context, gpu, profile string) ([]migclient.RankedPlacement, error) {
	return f(ctx, gpu, profile)
}

func TestAProfileWhoseAdviceFailsKeepsItsOrderAndTheOthersAreStillOrdered(t *testing.T) {
	profiles := []MigProfile{{Name: "1g.10gb", Placements: []Placement{{Start: 0, Size: 1}, {Start: 1, Size: 1}}}, {Name: "2g.20gb", Placements: published}}
	r := rankerFunc(func(_ context.Context, _, profile string) ([]migclient.RankedPlacement, error) {
		if profile == "1g.10gb" {
			return nil, errors.New("down")
		}
		return advice, nil
	})
	got, err := OrderProfiles(context.Background(), r, "GPU-a", profiles, BlockedLast)
	if err == nil {
		t.Fatal("the failed profile's error was not returned")
	}
	if !reflect.DeepEqual(got[0].Placements, profiles[0].Placements) || got[1].Placements[0] != (Placement{Start: 4, Size: 2}) {
		t.Fatalf("got %+v", got)
	}
}

func TestTheIdleAnnotationIsStableForAnUnchangedInventory(t *testing.T) {
	a := map[string][]IdleInstance{"GPU-b": {{Profile: "1g.10gb", Placement: Placement{Start: 3, Size: 1}, MigUUID: "MIG-2"},
		{Profile: "1g.10gb", Placement: Placement{Start: 1, Size: 1}, MigUUID: "MIG-1"}}, "GPU-a": nil}
	got, err := EncodeIdle(a)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"GPU-b":[{"profile":"1g.10gb","placement":{"start":1,"size":1},"migUUID":"MIG-1"},` +
		`{"profile":"1g.10gb","placement":{"start":3,"size":1},"migUUID":"MIG-2"}]}`
	if got != want {
		t.Fatalf("got %s\nwant %s", got, want)
	}
}

func TestTheAnnotationEncodeIdleWritesDecodesToTheSameInventory(t *testing.T) {
	at := func(profile string, start, size uint32) IdleInstance {
		return IdleInstance{Profile: profile, Placement: Placement{Start: start, Size: size}, MigUUID: "MIG-" + profile}
	}
	inventory := map[string][]IdleInstance{
		"GPU-a": {at("1g.10gb", 3, 1), at("2g.20gb", 0, 2)},
		"GPU-b": {at("3g.40gb", 4, 4)},
	}
	value, err := EncodeIdle(inventory)
	if err != nil {
		t.Fatal(err)
	}
	idle, err := schedule.DecodeIdle(value)
	if err != nil {
		t.Fatal(err)
	}
	want := schedule.Idle{"GPU-a": {at("2g.20gb", 0, 2), at("1g.10gb", 3, 1)}, "GPU-b": {at("3g.40gb", 4, 4)}}
	if !reflect.DeepEqual(idle, want) {
		t.Fatalf("decoded %v from %s", idle, value)
	}
}
