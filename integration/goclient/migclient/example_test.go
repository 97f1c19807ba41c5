package migclient_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// nodePod is what the plugin's fresh API list (a direct list, not the informer cache) says of
// one pod bound to this node.
type nodePod struct {
	UID, Namespace, Name string
	// Containers are the container names in HAMi's order: init containers first.
	Containers  []string
	Annotations map[string]string
	// Released: deletionTimestamp set, or phase Succeeded/Failed. Such a pod no longer holds
	// its instances, even while its containers run out their grace period.
	Released bool
}

// listNodePods stands for the plugin's pod lister. It must fail rather than return part of the
// list: the sidecar takes a missing allocation for a released one.
var listNodePods = func(context.Context) ([]nodePod, error) {
	return nil, errors.New("wire the plugin's API client here")
}

// activeAllocations turns a fresh pod list into the entries Recover and SyncActive receive,
// pending reservations included: a reservation whose Allocate has not come yet protects its
// placement. includePending false is only for a sidecar older than the v1 additions,
// whose Recover refuses entries without runtime identity.
func activeAllocations(includePending bool) migclient.ListActiveFunc {
	return func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		pods, err := listNodePods(ctx)
		if err != nil {
			return nil, err
		}
		var out []*pb.ActiveAllocation
		for _, p := range pods {
			if p.Released {
				continue
			}
			allocs, err := annotation.Parse(p.Annotations[annotation.Key])
			if err != nil {
				return nil, fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err) // one bad pod fails the list
			}
			pod := annotation.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, ContainerNames: p.Containers, Allocations: allocs}
			active, err := pod.ActiveAllocations(includePending)
			if err != nil {
				return nil, err
			}
			out = append(out, active...)
		}
		return out, nil
	}
}

// allocateContainer is the MIG part of kubelet's Allocate for one container: the scheduler's
// reservations from the annotation, one sidecar call, and the annotation value carrying the
// runtime identity that the plugin must patch into the pod before it answers kubelet.
func allocateContainer(ctx context.Context, c *migclient.Client, pod annotation.Pod, container uint32) (devices []string, patched string, err error) {
	req := migclient.AllocateRequest{
		Pod:            migclient.PodRef{UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name},
		ContainerName:  pod.ContainerNames[container],
		ContainerIndex: container,
	}
	for _, a := range annotation.ForContainer(pod.Allocations, container) {
		req.Devices = append(req.Devices, migclient.DeviceRequest{
			DeviceIndex: a.DeviceIndex, GPUUUID: a.GPUUUID, Profile: a.Profile,
			Placement: migclient.Placement{Start: a.Placement.Start, Size: a.Placement.Size},
		})
	}
	res, err := c.Allocate(ctx, req)
	switch {
	case migclient.IsReason(err, migclient.ReasonPlacementBusy):
		// An ACTIVE (or foreign, or ERROR) instance holds the slices: the scheduler's view is
		// stale. Fail the pod's allocation; never try another placement.
		return nil, "", fmt.Errorf("placement taken on this node: %w", err)
	case migclient.IsReason(err, migclient.ReasonInstanceInUse):
		// Still INSTANCE_IN_USE when AllocateTimeout ran out: a pod in its grace period keeps
		// running on the idle instance the scheduler picked.
		return nil, "", fmt.Errorf("instance still used by a terminating pod: %w", err)
	case err != nil:
		return nil, "", err
	}
	ids := make([]annotation.Identity, 0, len(res.Devices))
	for _, d := range res.Devices {
		ids = append(ids, annotation.Identity{
			DeviceIndex: d.DeviceIndex, MigUUID: d.MigUUID, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID,
		})
		if d.CDIDevice != "" {
			devices = append(devices, d.CDIDevice) // cdi-annotations / cdi-cri strategies
		} else {
			devices = append(devices, d.MigUUID) // NVIDIA_VISIBLE_DEVICES
		}
	}
	withIDs, err := annotation.WithRuntimeIdentity(pod.Allocations, container, ids)
	if err != nil {
		return nil, "", err
	}
	patched, err = annotation.Encode(withIDs)
	return devices, patched, err
}

// Example wires the client the way HAMi's device plugin uses it: one client for the process,
// recovery before kubelet is served, Allocate in kubelet's path, and a level-triggered release
// in the reconciler loop.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	client, err := migclient.New(ctx, "/var/lib/hami/mig-sidecar/sidecar.sock", migclient.Options{
		// Zero values take the documented defaults; spelled out here for the reader.
		CallTimeout:     migclient.DefaultCallTimeout,
		AllocateTimeout: migclient.DefaultAllocateTimeout,
		// Lets the client recover a sidecar that restarted, from any call.
		ListActive: activeAllocations(true),
		// AllowSimulatedBackend stays false on a real node.
	})
	if err != nil {
		log.Print(err)
		return
	}
	defer func() { _ = client.Close() }()

	// Startup, before registering with kubelet: the sidecar must have recovered (Recover with
	// the annotated allocations). A simulated sidecar fails here with SIMULATED_BACKEND.
	info, err := client.EnsureRecovered(ctx)
	if err != nil {
		log.Printf("MIG sidecar not ready: %v", err)
		return
	}
	log.Printf("MIG sidecar %s (%s), generation %d", info.SidecarVersion, info.Backend, info.Generation)

	// The reconciler: every few seconds, release what the fresh pod list no longer holds.
	go func() {
		tick := time.NewTicker(5 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			res, err := client.ReleaseByPodList(ctx, activeAllocations(true))
			if err != nil {
				log.Printf("MIG release pass skipped: %v", err) // nothing was released; next tick
				continue
			}
			for _, r := range res.Idled {
				log.Printf("MIG instance %s idle", r.MigUUID)
			}
		}
	}()

	// kubelet's Allocate for container 0 of the pod being admitted (getPendingPod in HAMi).
	pod := annotation.Pod{UID: "8d7c…", Namespace: "default", Name: "train", ContainerNames: []string{"main"}}
	pod.Allocations, err = annotation.Parse(`[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-6c026a52-efa9-47c9-9915-e9a9ad346ef7","profile":"1g.10gb","placement":{"start":5,"size":1}}]`)
	if err != nil {
		log.Print(err)
		return
	}
	devices, patched, err := allocateContainer(ctx, client, pod, 0)
	if err != nil {
		log.Printf("Allocate failed: %v", err) // kubelet fails the pod's admission
		return
	}
	log.Printf("patch %s=%s, give the container %v", annotation.Key, patched, devices)
}
