package main

import (
	"context"
	"fmt"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// undo is the plugin's rollback after an Allocate that succeeded but whose annotation patch or
// kubelet answer failed: the runtime identity is taken out of the annotation again.
func (p *player) undo(ctx context.Context, n int, a *AllocateStep) report {
	r := report{Step: n, Event: "undo", Pod: podKey(ns(a.Namespace), a.Pod), Container: &a.Container}
	sp, err := p.pod(ctx, ns(a.Namespace), a.Pod)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	res, err := p.client.UndoAllocate(ctx, sp.UID, a.Container)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	r.Destroyed, r.Idled = res.Destroyed, res.Idled
	return r
}

func (p *player) gpuByIndex(ctx context.Context, index uint32) (string, error) {
	return p.gpuUUID(ctx, DeviceSpec{GPU: &index})
}

// reclaimIdle is an operator's cleanup of a GPU's cached instances.
func (p *player) reclaimIdle(ctx context.Context, n int, g *GPUStep) report {
	r := report{Step: n, Event: "reclaim-idle"}
	uuid, err := p.gpuByIndex(ctx, g.GPU)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	var migs []string
	for _, step := range g.MigOfStep {
		migs = append(migs, p.migs[step]...)
	}
	got, err := p.client.ReclaimIdle(ctx, uuid, migs...)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	r.Reclaimed = got
	return r
}

// disableMig is DisableIdleGPUs of HAMi after its lazy-lifecycle rewrite (PR #3128) for one GPU
// (hami-core mode).
func (p *player) disableMig(ctx context.Context, n int, g *GPUStep) report {
	r := report{Step: n, Event: "disable-mig"}
	uuid, err := p.gpuByIndex(ctx, g.GPU)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	res, err := p.client.SetMigMode(ctx, uuid, false, migclient.ReclaimIdle())
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	r.Detail = fmt.Sprintf("gpu %d mig current=%t pending=%t needs_reset=%t", g.GPU, res.MigMode.Current, res.MigMode.Pending, res.NeedsReset)
	return r
}
