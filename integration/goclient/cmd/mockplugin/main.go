// Command mockplugin replays pod events through the migclient package the way HAMi's device
// plugin drives the sidecar, and prints what each step returned.
//
// It stands in for the plugin in demos and end-to-end tests: "schedule" writes the scheduler's
// hami.io/vgpu-mig-allocations annotation, "allocate" is kubelet's Allocate for one container
// (reservations from the annotation, runtime identity written back into it), "delete" removes
// the pod and releases by pod list (generation, list, SyncActive), "restart" restarts the
// sidecar through a command, "sync" is a periodic release pass and "state" prints the sidecar's
// instance table. With --pods the pod store is a file, so runs can be chained; with --kubeconfig and
// --node the pods live in an API server and the node's idle annotation is published after every
// step (kube.go).
//
// Usage:
//
//	mockplugin --socket PATH --scenario FILE [--pods FILE | --kubeconfig FILE --node NAME] [--restart-cmd CMD] [--json] [--allow-simulated-backend]
//	           [--call-timeout D] [--allocate-timeout D] [--max-attempts N]
//
// Like the real plugin, it refuses a sidecar on the simulated backend unless told otherwise.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mockplugin:", err)
		os.Exit(1)
	}
}

type config struct {
	socket          string
	scenario        string
	pods            string
	kubeconfig      string
	node            string
	restartCmd      string
	json            bool
	callTimeout     time.Duration
	allocateTimeout time.Duration
	maxAttempts     int
	allowSimulated  bool
	recoverPending  bool
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("mockplugin", flag.ContinueOnError)
	var cfg config
	fs.StringVar(&cfg.socket, "socket", "/var/lib/hami/mig-sidecar/sidecar.sock", "the sidecar's Unix socket")
	fs.StringVar(&cfg.scenario, "scenario", "", "scenario file (YAML or JSON)")
	fs.StringVar(&cfg.pods, "pods", "", "pod store file kept between runs (default: in memory)")
	fs.StringVar(&cfg.kubeconfig, "kubeconfig", "", "keep the pods in this kubeconfig's API server instead, and publish the node's idle annotation")
	fs.StringVar(&cfg.node, "node", "", "with --kubeconfig: the node the pods are bound to and whose annotation is published")
	fs.StringVar(&cfg.restartCmd, "restart-cmd", "", "shell command that restarts the sidecar, for restart steps")
	fs.BoolVar(&cfg.json, "json", false, "print one JSON object per step instead of text")
	fs.DurationVar(&cfg.callTimeout, "call-timeout", migclient.DefaultCallTimeout, "deadline of every RPC but Allocate")
	fs.DurationVar(&cfg.allocateTimeout, "allocate-timeout", migclient.DefaultAllocateTimeout, "deadline of Allocate")
	fs.IntVar(&cfg.maxAttempts, "max-attempts", 0,
		"calls per RPC, the first included, before an UNAVAILABLE answer is given up; 0: no cap, the deadline alone bounds the retries")
	fs.BoolVar(&cfg.allowSimulated, "allow-simulated-backend", false,
		"work with a sidecar on the simulated backend (demos and tests); without it such a sidecar is refused")
	fs.BoolVar(&cfg.recoverPending, "recover-pending", true,
		"send pending reservations (scheduled, not yet allocated) in Recover, as HAMi's plugin does; --recover-pending=false for a sidecar without the 4.1 additions, which refuses them")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if cfg.scenario == "" {
		return errors.New("--scenario is required")
	}
	if cfg.maxAttempts < 0 {
		return fmt.Errorf("--max-attempts %d: want 0 (no cap) or more", cfg.maxAttempts)
	}
	sc, err := loadScenario(cfg.scenario)
	if err != nil {
		return err
	}
	store, err := openPodStore(cfg.pods)
	if err != nil {
		return err
	}
	list := store.listActive(cfg.recoverPending)
	var pods *kubePods
	if cfg.kubeconfig != "" {
		if pods, err = openKube(cfg.kubeconfig, cfg.node); err != nil {
			return err
		}
		list = pods.listActive()
	}
	ctx := context.Background()
	client, err := migclient.New(ctx, cfg.socket, migclient.Options{
		CallTimeout:           cfg.callTimeout,
		AllocateTimeout:       cfg.allocateTimeout,
		MaxAttempts:           cfg.maxAttempts,
		ListActive:            list,
		AllowSimulatedBackend: cfg.allowSimulated,
		AllowSimulatedSetting: "--allow-simulated-backend",
	})
	if err != nil {
		return err
	}
	defer func() { _ = client.Close() }() // the run's result is what it reported; a close error adds nothing
	p := &player{cfg: cfg, client: client, store: store, kube: pods, out: out, migs: map[int][]string{}}
	return p.play(ctx, sc)
}

type player struct {
	cfg    config
	client *migclient.Client
	store  *podStore
	kube   *kubePods // nil: the pods are in store
	out    io.Writer
	gpus   []migclient.GPU
	// migs remembers the MIG UUIDs each allocate step returned, for sameMigAsStep.
	migs     map[int][]string
	failures int
}

// report is what one step returned; printed as text or JSON.
type report struct {
	Step      int                         `json:"step"`
	Event     string                      `json:"event"`
	Pod       string                      `json:"pod,omitempty"`
	Container *uint32                     `json:"container,omitempty"`
	Devices   []migclient.AllocatedDevice `json:"devices,omitempty"`
	Reclaimed []migclient.InstanceRef     `json:"reclaimed,omitempty"`
	Idled     []migclient.InstanceRef     `json:"idled,omitempty"`
	Destroyed []migclient.InstanceRef     `json:"destroyed,omitempty"`
	Reactiv   []migclient.InstanceRef     `json:"reactivated,omitempty"`
	Detail    string                      `json:"detail,omitempty"`
	Error     *errorReport                `json:"error,omitempty"`
	Mismatch  string                      `json:"mismatch,omitempty"`
}

type errorReport struct {
	Code     string            `json:"code"`
	Reason   string            `json:"reason"`
	Message  string            `json:"message"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

func (p *player) play(ctx context.Context, sc Scenario) error {
	// The plugin's startup: make sure the sidecar has recovered before serving kubelet.
	info, err := p.client.EnsureRecovered(ctx)
	r := report{Step: 0, Event: "start"}
	if err != nil {
		r.Error = errReport(err)
	} else {
		r.Detail = fmt.Sprintf("sidecar %s backend=%s recovered=%t cdi=%t generation=%d",
			info.SidecarVersion, info.Backend, info.Recovered, info.CDIEnabled, info.Generation)
	}
	if err := p.emit(r); err != nil {
		return err
	}
	if err != nil {
		return fmt.Errorf("sidecar not ready: %w", err)
	}
	for i, st := range sc.Steps {
		r := p.step(ctx, i+1, st)
		if p.kube != nil && r.Error == nil {
			if err := p.kube.publish(ctx, p.client); err != nil {
				r.Error = errReport(fmt.Errorf("publish the idle annotation: %w", err))
			}
		}
		if st.Expect != nil {
			r.Mismatch = p.check(i+1, st.Expect, r)
			if r.Mismatch != "" {
				p.failures++
			}
		}
		if err := p.emit(r); err != nil {
			return err
		}
		if err := p.store.save(); err != nil {
			return err
		}
	}
	if p.failures > 0 {
		return fmt.Errorf("%d step(s) did not return what the scenario expects", p.failures)
	}
	return nil
}

func (p *player) step(ctx context.Context, n int, st Step) report {
	switch {
	case st.Schedule != nil:
		return p.schedule(ctx, n, st.Schedule)
	case st.Allocate != nil:
		return p.allocate(ctx, n, st.Allocate)
	case st.Delete != nil:
		r := report{Step: n, Event: "delete", Pod: podKey(ns(st.Delete.Namespace), st.Delete.Pod)}
		if p.kube != nil {
			if err := p.kube.remove(ctx, ns(st.Delete.Namespace), st.Delete.Pod); err != nil {
				r.Error = errReport(err)
				return r
			}
			return p.release(ctx, r)
		}
		if _, ok := p.store.Pods[r.Pod]; !ok {
			r.Error = &errorReport{Code: "NotFound", Message: "pod " + r.Pod + " not found"}
			return r
		}
		delete(p.store.Pods, r.Pod)
		return p.release(ctx, r)
	case st.Sync != nil:
		return p.release(ctx, report{Step: n, Event: "sync"})
	case st.Restart != nil:
		return p.restart(n)
	case st.Undo != nil:
		return p.undo(ctx, n, st.Undo)
	case st.ReclaimIdle != nil:
		return p.reclaimIdle(ctx, n, st.ReclaimIdle)
	case st.DisableMig != nil:
		return p.disableMig(ctx, n, st.DisableMig)
	default:
		return p.state(ctx, n)
	}
}

func ns(namespace string) string {
	if namespace == "" {
		return "default"
	}
	return namespace
}

func (p *player) schedule(ctx context.Context, n int, s *ScheduleStep) report {
	r := report{Step: n, Event: "schedule", Pod: podKey(ns(s.Namespace), s.Pod)}
	pod := &storedPod{UID: s.UID, Namespace: ns(s.Namespace), Name: s.Pod, Annotation: map[string]string{}}
	if pod.UID == "" {
		pod.UID = "uid-" + pod.Namespace + "-" + pod.Name
	}
	var allocs []annotation.Allocation
	var desc []string
	for ci, c := range s.Containers {
		pod.Containers = append(pod.Containers, c.Name)
		for di, d := range c.Devices {
			uuid, err := p.gpuUUID(ctx, d)
			if err != nil {
				r.Error = errReport(err)
				return r
			}
			allocs = append(allocs, annotation.Allocation{
				ContainerIndex: uint32(ci), DeviceIndex: uint32(di), GPUUUID: uuid, Profile: d.Profile,
				Placement: &annotation.Placement{Start: d.Placement.Start, Size: d.Placement.Size},
			})
			desc = append(desc, fmt.Sprintf("%s[%d] %s %s@%d:%d", c.Name, di, uuid, d.Profile, d.Placement.Start, d.Placement.Size))
		}
	}
	text, err := annotation.Encode(allocs)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	pod.Annotation[annotation.Key] = text
	if p.kube != nil {
		if err := p.kube.create(ctx, pod); err != nil {
			r.Error = errReport(err)
			return r
		}
	}
	p.store.Pods[r.Pod] = pod
	r.Detail = strings.Join(desc, ", ")
	return r
}

func (p *player) gpuUUID(ctx context.Context, d DeviceSpec) (string, error) {
	if d.GPUUUID != "" {
		return d.GPUUUID, nil
	}
	if d.GPU == nil {
		return "", errors.New("device needs gpu (index) or gpuUUID")
	}
	if p.gpus == nil {
		gpus, err := p.client.ListGpus(ctx)
		if err != nil {
			return "", err
		}
		p.gpus = gpus
	}
	for _, g := range p.gpus {
		if g.Index == *d.GPU {
			return g.UUID, nil
		}
	}
	return "", fmt.Errorf("no GPU with index %d", *d.GPU)
}

// allocate does what the plugin's Allocate does for one container: reservations from the
// annotation, one sidecar call, then the runtime identity merged back into the annotation.
func (p *player) allocate(ctx context.Context, n int, a *AllocateStep) report {
	r := report{Step: n, Event: "allocate", Pod: podKey(ns(a.Namespace), a.Pod), Container: &a.Container}
	sp, err := p.pod(ctx, ns(a.Namespace), a.Pod)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	pod, err := sp.parsed()
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	if int(a.Container) >= len(pod.ContainerNames) {
		r.Error = errReport(fmt.Errorf("pod %s has no container %d", r.Pod, a.Container))
		return r
	}
	req := migclient.AllocateRequest{
		Pod:            migclient.PodRef{UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name},
		ContainerName:  pod.ContainerNames[a.Container],
		ContainerIndex: a.Container,
	}
	for _, al := range annotation.ForContainer(pod.Allocations, a.Container) {
		req.Devices = append(req.Devices, migclient.DeviceRequest{
			DeviceIndex: al.DeviceIndex, GPUUUID: al.GPUUUID, Profile: al.Profile,
			Placement: migclient.Placement{Start: al.Placement.Start, Size: al.Placement.Size},
		})
	}
	res, err := p.client.Allocate(ctx, req)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	r.Devices, r.Reclaimed = res.Devices, res.Reclaimed
	for _, d := range res.Devices {
		p.migs[n] = append(p.migs[n], d.MigUUID)
	}
	if err := recordIdentity(sp, pod.Allocations, a.Container, res.Devices); err != nil {
		// The plugin fails Allocate when it cannot record the identity; the pod is then
		// deleted and its instances come back through the next release.
		r.Error = errReport(fmt.Errorf("annotate runtime identity: %w", err))
	} else if p.kube != nil {
		if err := p.kube.annotate(ctx, sp); err != nil {
			r.Error = errReport(fmt.Errorf("annotate runtime identity: %w", err))
		}
	}
	return r
}

// pod is a scheduled pod as the plugin reads it: from the API server with --kubeconfig.
func (p *player) pod(ctx context.Context, namespace, name string) (*storedPod, error) {
	if p.kube != nil {
		return p.kube.get(ctx, namespace, name)
	}
	return p.store.get(namespace, name)
}

// recordIdentity writes the runtime identity of one container's allocated devices into the
// pod's annotation, as the plugin patches the pod. The annotation changes only when the new
// value could be encoded: on an error the pod keeps the one it had, never an empty one, which
// would read as a pod holding nothing and get its instances released by the next pass.
func recordIdentity(sp *storedPod, allocs []annotation.Allocation, container uint32, devices []migclient.AllocatedDevice) error {
	ids := make([]annotation.Identity, 0, len(devices))
	for _, d := range devices {
		ids = append(ids, annotation.Identity{DeviceIndex: d.DeviceIndex, MigUUID: d.MigUUID, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID})
	}
	patched, err := annotation.WithRuntimeIdentity(allocs, container, ids)
	if err != nil {
		return err
	}
	text, err := annotation.Encode(patched)
	if err != nil {
		return err
	}
	sp.Annotation[annotation.Key] = text
	return nil
}

func (p *player) release(ctx context.Context, r report) report {
	list := p.store.listActive(true)
	if p.kube != nil {
		list = p.kube.listActive()
	}
	res, err := p.client.ReleaseByPodList(ctx, list)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	r.Idled, r.Reactiv = res.Idled, res.Reactivated
	r.Detail = fmt.Sprintf("generation %d", res.Generation)
	return r
}

func (p *player) restart(n int) report {
	r := report{Step: n, Event: "restart"}
	if p.cfg.restartCmd == "" {
		r.Error = &errorReport{Code: "InvalidArgument", Message: "restart step needs --restart-cmd"}
		return r
	}
	cmd := exec.Command("/bin/sh", "-c", p.cfg.restartCmd)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		r.Error = errReport(fmt.Errorf("restart command: %w", err))
		return r
	}
	r.Detail = "sidecar restarted; the next call recovers it"
	return r
}

func (p *player) state(ctx context.Context, n int) report {
	r := report{Step: n, Event: "state"}
	st, err := p.client.GetState(ctx)
	if err != nil {
		r.Error = errReport(err)
		return r
	}
	var lines []string
	for _, g := range st.GetGpus() {
		for _, in := range g.GetInstances() {
			lines = append(lines, fmt.Sprintf("gpu%d %s %s@%d:%d %s", g.GetGpu().GetIndex(), in.GetState(), in.GetProfile(),
				in.GetPlacement().GetStart(), in.GetPlacement().GetSize(), in.GetMigUuid()))
		}
		for _, f := range g.GetForeign() {
			lines = append(lines, fmt.Sprintf("gpu%d FOREIGN %s@%d:%d gi=%d", g.GetGpu().GetIndex(), f.GetProfile(),
				f.GetPlacement().GetStart(), f.GetPlacement().GetSize(), f.GetGpuInstanceId()))
		}
	}
	r.Detail = fmt.Sprintf("generation %d; %s", st.GetGeneration(), strings.Join(lines, "; "))
	return r
}

func errReport(err error) *errorReport {
	var e *migclient.Error
	if errors.As(err, &e) {
		return &errorReport{Code: e.Code.String(), Reason: e.Reason, Message: e.Error(), Metadata: e.Metadata}
	}
	return &errorReport{Code: "Unknown", Message: err.Error()}
}

func (p *player) check(n int, want *Expect, r report) string {
	var problems []string
	gotReason := ""
	if r.Error != nil {
		gotReason = r.Error.Reason
		if gotReason == "" {
			gotReason = r.Error.Code
		}
	}
	if gotReason != want.Reason {
		problems = append(problems, fmt.Sprintf("error reason %q, want %q", gotReason, want.Reason))
	}
	if want.Outcomes != nil {
		var got []string
		for _, d := range r.Devices {
			got = append(got, d.Outcome.String())
		}
		if !slices.Equal(got, want.Outcomes) {
			problems = append(problems, fmt.Sprintf("outcomes %v, want %v", got, want.Outcomes))
		}
	}
	if want.Reclaimed != nil && len(r.Reclaimed) != *want.Reclaimed {
		problems = append(problems, fmt.Sprintf("%d reclaimed, want %d", len(r.Reclaimed), *want.Reclaimed))
	}
	if want.Destroyed != nil && len(r.Destroyed) != *want.Destroyed {
		problems = append(problems, fmt.Sprintf("%d destroyed, want %d", len(r.Destroyed), *want.Destroyed))
	}
	if want.Idled != nil && len(r.Idled) != *want.Idled {
		problems = append(problems, fmt.Sprintf("%d idled, want %d", len(r.Idled), *want.Idled))
	}
	if want.SameMigAsStep != 0 && !slices.Equal(p.migs[n], p.migs[want.SameMigAsStep]) {
		problems = append(problems, fmt.Sprintf("MIG UUIDs %v, want those of step %d %v", p.migs[n], want.SameMigAsStep, p.migs[want.SameMigAsStep]))
	}
	return strings.Join(problems, "; ")
}

// emit writes one step's report; a write that fails ends the run, as the report is its result.
func (p *player) emit(r report) error {
	var b strings.Builder
	if p.cfg.json {
		line, err := json.Marshal(r)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(p.out, string(line))
		return err
	}
	head := fmt.Sprintf("%2d %-8s", r.Step, r.Event)
	if r.Pod != "" {
		head += " " + r.Pod
	}
	if r.Container != nil {
		head += fmt.Sprintf(" container %d", *r.Container)
	}
	switch {
	case r.Error != nil:
		fmt.Fprintf(&b, "%s: FAILED %s\n", head, r.Error.Message)
	case r.Detail != "":
		fmt.Fprintf(&b, "%s: %s\n", head, r.Detail)
	default:
		fmt.Fprintf(&b, "%s: ok\n", head)
	}
	for _, d := range r.Devices {
		cdi := d.CDIDevice
		if cdi == "" {
			cdi = "-"
		}
		fmt.Fprintf(&b, "     device %d: %-17s %s %s@%s gi=%d ci=%d cdi=%s\n", d.DeviceIndex, d.Outcome, d.MigUUID,
			d.Profile, d.Placement, d.GPUInstanceID, d.ComputeInstanceID, cdi)
	}
	for _, x := range r.Reclaimed {
		fmt.Fprintf(&b, "     reclaimed: %s %s@%s\n", x.MigUUID, x.Profile, x.Placement)
	}
	for _, x := range r.Destroyed {
		fmt.Fprintf(&b, "     destroyed: %s %s@%s\n", x.MigUUID, x.Profile, x.Placement)
	}
	for _, x := range r.Idled {
		fmt.Fprintf(&b, "     idled: %s %s@%s\n", x.MigUUID, x.Profile, x.Placement)
	}
	for _, x := range r.Reactiv {
		fmt.Fprintf(&b, "     reactivated: %s %s@%s\n", x.MigUUID, x.Profile, x.Placement)
	}
	if r.Mismatch != "" {
		fmt.Fprintf(&b, "     UNEXPECTED: %s\n", r.Mismatch)
	}
	_, err := io.WriteString(p.out, b.String())
	return err
}
