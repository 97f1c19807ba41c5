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
// When it is written: at the start, and within a second of any change of the sidecar's owned
// instances, whatever made it: an Allocate (which may also reuse or reclaim IDLE instances), a
// release or undo, and the sidecar's own background work, a free-reserve trim, a ReclaimIdle, the
// reconciler's destroys, an Xid fault. The Publisher asks the sidecar's GetInfo every Poll
// (200 ms), an answer from memory with no NVML call, and reads GetState only when the revision it
// reports (which every change of the owned instances moves) or the generation has moved since the
// last read, or the sidecar restarted (a new boot or start time). The node is patched only when
// the encoded value changed (register.EncodeIdle is deterministic), and at most once per
// MinInterval (1 s): a change within a second of the last patch waits for the second to end, and
// every change made meanwhile goes out in that one patch. So the lag from a change to its patch
// is at most MinInterval plus one GetState, and a node costs the API server at most one write a
// second however busy it is, and none while nothing changes. Beside that it publishes every
// Refresh (30 s, the period of HAMi's registration loop, WatchAndRegister); against a sidecar
// older than the revision, which answers 0, that is the lag of a background change.
//
// Polling beats a stream here: a stream holds one of the sidecar's worker threads per plugin for
// ever and needs its own reconnect, and a GetInfo every 200 ms costs the sidecar well under 1 %
// of one core (bench/README.md has GetInfo's latency).
//
// The annotation is advice: a stale value costs at most a create (the scheduler sends a request
// to an instance that is gone, and the sidecar creates one there), never correctness; a failed
// read or patch is retried at the next tick.

// A Publisher's periods unless set: Poll is how often it asks GetInfo whether anything changed,
// MinInterval the least time between two patches of the node, Refresh the registration loop's
// period, HAMi's 30 s.
const (
	DefaultPoll        = 200 * time.Millisecond
	DefaultMinInterval = time.Second
	DefaultRefresh     = 30 * time.Second
)

// PatchFunc writes value as the node's register.IdleKey annotation, and removes the annotation when
// value is "" (kube.PatchIdle does both with a client-go node client).
type PatchFunc func(ctx context.Context, value string) error

// Publisher keeps the node's register.IdleKey annotation in step with the sidecar's IDLE
// instances. Build it with NewPublisher; Run is its loop, Publish one pass.
type Publisher struct {
	c     *migclient.Client
	patch PatchFunc
	// Poll, MinInterval and Refresh: see DefaultPoll, DefaultMinInterval and DefaultRefresh; set
	// before Run.
	Poll, MinInterval, Refresh time.Duration

	mu      sync.Mutex
	written string    // the value the node holds, as this Publisher last wrote it; "" before the first
	patched time.Time // when the last patch was sent
	read    seen      // what GetInfo answered before the last GetState
}

// seen is the sidecar's incarnation, generation and revision before one GetState.
type seen struct {
	boot       string
	started    time.Time
	generation uint64
	revision   uint64
	ok         bool
}

// NewPublisher publishes the IDLE instances of the sidecar behind c (Manager.Client, or
// Lazy.Manager().Client()) with patch.
func NewPublisher(c *migclient.Client, patch PatchFunc) *Publisher {
	return &Publisher{c: c, patch: patch, Poll: DefaultPoll, MinInterval: DefaultMinInterval, Refresh: DefaultRefresh}
}

// Publish is one pass: it reads the sidecar's state and patches the node when the encoded
// inventory differs from what it last wrote. It answers whether it patched. Run spaces its
// passes by MinInterval; a caller of Publish spaces its own.
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
	p.read = seen{boot: before.BootID, started: before.StartedAt, generation: before.Generation,
		revision: before.Revision, ok: true}
	same := value == p.written
	p.mu.Unlock()
	if same {
		return false, nil
	}
	sent := time.Now()
	err = p.patch(ctx, value)
	p.mu.Lock()
	p.patched = sent // a refused patch counts too: its retry waits as well
	if err == nil {
		p.written = value
	}
	p.mu.Unlock()
	if err != nil {
		return false, fmt.Errorf("patch %s: %w", register.IdleKey, err)
	}
	return true, nil
}

// remove takes the annotation off the node once Run's ctx is done (a context of its own, which
// keeps ctx's values), unless this Publisher never wrote it.
func (p *Publisher) remove(ctx context.Context, onError func(error)) {
	p.mu.Lock()
	written := p.written != ""
	p.mu.Unlock()
	if !written {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), RemoveTimeout)
	defer cancel()
	if err := p.patch(rctx, ""); err != nil {
		if onError != nil {
			onError(fmt.Errorf("remove %s: %w", register.IdleKey, err))
		}
		return
	}
	p.mu.Lock()
	p.written = ""
	p.mu.Unlock()
}

// PublishIdle runs a Publisher of the sidecar's IDLE instances with patch until ctx is done
// (IdlePublisher): HAMi's Start calls it in a goroutine of its own.
func (m *Manager) PublishIdle(ctx context.Context, patch PatchFunc, onError func(error)) {
	NewPublisher(m.c, patch).Run(ctx, onError)
}

// PublishIdle is Manager.PublishIdle.
func (l *Lazy) PublishIdle(ctx context.Context, patch PatchFunc, onError func(error)) {
	l.m.PublishIdle(ctx, patch, onError)
}

// moved reports whether the owned instances changed, or the sidecar restarted, since the last
// pass (true when there was none or GetInfo fails: then GetState decides).
func (p *Publisher) moved(ctx context.Context) bool {
	info, err := p.c.GetInfo(ctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	return err != nil || !p.read.ok || info.Revision != p.read.revision || info.Generation != p.read.generation ||
		info.BootID != p.read.boot || !info.StartedAt.Equal(p.read.started)
}

// wait is how long a pass must wait so that its patch comes MinInterval after the last one.
func (p *Publisher) wait() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.patched.IsZero() {
		return 0
	}
	return max(0, p.MinInterval-time.Since(p.patched))
}

// RemoveTimeout bounds the patch that removes the annotation when Run stops.
const RemoveTimeout = 5 * time.Second

// Run publishes at once, then after every change the sidecar reports (checked every Poll), at
// most one patch per MinInterval, and at least every Refresh, until ctx is done; then it removes
// the annotation (within RemoveTimeout), so that a node whose publisher stopped steers the
// scheduler no more. Errors are passed to onError (nil ignores them) and the pass is retried at the
// next tick: the annotation is advice, and the plugin must not stop for it.
func (p *Publisher) Run(ctx context.Context, onError func(error)) {
	defer p.remove(ctx, onError)
	poll, refresh := time.NewTicker(p.Poll), time.NewTicker(p.Refresh)
	defer poll.Stop()
	defer refresh.Stop()
	due := time.NewTimer(0) // a pass is waiting for it while armed
	defer due.Stop()
	armed := true
	arm := func() {
		if !armed {
			due.Reset(p.wait())
			armed = true
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-refresh.C:
			arm()
		case <-poll.C:
			if !armed && p.moved(ctx) {
				arm()
			}
		case <-due.C:
			armed = false
			if _, err := p.Publish(ctx); err != nil {
				p.mu.Lock()
				p.read.ok = false // retry at the next poll
				p.mu.Unlock()
				if onError != nil && ctx.Err() == nil {
					onError(err)
				}
			}
		}
	}
}
