package dra

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// Republishing, as the HAMi adapter's idle-inventory Publisher does it: the plugin asks the
// sidecar's GetInfo (answered from memory) every Poll, and at once after each of its own prepares
// and unprepares, and rebuilds the model from GetState only when the revision (which every change
// of the owned instances moves: an Allocate, a release, a trim, a reclaim, an Xid fault) or the
// sidecar's incarnation moved, or Refresh passed. It hands the slices to the helper only when they
// differ from the last ones, and at most once per MinInterval; the helper's controller writes them
// in the background and folds the updates that arrive while it writes into one. Most claims'
// prepares and unprepares change nothing in the slices (a claim's instance is published warm from
// its prepare on, see model.go): a create or a destroy does. A publish that failed is retried at
// the next poll. A new incarnation (the sidecar restarted) first runs Sync: its recovery, the GPUs
// and profiles again, and the release of claims that went away meanwhile.

// Each time it has published a model it rebuilt it names to the sidecar, for each profile claims
// asked for lately (Options.KeepFreeWithin), the device a claim that finds no warm one gets next
// (Model.NextCold) with KeepFree: the sidecar's background trim destroys the IDLE instances over
// it, so that claim creates at once. The model already lists it free and those instances cold
// (refresh), and the trim starts only after that publish: a claim steered onto an instance the trim
// is destroying would wait for the destroy, then create. It names the GPUs it serves with them: the
// sidecar's own reserve (--idle-reserve, on a sidecar shared with HAMi's device plugin) then leaves
// their IDLE instances, which the slices list warm, to the plugin. A sidecar that predates KeepFree
// is asked again only once it restarted.

// Run's periods unless set in Options.
const (
	DefaultPoll        = 200 * time.Millisecond
	DefaultMinInterval = 250 * time.Millisecond
	DefaultRefresh     = 30 * time.Second
)

// PublishFunc hands the slices to the kubeletplugin helper (Helper.PublishResources).
type PublishFunc func(ctx context.Context, resources resourceslice.DriverResources) error

// Run publishes the model at once and then whenever it changes, until ctx is done. Errors are
// logged and retried at the next poll.
func (d *Driver) Run(ctx context.Context, publish PublishFunc) {
	var (
		last      *resourceslice.DriverResources
		seen      migclient.Info // the sidecar as last published (or found unchanged)
		known     bool
		dirty     bool      // a Sync rebuilt the GPUs: publish whatever the revision says
		next      time.Time // no publish before it
		refreshed = time.Now()
		built     bool   // the model was built at revision builtAt (not yet published, maybe)
		builtAt   uint64 // that revision
		unsent    bool   // the devices to keep free of that model are not yet named to the sidecar
		keep      keepFreeState
		deferred  <-chan time.Time // fires at next when a change waits for MinInterval
	)
	tick := time.NewTicker(d.opts.Poll)
	defer tick.Stop()
	for {
		info, err := d.c.GetInfo(ctx)
		switch {
		case err != nil:
			d.opts.Log("republish: GetInfo: %v", err)
			d.opts.Metrics.republishFailed(republishStageInfo)
		case known && (info.BootID != seen.BootID || !info.StartedAt.Equal(seen.StartedAt)):
			d.opts.Log("the sidecar restarted (boot %s, started %s): syncing", info.BootID, info.StartedAt)
			if err := d.Sync(ctx); err != nil {
				d.opts.Log("sync after the sidecar's restart: %v", err)
				d.opts.Metrics.republishFailed(republishStageSync)
				break
			}
			seen.BootID, seen.StartedAt, dirty = info.BootID, info.StartedAt, true
		case dirty || !known || info.Revision != seen.Revision || time.Since(refreshed) >= d.opts.Refresh:
			if !built || dirty || info.Revision != builtAt || time.Since(refreshed) >= d.opts.Refresh {
				if err := d.refresh(ctx); err != nil {
					d.opts.Log("republish: %v", err)
					d.opts.Metrics.republishFailed(republishStageState)
					break
				}
				built, builtAt, unsent = true, info.Revision, true
			}
			if wait := time.Until(next); wait > 0 { // the slices wait for MinInterval
				if deferred == nil {
					deferred = time.After(wait)
				}
				break
			}
			if res := d.Model().Resources(); last == nil || !apiequality.Semantic.DeepEqual(*last, res) {
				if err := publish(ctx, res); err != nil {
					d.opts.Log("publish: %v", err)
					d.opts.Metrics.republishFailed(republishStagePublish)
					break // seen stays: the next poll publishes again
				}
				d.opts.Metrics.published(res)
				last, next = &res, time.Now().Add(d.opts.MinInterval)
			}
			if unsent { // only once the slices no longer list its victims warm
				keep.send(ctx, d, info)
				unsent = false
			}
			seen, known, dirty, refreshed = info, true, false, time.Now()
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-d.changed:
		case <-deferred:
			deferred = nil
		}
	}
}

// keepFreeState is Run's state of KeepFree: a sidecar incarnation that answered Unimplemented.
type keepFreeState struct {
	unsupported string // boot ID and start of the sidecar that predates KeepFree
}

// send names the model's next cold devices to the sidecar (errors are logged; the next rebuild
// names them again).
func (k *keepFreeState) send(ctx context.Context, d *Driver, info migclient.Info) {
	incarnation := info.BootID + "/" + info.StartedAt.String()
	if k.unsupported == incarnation {
		return
	}
	var next []migclient.NextPlacement
	for _, dev := range d.keepFree() {
		next = append(next, migclient.NextPlacement{GPUUUID: dev.GPUUUID, Profile: dev.Profile, Placement: dev.Placement})
	}
	err := d.c.KeepFree(ctx, next, d.servedGPUs()...)
	switch {
	case migclient.CodeOf(err) == codes.Unimplemented:
		d.opts.Log("the sidecar predates KeepFree: a cold claim over IDLE instances waits for their destroys")
		k.unsupported = incarnation
	case err != nil:
		d.opts.Log("keep free: %v", err)
	}
}
