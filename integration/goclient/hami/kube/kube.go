// Package kube builds what the hami adapter needs from HAMi's Kubernetes objects: the owner of
// an allocation from the pending pod, and the sidecar's active allocations from the node's pod
// list (annotation hami.io/vgpu-mig-allocations). It is the only package of this module that
// imports Kubernetes types, so the client and the adapter do not.
package kube

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// Owner is the owner of one reservation as GetContainerDeviceStrArray knows it: the pending
// pod, the container's name and index (init containers first) and the reservation's device
// index.
func Owner(pod *corev1.Pod, containerName string, containerIndex, deviceIndex int) hami.Owner {
	return hami.Owner{PodUID: string(pod.UID), PodNamespace: pod.Namespace, PodName: pod.Name,
		ContainerName: containerName, ContainerIndex: containerIndex, DeviceIndex: deviceIndex}
}

// Released reports whether a pod no longer holds its reservations, by HAMi's rule: it is being
// deleted, or it has finished. A pod absent from the list holds none either.
func Released(pod *corev1.Pod) bool {
	return pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// ActiveAllocations converts the pods' hami.io/vgpu-mig-allocations annotations into the
// sidecar's active allocations: every reservation of every pod not Released, the pending ones
// (scheduled, not allocated yet: no runtime identity) included, since they guard their
// placement. A malformed annotation fails the whole list: the sidecar reads an allocation
// missing from it as released.
func ActiveAllocations(pods []corev1.Pod) ([]*pb.ActiveAllocation, error) {
	var out []*pb.ActiveAllocation
	for i := range pods {
		pod := &pods[i]
		if Released(pod) {
			continue
		}
		allocs, err := annotation.Parse(pod.Annotations[annotation.Key])
		if err != nil {
			return nil, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
		if len(allocs) == 0 {
			continue
		}
		names := make([]string, 0, len(pod.Spec.InitContainers)+len(pod.Spec.Containers))
		for _, c := range pod.Spec.InitContainers {
			names = append(names, c.Name)
		}
		for _, c := range pod.Spec.Containers {
			names = append(names, c.Name)
		}
		active, err := annotation.Pod{UID: string(pod.UID), Namespace: pod.Namespace, Name: pod.Name,
			ContainerNames: names, Allocations: allocs}.ActiveAllocations(true)
		if err != nil {
			return nil, err
		}
		out = append(out, active...)
	}
	return out, nil
}

// PodLister is the List of a client-go PodInterface: HAMi passes
// client.GetClient().CoreV1().Pods("").
type PodLister interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
}

// NodeAllocations is the ListActive callback over a fresh list of the node's pods, read from
// the API server (not a cache), as HAMi's reconciler lists them.
func NodeAllocations(pods PodLister, nodeName string) migclient.ListActiveFunc {
	return func(ctx context.Context) ([]*pb.ActiveAllocation, error) {
		if nodeName == "" {
			return nil, fmt.Errorf("no node name to list the pods of")
		}
		list, err := pods.List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName})
		if err != nil {
			return nil, err
		}
		return ActiveAllocations(list.Items)
	}
}

// AllowSimulatedEnv is the environment variable HAMi's GPU-less CI sets to "true" in the device
// plugin's environment so that Dial accepts a sidecar on the simulated backend (see
// AllowSimulatedBackend). Any other value than a boolean fails Dial; unset or false, a simulated
// sidecar is refused with SIMULATED_BACKEND before anything is sent to it.
const AllowSimulatedEnv = "HAMI_MIG_SIDECAR_ALLOW_SIMULATED"

// Option changes how Dial connects.
type Option func(*migclient.Options)

// AllowSimulatedBackend accepts a sidecar whose GetInfo reports the simulated backend: for the
// switch's own tests in CI, never on a real node (a simulated sidecar creates no MIG instance, so
// a container given one of its MIG UUIDs would get no device or another one). Dial logs it.
func AllowSimulatedBackend() Option {
	return func(o *migclient.Options) { o.AllowSimulatedBackend = true }
}

// WithClientOptions sets the client's timeouts and retries (the other fields are Dial's own).
func WithClientOptions(opts migclient.Options) Option {
	return func(o *migclient.Options) {
		o.CallTimeout, o.AllocateTimeout, o.MaxAttempts, o.Backoff = opts.CallTimeout, opts.AllocateTimeout, opts.MaxAttempts, opts.Backoff
		o.DialOptions = opts.DialOptions
	}
}

// sharedClient is the one connection of this process to one sidecar socket. HAMi builds a new
// plugin, and with it a new manager, each time it restarts its plugins (a kubelet restart, a
// SIGHUP), in the same process and with the same context, so the old manager's Shutdown never
// runs; a connection per Dial would leak one (and its goroutines) per restart. The pod list of
// the newest Dial is the one recovery uses.
type sharedClient struct {
	c    *migclient.Client
	list atomic.Pointer[migclient.ListActiveFunc]
	refs int
}

var shared = struct {
	sync.Mutex
	bySocket map[string]*sharedClient
}{bySocket: map[string]*sharedClient{}}

// connect returns the process's client for socket with opts, making it on the first call, and
// the function that gives this reference back (the last one closes the connection).
func connect(ctx context.Context, socket string, opts migclient.Options) (*migclient.Client, func(), error) {
	abs, err := filepath.Abs(socket)
	if err != nil {
		return nil, nil, err
	}
	key := fmt.Sprintf("%s|simulated=%t", abs, opts.AllowSimulatedBackend)
	shared.Lock()
	defer shared.Unlock()
	sc, ok := shared.bySocket[key]
	if !ok {
		sc = &sharedClient{}
		list := opts.ListActive
		opts.ListActive = func(ctx context.Context) ([]*pb.ActiveAllocation, error) { return (*sc.list.Load())(ctx) }
		c, err := migclient.New(ctx, socket, opts)
		if err != nil {
			return nil, nil, err
		}
		sc.c = c
		sc.list.Store(&list)
		if opts.AllowSimulatedBackend {
			log.Printf("hami-mig-sidecar: %s accepts a sidecar on the simulated backend (%s or AllowSimulatedBackend): "+
				"it creates no real MIG instance; never set this on a node with GPUs", abs, AllowSimulatedEnv)
		}
		shared.bySocket[key] = sc
	} else {
		list := opts.ListActive
		sc.list.Store(&list)
	}
	sc.refs++
	var once sync.Once
	return sc.c, func() {
		once.Do(func() {
			shared.Lock()
			defer shared.Unlock()
			if sc.refs--; sc.refs == 0 {
				delete(shared.bySocket, key)
				_ = sc.c.Close()
			}
		})
	}, nil
}

// options are the client options of a Dial: the client's defaults, the pod list of nodeName,
// the opt-ins given and the one in the environment.
func options(pods PodLister, nodeName string, opts []Option) (migclient.Options, error) {
	o := migclient.Options{ListActive: NodeAllocations(pods, nodeName), AllowSimulatedSetting: AllowSimulatedEnv + "=true"}
	for _, opt := range opts {
		opt(&o)
	}
	if v, ok := os.LookupEnv(AllowSimulatedEnv); ok && v != "" {
		allow, err := strconv.ParseBool(v)
		if err != nil {
			return o, fmt.Errorf("%s=%q is not a boolean", AllowSimulatedEnv, v)
		}
		o.AllowSimulatedBackend = o.AllowSimulatedBackend || allow
	}
	return o, nil
}

func dial(ctx context.Context, socket string, pods PodLister, nodeName string, opts []Option) (*hami.Manager, error) {
	o, err := options(pods, nodeName, opts)
	if err != nil {
		return nil, err
	}
	c, release, err := connect(ctx, socket, o)
	if err != nil {
		return nil, err
	}
	m, err := hami.NewShared(ctx, c, o.ListActive, release)
	if err != nil {
		release()
		return nil, err
	}
	return m, nil
}

// Dial is the sidecar adapter for HAMi v2.10's plugin, its pod list that of nodeName, with the
// client's defaults otherwise. A sidecar on the simulated backend is refused unless
// AllowSimulatedBackend is given or AllowSimulatedEnv is true. All adapters of one process over
// one socket share one connection (the first Dial's client options hold for it); it closes with
// the last one's Shutdown.
func Dial(ctx context.Context, socket string, pods PodLister, nodeName string, opts ...Option) (*hami.Manager, error) {
	return dial(ctx, socket, pods, nodeName, opts)
}

// DialLazy is Dial for the lazy-lifecycle method set.
func DialLazy(ctx context.Context, socket string, pods PodLister, nodeName string, opts ...Option) (*hami.Lazy, error) {
	m, err := dial(ctx, socket, pods, nodeName, opts)
	if err != nil {
		return nil, err
	}
	return hami.LazyOver(m), nil
}
