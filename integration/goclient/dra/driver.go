package dra

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// DefaultDriverName is the DRA driver name the DeviceClass selects (device.driver == "mig.hami.io").
const DefaultDriverName = "mig.hami.io"

// Options configure a Driver.
type Options struct {
	// NodeName is the node the plugin runs on; its pool is PoolName(NodeName).
	NodeName string
	// DriverName defaults to DefaultDriverName.
	DriverName string
	// GPUs are the GPUs the plugin serves, each a UUID or the sidecar's index; empty means every
	// GPU with MIG enabled. They are the plugin's alone: HAMi's device plugin must leave them out.
	GPUs []string
	// Profiles limits the published profiles (full names, "1g.10gb+me"); empty means all.
	Profiles []string
	// DestroyAtUnprepare destroys a claim's instances at unprepare (create-per-claim, as NVIDIA's
	// DRA driver does) instead of keeping them IDLE for the next claim.
	DestroyAtUnprepare bool
	// RecoverSidecar: the plugin is the sidecar's only client and recovers it itself (Recover with
	// no active pod) when it restarted. Without it the plugin waits for HAMi's device plugin to.
	RecoverSidecar bool
	// KeepFreeWithin is how long after the last claim for a profile the plugin still names its next
	// cold device to the sidecar to keep free (KeepFree; DefaultKeepFreeWithin when 0): a profile
	// no claim asks for would have its placement kept free at the cost of IDLE instances others
	// reuse. Negative: never (a cold claim over IDLE instances waits for their destroys).
	KeepFreeWithin time.Duration
	// Poll, MinInterval and Refresh pace the republishing (Run); see DefaultPoll and the others.
	Poll, MinInterval, Refresh time.Duration
	// Fatal is called with an error the kubeletplugin helper cannot recover from (HandleError); the
	// command stops on it. Nil only logs it through Log.
	Fatal func(error)
	// Log receives what the plugin does in the background (nil: nothing is logged).
	Log func(format string, args ...any)
	// Health tunes the health service (HealthOptions; the zero value is the default).
	Health HealthOptions
	// Metrics records the plugin's prepares, unprepares and publishes (NewMetrics); nil: none.
	Metrics *Metrics
}

// Driver is the DRA kubelet plugin: the kubeletplugin.DRAPlugin the helper serves, backed by
// the sidecar, and through its *Health the DRA health service, which the helper registers since
// the driver implements it, resolving instances with ResolveHealth. Build it with New, and start
// it with Start (Sync, the helper, Run); Close it after the helper stopped.
type Driver struct {
	*Health

	c    *migclient.Client
	conn *grpc.ClientConn // the health service's own connection to the sidecar (a stream per watch)
	kube kubernetes.Interface
	opts Options

	changed chan struct{} // a prepare or unprepare ran: Run looks at the sidecar now, not at its next poll

	mu     sync.Mutex
	gpus   []GPU
	model  *Model
	next   []Device             // the devices to keep free, of the model as last built
	blocks string               // what taints devices, as last logged (View.blocks)
	asked  map[string]time.Time // profile -> the last prepare that asked for it
}

// DefaultKeepFreeWithin is Options.KeepFreeWithin unless set: an hour, as the sidecar's own
// reserve of the profiles asked for (--idle-reserve-window).
const DefaultKeepFreeWithin = time.Hour

// New is a Driver over the sidecar client c and the API server kube (claims are read through it).
func New(c *migclient.Client, kube kubernetes.Interface, opts Options) (*Driver, error) {
	if opts.DriverName == "" {
		opts.DriverName = DefaultDriverName
	}
	if opts.Poll == 0 {
		opts.Poll = DefaultPoll
	}
	if opts.MinInterval == 0 {
		opts.MinInterval = DefaultMinInterval
	}
	if opts.Refresh == 0 {
		opts.Refresh = DefaultRefresh
	}
	if opts.KeepFreeWithin == 0 {
		opts.KeepFreeWithin = DefaultKeepFreeWithin
	}
	if opts.Log == nil {
		opts.Log = func(string, ...any) {}
	}
	conn, err := grpc.NewClient(c.Target(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial %s for the health service: %w", c.Target(), err)
	}
	d := &Driver{c: c, conn: conn, kube: kube, opts: opts, asked: map[string]time.Time{}, changed: make(chan struct{}, 1)}
	d.Health = NewHealth(pb.NewMigSidecarClient(conn), d.ResolveHealth, opts.Health)
	return d, nil
}

// Close closes the health service's connection to the sidecar.
func (d *Driver) Close() error { return d.conn.Close() }

// RecoverNoPods is the migclient.Options.ListActive of a plugin that is the sidecar's only
// client (Options.RecoverSidecar): no pod holds an instance, so Recover gets an empty list, which
// leaves every claim's instance as it is.
func RecoverNoPods(context.Context) ([]*pb.ActiveAllocation, error) { return nil, nil }

// keepFree are the devices the plugin names to the sidecar to keep free, as of the last refresh.
func (d *Driver) keepFree() []Device {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.next
}

// servedGPUs are the UUIDs of the GPUs the plugin serves, which it names to the sidecar as its own
// with KeepFree: the sidecar's reserve then leaves their IDLE instances, which the slices list
// warm, to the plugin.
func (d *Driver) servedGPUs() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]string, 0, len(d.gpus))
	for _, g := range d.gpus {
		out = append(out, g.UUID)
	}
	return out
}

// nextCold are the devices of m to keep free (Model.NextCold) of the profiles prepares asked for
// within Options.KeepFreeWithin; none with DestroyAtUnprepare, which keeps no IDLE instance. d.mu
// is held.
func (d *Driver) nextCold(m *Model) []Device {
	if d.opts.DestroyAtUnprepare || d.opts.KeepFreeWithin < 0 {
		return nil
	}
	var out []Device
	for _, dev := range m.NextCold() {
		if at, ok := d.asked[dev.Profile]; ok && time.Since(at) <= d.opts.KeepFreeWithin {
			out = append(out, dev)
		}
	}
	return out
}

// Model is the model as last built.
func (d *Driver) Model() *Model {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.model
}

// Sync brings the plugin in step with the sidecar, at start and after the sidecar restarted: it
// waits for the sidecar's recovery (or makes it, with RecoverSidecar), finds the GPUs it serves
// and their profiles, builds the model, and releases the instances of claims that are gone.
func (d *Driver) Sync(ctx context.Context) error {
	if err := d.waitRecovered(ctx); err != nil {
		return err
	}
	gpus, err := d.serve(ctx)
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.gpus = gpus
	d.mu.Unlock()
	if err := d.refresh(ctx); err != nil {
		return err
	}
	return d.RecoverClaims(ctx)
}

// waitRecovered returns once the sidecar is recovered: with RecoverSidecar it recovers it (the
// client's ListActive, RecoverNoPods, does), otherwise it polls GetInfo with backoff until
// HAMi's device plugin has.
func (d *Driver) waitRecovered(ctx context.Context) error {
	if d.opts.RecoverSidecar {
		_, err := d.c.EnsureRecovered(ctx)
		return err
	}
	wait := 100 * time.Millisecond
	for {
		info, err := d.c.GetInfo(ctx)
		if err == nil && info.Recovered {
			return nil
		}
		d.opts.Log("waiting for the sidecar's recovery by its other client (HAMi's device plugin): %v", err)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		if ctx.Err() != nil {
			return fmt.Errorf("the sidecar is not recovered (run with --recover-sidecar when the plugin is its only client): %w", ctx.Err())
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// serve answers the GPUs the plugin serves, with their profiles.
func (d *Driver) serve(ctx context.Context) ([]GPU, error) {
	all, err := d.c.ListGpus(ctx)
	if err != nil {
		return nil, err
	}
	var chosen []migclient.GPU
	if len(d.opts.GPUs) == 0 {
		for _, g := range all {
			if g.MigMode.Current {
				chosen = append(chosen, g)
			}
		}
	}
	for _, want := range d.opts.GPUs {
		i := findGPU(all, want)
		if i < 0 {
			return nil, fmt.Errorf("GPU %q: the sidecar lists no GPU with that UUID or index", want)
		}
		if !all[i].MigMode.Current {
			return nil, fmt.Errorf("GPU %q (%s): MIG mode is off", want, all[i].UUID)
		}
		chosen = append(chosen, all[i])
	}
	out := make([]GPU, 0, len(chosen))
	for _, g := range chosen {
		profiles, err := d.c.DiscoverProfiles(ctx, g.UUID, d.opts.Profiles)
		if err != nil {
			return nil, fmt.Errorf("GPU %s: %w", g.UUID, err)
		}
		out = append(out, GPU{Index: g.Index, UUID: g.UUID, Profiles: profiles})
	}
	return out, nil
}

func findGPU(all []migclient.GPU, want string) int {
	for i, g := range all {
		if g.UUID == want || strconv.FormatUint(uint64(g.Index), 10) == want {
			return i
		}
	}
	return -1
}

// refresh rebuilds the model from GetState, and the devices to keep free. The model is published
// as the sidecar's trim will leave it: the IDLE instances over a device named to keep free are
// neither warm nor counted in the ranks (Trimmed), so no claim is steered onto an instance the trim
// is about to destroy, to wait for that destroy and then create.
func (d *Driver) refresh(ctx context.Context) error {
	st, err := d.c.GetState(ctx)
	if err != nil {
		return err
	}
	view := ViewOf(st)
	view.HeldGoIdle = !d.opts.DestroyAtUnprepare
	d.mu.Lock()
	defer d.mu.Unlock()
	if blocks := view.blocks(); blocks != d.blocks {
		d.opts.Log("devices tainted %s over: %s", TaintKey, cmp.Or(blocks, "none"))
		d.blocks = blocks
	}
	m := NewModel(d.opts.NodeName, d.gpus, view)
	if d.next = d.nextCold(m); len(d.next) > 0 {
		m = NewModel(d.opts.NodeName, d.gpus, view.Trimmed(d.next))
	}
	d.model = m
	return nil
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: one sidecar Allocate per claim, keyed
// by the claim's UID, with one device per allocation result of this driver; the answer is the CDI
// device the sidecar wrote for each. A repeat answers the same devices (ALREADY_ALLOCATED).
//
// An instance's CDI device holds its device nodes only; the node's driver (libraries, nvidia-smi,
// control nodes, hooks) is the sidecar's driver device, which a container must get once however
// many of the claim's instances it uses: hooks named twice run twice. It comes as one more device
// entry with no request names, which the kubelet hands to every container that uses the claim (an
// entry without request names belongs to all of the claim's requests), beside the instances'.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		done := d.opts.Metrics.prepareStarted()
		devices, err := d.prepare(ctx, claim)
		done(err)
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	d.poke()
	return out, nil
}

func (d *Driver) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	model := d.Model()
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	req := migclient.AllocateRequest{Claim: &migclient.ClaimRef{UID: string(claim.UID), Namespace: claim.Namespace, Name: claim.Name}}
	var results []resourceapi.DeviceRequestAllocationResult
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != d.opts.DriverName {
			continue
		}
		if ptr.Deref(r.AdminAccess, false) {
			return nil, fmt.Errorf("claim %s/%s: request %s asks for adminAccess to %s, which a MIG device does not support: "+
				"adminAccess shares a device with the claims that use it, and a MIG instance is created for one claim and "+
				"held by it alone, so no instance is created for it; monitor MIG instances through the node's NVML "+
				"(nvidia-smi, DCGM) instead", claim.Namespace, claim.Name, r.Request, r.Device)
		}
		dev, ok := model.Lookup(r.Pool, r.Device)
		if !ok {
			return nil, fmt.Errorf("claim %s/%s: device %s of pool %s is not one this plugin publishes on node %s",
				claim.Namespace, claim.Name, r.Device, r.Pool, d.opts.NodeName)
		}
		req.Devices = append(req.Devices, migclient.DeviceRequest{DeviceIndex: uint32(len(req.Devices)), GPUUUID: dev.GPUUUID,
			Profile: dev.Profile, Placement: dev.Placement, Request: r.Request})
		results = append(results, r)
	}
	if len(results) == 0 {
		return nil, nil
	}
	d.mu.Lock()
	for _, dev := range req.Devices {
		d.asked[dev.Profile] = time.Now()
	}
	d.mu.Unlock()
	res, err := d.c.Allocate(ctx, req)
	if other := heldByAnotherClaim(err, string(claim.UID)); other != "" {
		// The claim whose instance is in the way may be gone without its unprepare (its pod
		// force-deleted, kubelet's state lost): the scheduler no longer counts it, and its
		// instance is published warm. Release the instances of claims gone from the API server and
		// try once more; a claim that still stands keeps its instance and this prepare fails.
		d.opts.Log("claim %s/%s: the placement is held by claim %s: releasing the instances of claims gone or not allocated here",
			claim.Namespace, claim.Name, other)
		if rerr := d.RecoverClaims(ctx); rerr != nil {
			d.opts.Log("claim %s/%s: %v", claim.Namespace, claim.Name, rerr)
		}
		res, err = d.c.Allocate(ctx, req)
	}
	if err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	d.opts.Metrics.allocated(res)
	devices := make([]kubeletplugin.Device, 0, len(results))
	for i, r := range results {
		cdi := res.Devices[i].CDIDevice
		if cdi == "" {
			return nil, fmt.Errorf("claim %s/%s: the sidecar wrote no CDI spec for %s (CDI is disabled there; the DRA plugin needs it)",
				claim.Namespace, claim.Name, res.Devices[i].MigUUID)
		}
		devices = append(devices, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{cdi}})
	}
	if len(res.DriverCDIDevices) > 0 {
		devices = append(devices, kubeletplugin.Device{PoolName: results[0].Pool, DeviceName: results[0].Device,
			CDIDeviceIDs: slices.Clone(res.DriverCDIDevices)})
	}
	return devices, nil
}

// heldByAnotherClaim is the UID of the claim whose instance err (an Allocate's) says blocks the
// placement, "" when it is not such an error or names the preparing claim itself.
func heldByAnotherClaim(err error, self string) string {
	var e *migclient.Error
	if !errors.As(err, &e) || e.Reason != migclient.ReasonPlacementBusy || e.Metadata["claim_uid"] == self {
		return ""
	}
	return e.Metadata["claim_uid"]
}

// poke tells Run that the sidecar's instances may have changed.
func (d *Driver) poke() {
	select {
	case d.changed <- struct{}{}:
	default:
	}
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the claim's instances go IDLE (or,
// with DestroyAtUnprepare, are destroyed). A claim that holds none answers success.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		out[claim.UID] = d.release(ctx, string(claim.UID))
		d.opts.Metrics.unprepared(out[claim.UID])
	}
	d.poke()
	return out, nil
}

func (d *Driver) release(ctx context.Context, claimUID string) error {
	released, err := d.c.ReleaseClaim(ctx, claimUID)
	if err != nil {
		return fmt.Errorf("release claim %s: %w", claimUID, err)
	}
	if !d.opts.DestroyAtUnprepare {
		return nil
	}
	byGPU := map[string][]string{}
	for _, in := range released {
		byGPU[in.GPUUUID] = append(byGPU[in.GPUUUID], in.MigUUID)
	}
	for gpu, migs := range byGPU {
		if _, err := d.c.ReclaimIdle(ctx, gpu, migs...); err != nil {
			return fmt.Errorf("destroy claim %s's instances on %s: %w", claimUID, gpu, err)
		}
	}
	return nil
}

// HandleError implements kubeletplugin.DRAPlugin: background errors (publishing slices, the
// gRPC servers) are logged; one the helper cannot recover from goes to Options.Fatal.
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	d.opts.Log("%s: %v", msg, err)
	if errors.Is(err, kubeletplugin.ErrRecoverable) { // the helper's writes of the slices
		d.opts.Metrics.republishFailed(republishStagePublish)
	}
	if !errors.Is(err, kubeletplugin.ErrRecoverable) && d.opts.Fatal != nil {
		d.opts.Fatal(fmt.Errorf("%s: %w", msg, err))
	}
}

// ResolveHealth is the health service's resolver: the published device of an instance whose
// health the sidecar reports.
func (d *Driver) ResolveHealth(u *pb.InstanceHealthUpdate) (pool, device string, ok bool) {
	return d.Model().Resolve(u.GetGpuUuid(), u.GetProfile(), u.GetPlacement().GetStart())
}

// RecoverClaims releases the instances of claims that no longer need them: every claim-owned
// ACTIVE instance whose claim is gone from the API server, was replaced (another UID under its
// name), is no longer allocated a device of this driver on this node, or holds it with adminAccess
// (an earlier version created an instance for such a claim: the scheduler never counted it). It keeps the others: a
// prepared claim's pod may still run. Pod-owned instances are never looked at.
func (d *Driver) RecoverClaims(ctx context.Context) error {
	st, err := d.c.GetState(ctx)
	if err != nil {
		return err
	}
	claims := map[string]*pb.ClaimRef{}
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			if in.GetState() == pb.InstanceState_ACTIVE && in.GetOwner().GetKind() == pb.OwnerKind_OWNER_KIND_CLAIM {
				claims[in.GetOwner().GetClaim().GetUid()] = in.GetOwner().GetClaim()
			}
		}
	}
	var errs []error
	for uid, ref := range claims {
		keep, err := d.claimHere(ctx, ref)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if keep {
			continue
		}
		d.opts.Log("recovery: claim %s/%s (%s) is gone or not allocated here: releasing its instances", ref.GetNamespace(), ref.GetName(), uid)
		if err := d.release(ctx, uid); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// claimHere reports whether the claim still exists with that UID and is allocated a device of
// this driver in one of this node's pools.
func (d *Driver) claimHere(ctx context.Context, ref *pb.ClaimRef) (bool, error) {
	if ref.GetName() == "" {
		return false, nil
	}
	claim, err := d.kube.ResourceV1().ResourceClaims(ref.GetNamespace()).Get(ctx, ref.GetName(), metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("recovery: read claim %s/%s: %w", ref.GetNamespace(), ref.GetName(), err)
	case string(claim.UID) != ref.GetUid() || claim.Status.Allocation == nil:
		return false, nil
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == d.opts.DriverName && !ptr.Deref(r.AdminAccess, false) &&
			(r.Pool == PoolName(d.opts.NodeName) || legacyPool(d.opts.NodeName, r.Pool)) {
			return true, nil
		}
	}
	return false, nil
}

// Start is the plugin's startup: it syncs d with the sidecar (Sync), starts the kubeletplugin
// helper with it (the registration socket and dra.sock; opts add the directories) and the
// republishing (Run) beside it, until ctx is done. Stop the returned helper to stop serving.
func Start(ctx context.Context, d *Driver, opts ...kubeletplugin.Option) (*kubeletplugin.Helper, error) {
	if err := d.Sync(ctx); err != nil {
		return nil, err
	}
	base := []kubeletplugin.Option{kubeletplugin.DriverName(d.opts.DriverName), kubeletplugin.NodeName(d.opts.NodeName),
		kubeletplugin.KubeClient(d.kube)}
	helper, err := kubeletplugin.Start(ctx, d, append(base, opts...)...)
	if err != nil {
		return nil, err
	}
	go d.Run(ctx, helper.PublishResources)
	return helper, nil
}

// DriverName is the DRA driver name the plugin serves.
func (d *Driver) DriverName() string { return d.opts.DriverName }
