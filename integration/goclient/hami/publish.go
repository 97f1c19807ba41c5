package hami

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/register"
)

// Publishing the idle inventory for HAMi's scheduler.
//
// HAMi's scheduler counts as occupied only the slices of pods' reservations, so it cannot see
// the IDLE instances the sidecar caches; with the scheduler change of docs/porting-hami.md ("The
// scheduler", package schedule) it reads them from the node annotation register.IdleKey, which
// the plugin writes through a Publisher.
//
// When it is written: at the start, then beside the plugin's registration loop (WatchAndRegister,
// which patches hami.io/node-nvidia-register every 30 s) at the same period, and within Poll (2 s
// by default) of any Allocate or release. The Publisher asks the sidecar's GetInfo every Poll, an
// answer from memory with no NVML call, and reads GetState only when the generation it reports
// has moved since the last read: every activation (an Allocate, which may also reuse or reclaim
// IDLE instances) and every release (Release, SyncActive, an undo) hands out a generation. A
// sidecar restart (a new boot or start time) counts as moved. What moves no generation, a
// background destroy (the free reserve's trim, a ReclaimIdle), shows at the next periodic pass:
// the lag is Poll after an Allocate or a release, Refresh after anything else. The node is patched
// only when the encoded value changed (register.EncodeIdle is deterministic), so an idle node
// costs one GetInfo per Poll and one GetState per Refresh, and no API server write.
//
// The annotation is advice: a stale value costs at most a create (the scheduler sends a request
// to an instance that is gone, and the sidecar creates one there), never correctness; a failed
// read or patch is retried at the next tick.

// DefaultPoll and DefaultRefresh are a Publisher's periods unless set: Poll bounds the lag after
// an Allocate or a release, Refresh is the registration loop's period, HAMi's 30 s.
const (
	DefaultPoll    = 2 * time.Second
	DefaultRefresh = 30 * time.Second
)

// PatchFunc writes value as the node's register.IdleKey annotation (kube.PatchIdle does it with a
// client-go node client; HAMi can pass its util.PatchNodeAnnotations in one line).
type PatchFunc func(ctx context.Context, value string) error

// Publisher keeps the node's register.IdleKey annotation in step with the sidecar's IDLE
// instances. Build it with NewPublisher; Run is its loop, Publish one pass.
type Publisher struct {
	c     *migclient.Client
	patch PatchFunc
	// Poll and Refresh: see DefaultPoll and DefaultRefresh; set before Run.
	Poll, Refresh time.Duration

	mu      sync.Mutex
	written string // the value the node holds, as this Publisher last wrote it; "" before the first
	read    seen   // what GetState answered at the last pass
}

// seen is the sidecar's incarnation and generation at one GetState.
type seen struct {
	boot       string
	started    time.Time
	generation uint64
	ok         bool
}

// NewPublisher publishes the IDLE instances of the sidecar behind c (Manager.Client, or
// Lazy.Manager().Client()) with patch.
func NewPublisher(c *migclient.Client, patch PatchFunc) *Publisher {
	return &Publisher{c: c, patch: patch, Poll: DefaultPoll, Refresh: DefaultRefresh}
}

// Publish is one pass: it reads the sidecar's state and patches the node when the encoded
// inventory differs from what it last wrote. It answers whether it patched.
func (p *Publisher) Publish(ctx context.Context) (bool, error) {
	before, err := p.c.EnsureRecovered(ctx)
	if err != nil {
		return false, err
	}
	st, err := p.c.GetState(ctx)
	if err != nil {
		return false, err
	}
	value, err := register.EncodeIdle(register.IdleFromState(st))
	if err != nil {
		return false, err
	}
	p.mu.Lock()
	p.read = seen{boot: before.BootID, started: before.StartedAt, generation: st.GetGeneration(), ok: true}
	same := value == p.written
	p.mu.Unlock()
	if same {
		return false, nil
	}
	if err := p.patch(ctx, value); err != nil {
		return false, fmt.Errorf("patch %s: %w", register.IdleKey, err)
	}
	p.mu.Lock()
	p.written = value
	p.mu.Unlock()
	return true, nil
}

// moved reports whether the sidecar handed out a generation, or restarted, since the last pass
// (true when there was none or GetInfo fails: then GetState decides).
func (p *Publisher) moved(ctx context.Context) bool {
	info, err := p.c.GetInfo(ctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	return err != nil || !p.read.ok || info.Generation != p.read.generation || info.BootID != p.read.boot ||
		!info.StartedAt.Equal(p.read.started)
}

// Run publishes at once, then whenever the sidecar's generation moved (checked every Poll) and at
// least every Refresh, until ctx is done. Errors are passed to onError (nil ignores them) and the
// pass is retried at the next tick: the annotation is advice, and the plugin must not stop for it.
func (p *Publisher) Run(ctx context.Context, onError func(error)) {
	pass := func() {
		if _, err := p.Publish(ctx); err != nil {
			p.mu.Lock()
			p.read.ok = false // retry at the next poll
			p.mu.Unlock()
			if onError != nil && ctx.Err() == nil {
				onError(err)
			}
		}
	}
	pass()
	poll, refresh := time.NewTicker(p.Poll), time.NewTicker(p.Refresh)
	defer poll.Stop()
	defer refresh.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-refresh.C:
			pass()
		case <-poll.C:
			if p.moved(ctx) {
				pass()
			}
		}
	}
}
