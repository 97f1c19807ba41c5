package hami

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// node is the API server's copy of the node's idle annotation, and the writes it took.
type node struct {
	mu     sync.Mutex
	value  string
	writes int
	fail   int // the next fail writes are refused
}

func (n *node) patch(_ context.Context, value string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.fail > 0 {
		n.fail--
		return errors.New("the API server refused the patch")
	}
	n.value, n.writes = value, n.writes+1
	return nil
}

func (n *node) idle(t *testing.T) map[string][]register.IdleInstance {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	out := map[string][]register.IdleInstance{}
	if n.value != "" {
		if err := json.Unmarshal([]byte(n.value), &out); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// eventually waits until ok holds; the deadline only stops a broken Publisher from hanging the test.
func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
	}
}

func TestPublishWritesTheIdleInstancesOnceAndAgainOnlyWhenTheyChange(t *testing.T) {
	s, l := lazy(t)
	cached := s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "2g.20gb", Start: 2, Size: 2, State: pb.InstanceState_IDLE})
	var n node
	p := NewPublisher(l.Manager().Client(), n.patch)
	if wrote, err := p.Publish(context.Background()); err != nil || !wrote {
		t.Fatalf("first pass: %t %v", wrote, err)
	}
	got := n.idle(t)
	if len(got) != 1 || len(got["GPU-b"]) != 1 || got["GPU-b"][0].MigUUID != cached.MigUUID ||
		got["GPU-b"][0].Placement != (register.Placement{Start: 2, Size: 2}) {
		t.Fatalf("node holds %s", n.value)
	}
	if wrote, err := p.Publish(context.Background()); err != nil || wrote || n.writes != 1 {
		t.Fatalf("unchanged inventory: wrote %t, %d writes, %v", wrote, n.writes, err)
	}
	// A reuse takes the instance: the node then says nothing is idle.
	if _, err := l.EnsureAllocation(own("p", 0), 1, "2g.20gb", nvml.GpuInstancePlacement{Start: 2, Size: 2}); err != nil {
		t.Fatal(err)
	}
	if wrote, err := p.Publish(context.Background()); err != nil || !wrote || n.value != "{}" {
		t.Fatalf("after the reuse: wrote %t, node %q, %v", wrote, n.value, err)
	}
}

func TestRunPublishesWithinAPollOfAnAllocateOrARelease(t *testing.T) {
	s, l := lazy(t)
	s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: 6, Size: 1, State: pb.InstanceState_IDLE})
	var n node
	p := NewPublisher(l.Manager().Client(), n.patch)
	p.Poll, p.Refresh = 10*time.Millisecond, time.Hour // only a moved generation can trigger a pass
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx, nil); close(done) }()
	defer func() { cancel(); <-done }()

	eventually(t, "the first pass lists the IDLE 1g.10gb", func() bool { return len(n.idle(t)["GPU-a"]) == 1 })
	reused, err := l.EnsureAllocation(own("p", 0), 0, "1g.10gb", nvml.GpuInstancePlacement{Start: 6, Size: 1})
	if err != nil || !reused.Reused {
		t.Fatalf("reuse: %+v %v", reused, err)
	}
	eventually(t, "the reused instance leaves the annotation", func() bool { return len(n.idle(t)) == 0 })
	if _, err := l.EnsureAllocation(own("q", 0), 1, "3g.40gb", nvml.GpuInstancePlacement{Start: 4, Size: 4}); err != nil {
		t.Fatal(err)
	}
	// The reconciler's release pass: no pod is live, both instances go IDLE.
	if err := l.ReconcileActiveAllocations(nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, "both released instances are listed", func() bool {
		got := n.idle(t)
		return len(got["GPU-a"]) == 1 && len(got["GPU-b"]) == 1 && got["GPU-b"][0].Profile == "3g.40gb"
	})
}

func TestRunCatchesAChangeThatMovesNoGenerationWithinAPollAndRetriesAFailedPatch(t *testing.T) {
	s, l := lazy(t)
	var n node
	n.fail = 2 // the first pass and its first retry fail
	p := NewPublisher(l.Manager().Client(), n.patch)
	p.Poll, p.MinInterval, p.Refresh = 10*time.Millisecond, 10*time.Millisecond, time.Hour // no refresh
	errs := make(chan error, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		p.Run(ctx, func(err error) {
			select {
			case errs <- err:
			default:
			}
		})
		close(done)
	}()
	defer func() { cancel(); <-done }()

	eventually(t, "the refused patches are retried", func() bool { n.mu.Lock(); defer n.mu.Unlock(); return n.value == "{}" })
	if len(errs) < 2 {
		t.Fatalf("%d errors reported for two refused patches", len(errs))
	}
	// Background changes, which hand out no generation: an IDLE instance appears, then is destroyed.
	gen := s.Generation()
	in := s.Put(fakesidecar.Instance{GPU: "GPU-b", Profile: "1g.10gb", Start: 0, Size: 1, State: pb.InstanceState_IDLE})
	eventually(t, "the next poll lists it", func() bool { return len(n.idle(t)["GPU-b"]) == 1 })
	s.Destroy(in.MigUUID)
	eventually(t, "the next poll drops it", func() bool { return len(n.idle(t)) == 0 })
	if s.Generation() != gen {
		t.Fatalf("the changes moved the generation from %d to %d", gen, s.Generation())
	}
}

// TestRunCoalescesABurstIntoOnePatchPerMinInterval: 40 background changes over about 0.4 s reach the
// node in patches MinInterval apart, the last of which holds the final inventory.
func TestRunCoalescesABurstIntoOnePatchPerMinInterval(t *testing.T) {
	s, l := lazy(t)
	var mu sync.Mutex
	var sent []time.Time
	var n node
	p := NewPublisher(l.Manager().Client(), func(ctx context.Context, value string) error {
		mu.Lock()
		sent = append(sent, time.Now())
		mu.Unlock()
		return n.patch(ctx, value)
	})
	p.Poll, p.MinInterval, p.Refresh = 5*time.Millisecond, 150*time.Millisecond, time.Hour
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx, nil); close(done) }()
	defer func() { cancel(); <-done }()
	eventually(t, "the first pass", func() bool { n.mu.Lock(); defer n.mu.Unlock(); return n.writes == 1 })

	var last *fakesidecar.Instance
	for i := range 40 {
		if last != nil {
			s.Destroy(last.MigUUID)
		}
		last = s.Put(fakesidecar.Instance{GPU: "GPU-a", Profile: "1g.10gb", Start: uint32(i % 7), Size: 1, State: pb.InstanceState_IDLE})
		time.Sleep(10 * time.Millisecond)
	}
	eventually(t, "the last change is published", func() bool {
		got := n.idle(t)["GPU-a"]
		return len(got) == 1 && got[0].MigUUID == last.MigUUID
	})
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(sent); i++ {
		if gap := sent[i].Sub(sent[i-1]); gap < p.MinInterval {
			t.Fatalf("patches %d and %d were %v apart, less than %v", i-1, i, gap, p.MinInterval)
		}
	}
	if len(sent) >= 40 {
		t.Fatalf("%d patches for 40 changes: nothing was coalesced", len(sent))
	}
}
