package dra

// The DRA health service: the kubelet's NodeWatchResources stream, fed from the sidecar's
// WatchHealth.
//
// The kubelet reads each response as the complete health of the driver's devices (a device it
// holds that a response leaves out keeps its last health until that health's timeout, then reads
// Unknown) and forgets a reported health once its timeout (health_check_timeout_seconds, 30 s when
// unset) has passed without a newer one. It shows a prepared claim's device health in the pod's
// status (allocatedResourcesStatus), with the message where the ResourceHealthStatusMessage gate
// is on: that is where the Xid goes. So every response here lists every device that an owned
// instance sits at, and one is sent at least every Refresh, with a timeout of three of them: while
// the sidecar cannot be asked, nothing is sent and the kubelet's view of the devices turns Unknown
// on its own.
//
// The sidecar's WatchHealth with follow opens with the health of every owned instance and then
// tells each change a critical Xid makes (FAULTED, for good: a faulted instance is never handed out
// again and is destroyed at its release). It does not tell creations or destructions, so each watch
// here also re-reads the whole set (WatchHealth without follow) every Refresh and on each re-dial:
// a claim's new instance turns Healthy, and a destroyed faulted one stops making its device
// Unhealthy, within one Refresh. A re-read never undoes a fault the follow stream already told
// (it may have been read just before that fault): the instance is keyed by its MIG UUID, and a
// FAULTED instance stays so.
//
// Each kubelet stream has its own follow stream to the sidecar, so watchers are independent; the
// follow stream is dialled again with backoff when it ends (the sidecar restarted, refused it
// RESOURCE_EXHAUSTED OVERLOADED as it had as many followers as it admits, or ended a
// stream that fell behind) and closed when the kubelet's stream ends.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	migsidecarv1 "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// DefaultHealthRefresh is how often a health watch re-reads the sidecar's instances and re-sends
// the complete list when nothing changed (HealthOptions.Refresh).
const DefaultHealthRefresh = 10 * time.Second

// HealthResolver names the DRA device an instance sits at (its pool and device name in the
// published ResourceSlices). ok is false for an instance the plugin does not publish a device for:
// it is left out of the health the kubelet is told.
type HealthResolver func(*migsidecarv1.InstanceHealthUpdate) (pool, device string, ok bool)

// HealthOptions tunes a Health. The zero value is the default.
type HealthOptions struct {
	// Refresh is how often the instances are re-read and the complete list re-sent
	// (DefaultHealthRefresh when 0). The kubelet is told that a health holds for three of them.
	Refresh time.Duration
	// Backoff paces the re-dials of the sidecar after a failed or ended stream (from 100 ms,
	// doubling, up to 5 s, when its Duration is 0). It starts over after a stream that lasted
	// longer than its Cap.
	Backoff wait.Backoff
	// Now is the clock of the last_updated_time sent (time.Now when nil).
	Now func() time.Time
}

// Health serves drahealth.DRAResourceHealthServer from the sidecar. The kubelet plugin helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin) registers the health service when the driver
// it is started with implements that interface: a driver embeds *Health for it.
type Health struct {
	drahealth.UnimplementedDRAResourceHealthServer

	client  migsidecarv1.MigSidecarClient
	resolve HealthResolver
	opts    HealthOptions
}

// NewHealth returns the health service of the instances client's sidecar owns, each named as
// resolve names it.
func NewHealth(client migsidecarv1.MigSidecarClient, resolve HealthResolver, opts HealthOptions) *Health {
	if opts.Refresh <= 0 {
		opts.Refresh = DefaultHealthRefresh
	}
	if opts.Backoff.Duration <= 0 {
		opts.Backoff = wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: 1 << 30, Cap: 5 * time.Second}
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Health{client: client, resolve: resolve, opts: opts}
}

// healthEvent is what a watch's sidecar side hands to the loop that answers the kubelet: either a
// complete re-read of the instances (whole) or updates the follow stream told.
type healthEvent struct {
	whole   bool
	updates []*migsidecarv1.InstanceHealthUpdate
}

// NodeWatchResources streams the health of every device an owned instance sits at: the health as
// it stands first, then a complete list on every change and at least every Refresh, until the
// kubelet's stream ends (nil) or a send to it fails.
func (h *Health) NodeWatchResources(_ *drahealth.NodeWatchResourcesRequest, stream drahealth.DRAResourceHealth_NodeWatchResourcesServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	events := make(chan healthEvent)
	go h.follow(ctx, events)

	var (
		instances = map[string]*migsidecarv1.InstanceHealthUpdate{} // by MIG UUID
		read      bool                                              // a whole re-read arrived: the list is complete
		sent      bool                                              // a list was sent
		last      []*drahealth.DeviceHealth                         // as last sent
	)
	refresh := time.NewTicker(h.opts.Refresh)
	defer refresh.Stop()
	for {
		var heartbeat bool
		select {
		case <-ctx.Done():
			return nil
		case <-refresh.C:
			if whole, err := h.read(ctx); err == nil {
				merge(instances, whole)
				read, heartbeat = true, true
			}
		case e := <-events:
			if e.whole {
				merge(instances, e.updates)
				read = true
			}
			for _, u := range e.updates {
				apply(instances, u)
			}
		}
		if !read {
			continue // the follow stream's opening so far, without the whole set yet
		}
		devices := h.devices(instances)
		if !heartbeat && sent && sameHealth(devices, last) {
			continue
		}
		if err := stream.Send(&drahealth.NodeWatchResourcesResponse{Devices: devices}); err != nil {
			if ctx.Err() != nil {
				return nil // the kubelet ended its stream: that is this call's normal end
			}
			return err
		}
		sent, last = true, devices
	}
}

// follow hands the loop a whole re-read, then the follow stream's updates, and dials both again
// with backoff whenever the stream ends, until ctx is done. The backoff starts over after a stream
// that lasted past its cap: a stream that keeps failing at once (or ends at once) is dialled ever
// more slowly, even though each whole re-read before it succeeds.
func (h *Health) follow(ctx context.Context, events chan<- healthEvent) {
	backoff := h.opts.Backoff
	for ctx.Err() == nil {
		start := time.Now()
		err := h.followOnce(ctx, events)
		if ctx.Err() != nil || err == nil {
			return
		}
		if time.Since(start) > max(h.opts.Backoff.Cap, h.opts.Backoff.Duration) {
			backoff = h.opts.Backoff
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff.Step()):
		}
	}
}

// followOnce is one dial: the whole set, then the follow stream until it ends (an error) or ctx
// is done (nil).
func (h *Health) followOnce(ctx context.Context, events chan<- healthEvent) error {
	whole, err := h.read(ctx)
	if err != nil {
		return err
	}
	if !send(ctx, events, healthEvent{whole: true, updates: whole}) {
		return nil
	}
	stream, err := h.client.WatchHealth(ctx, &migsidecarv1.WatchHealthRequest{Follow: true})
	if err != nil {
		return err
	}
	for {
		u, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("the sidecar ended the health stream")
			}
			return err
		}
		if !send(ctx, events, healthEvent{updates: []*migsidecarv1.InstanceHealthUpdate{u}}) {
			return nil
		}
	}
}

// read is the health of every owned instance as it stands (WatchHealth without follow).
func (h *Health) read(ctx context.Context) ([]*migsidecarv1.InstanceHealthUpdate, error) {
	ctx, cancel := context.WithTimeout(ctx, h.opts.Refresh)
	defer cancel()
	stream, err := h.client.WatchHealth(ctx, &migsidecarv1.WatchHealthRequest{})
	if err != nil {
		return nil, err
	}
	var out []*migsidecarv1.InstanceHealthUpdate
	for {
		u, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, u)
	}
}

func send(ctx context.Context, events chan<- healthEvent, e healthEvent) bool {
	select {
	case events <- e:
		return true
	case <-ctx.Done():
		return false
	}
}

// merge replaces instances by a whole re-read, except that an instance already known FAULTED stays
// so: a fault is for good, and the re-read may predate the update that told it.
func merge(instances map[string]*migsidecarv1.InstanceHealthUpdate, whole []*migsidecarv1.InstanceHealthUpdate) {
	known := maps.Clone(instances)
	clear(instances)
	for _, u := range whole {
		if k, ok := known[u.GetMigUuid()]; ok && faulted(k) && !faulted(u) {
			u = k
		}
		instances[u.GetMigUuid()] = u
	}
}

// apply records one instance's health; a FAULTED instance stays so.
func apply(instances map[string]*migsidecarv1.InstanceHealthUpdate, u *migsidecarv1.InstanceHealthUpdate) {
	if k, ok := instances[u.GetMigUuid()]; ok && faulted(k) && !faulted(u) {
		return
	}
	instances[u.GetMigUuid()] = u
}

func faulted(u *migsidecarv1.InstanceHealthUpdate) bool {
	return u.GetHealth() == migsidecarv1.InstanceHealth_FAULTED
}

// devices is the complete list the kubelet is sent: one entry per device an instance resolves to,
// Unhealthy where any instance at it is faulted, in pool and device order.
func (h *Health) devices(instances map[string]*migsidecarv1.InstanceHealthUpdate) []*drahealth.DeviceHealth {
	now := h.opts.Now().Unix()
	timeout := int64((3 * h.opts.Refresh).Round(time.Second) / time.Second)
	byDevice := map[[2]string]*drahealth.DeviceHealth{}
	for _, uuid := range slices.Sorted(maps.Keys(instances)) {
		u := instances[uuid]
		pool, device, ok := h.resolve(u)
		if !ok {
			continue
		}
		d, seen := byDevice[[2]string{pool, device}]
		if !seen {
			d = &drahealth.DeviceHealth{
				Device: &drahealth.DeviceIdentifier{PoolName: pool, DeviceName: device},
				Health: drahealth.HealthStatus_HEALTHY, LastUpdatedTime: now, HealthCheckTimeoutSeconds: max(timeout, 1),
			}
			byDevice[[2]string{pool, device}] = d
		}
		if faulted(u) {
			d.Health = drahealth.HealthStatus_UNHEALTHY
			d.Message = strings.TrimPrefix(d.Message+"; "+faultMessage(u), "; ")
		}
	}
	out := slices.Collect(maps.Values(byDevice))
	slices.SortFunc(out, func(a, b *drahealth.DeviceHealth) int {
		return strings.Compare(a.GetDevice().GetPoolName()+"/"+a.GetDevice().GetDeviceName(),
			b.GetDevice().GetPoolName()+"/"+b.GetDevice().GetDeviceName())
	})
	return out
}

// faultMessage says which Xid faulted which instance, for the pod's status.
func faultMessage(u *migsidecarv1.InstanceHealthUpdate) string {
	xid := u.GetXid64()
	if xid == 0 {
		xid = uint64(u.GetXid())
	}
	return fmt.Sprintf("Xid %d faulted MIG instance %s (GPU instance %d on %s); it is not handed out again",
		xid, u.GetMigUuid(), u.GetGpuInstanceId(), u.GetGpuUuid())
}

// sameHealth compares two lists as the kubelet does (health, message and timeout per device), the
// time of the report aside.
func sameHealth(a, b []*drahealth.DeviceHealth) bool {
	return slices.EqualFunc(a, b, func(x, y *drahealth.DeviceHealth) bool {
		return x.GetDevice().GetPoolName() == y.GetDevice().GetPoolName() &&
			x.GetDevice().GetDeviceName() == y.GetDevice().GetDeviceName() &&
			x.GetHealth() == y.GetHealth() && x.GetMessage() == y.GetMessage() &&
			x.GetHealthCheckTimeoutSeconds() == y.GetHealthCheckTimeoutSeconds()
	})
}
