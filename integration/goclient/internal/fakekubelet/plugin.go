package fakekubelet

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// Node is a node of the API server with the DRA plugin running for it against a sidecar, and
// this fake kubelet registered with the plugin.
type Node struct {
	*Kubelet
	Name   string
	Admin  kubernetes.Interface
	Driver *dra.Driver
	stop   func()
}

// Start creates the node (and the driver's DeviceClass, once per server) in s, starts the plugin
// for it on the sidecar behind c with opts (NodeName is the node's) and registers with it. The
// plugin stops at the end of the test, or at Stop.
func Start(ctx context.Context, t testing.TB, s *kubeapi.Server, c *migclient.Client, opts dra.Options) *Node {
	t.Helper()
	admin := s.Client(t, kubeapi.AdminUser)
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: opts.NodeName}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	kubeapi.DeviceClass(ctx, t, admin, dra.DefaultDriverName, dra.DefaultDriverName)
	// Unix socket paths are short (108 bytes): not under t.TempDir, whose name holds the test's.
	dir, err := os.MkdirTemp("", "dra")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	for _, sub := range []string{"reg", "plugin"} {
		if err := os.Mkdir(filepath.Join(dir, sub), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	pctx, cancel := context.WithCancel(ctx)
	d, err := dra.New(c, admin, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	helper, err := dra.Start(pctx, d, kubeletplugin.RegistrarDirectoryPath(filepath.Join(dir, "reg")),
		kubeletplugin.PluginDataDirectoryPath(filepath.Join(dir, "plugin")))
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	n := &Node{Name: opts.NodeName, Admin: admin, Driver: d}
	n.stop = func() { cancel(); helper.Stop() }
	t.Cleanup(n.Stop)
	n.Kubelet = Register(ctx, t, filepath.Join(dir, "reg"), d.DriverName())
	return n
}

// Stop stops the plugin (as a restart's first half); idempotent.
func (n *Node) Stop() {
	if n.stop != nil {
		n.stop()
		n.stop = nil
	}
}

// Devices are the node's published devices of the driver, in the scheduler's order: slices by
// pool and name, devices as listed. It waits (up to a minute) until want(devices) holds, and
// fails the test then.
func (n *Node) Devices(ctx context.Context, t testing.TB, want func([]resourceapi.Device) bool) []resourceapi.Device {
	t.Helper()
	var devices []resourceapi.Device
	for deadline := time.Now().Add(time.Minute); ; {
		list, err := n.Admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
			FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + n.Name})
		if err != nil {
			t.Fatal(err)
		}
		slices := list.Items
		sort.Slice(slices, func(i, j int) bool {
			a, b := slices[i].Spec.Pool.Name, slices[j].Spec.Pool.Name
			return a < b || (a == b && slices[i].Name < slices[j].Name)
		})
		devices = devices[:0]
		for _, s := range slices {
			devices = append(devices, s.Spec.Devices...)
		}
		if want(devices) {
			return devices
		}
		if time.Now().After(deadline) {
			t.Fatalf("the node's published devices never became as wanted: %d devices", len(devices))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Claim creates claim namespace/name of one request "gpu" of the driver's DeviceClass and writes
// its allocation, as the scheduler would, to the given devices of the node's pools (pool,
// device pairs).
func (n *Node) Claim(ctx context.Context, t testing.TB, namespace, name string, pairs ...[2]string) *resourceapi.ResourceClaim {
	t.Helper()
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: dra.DefaultDriverName, Count: int64(len(pairs))}}}}}}
	claim, err := n.Admin.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	alloc := &resourceapi.AllocationResult{}
	for _, p := range pairs {
		alloc.Devices.Results = append(alloc.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpu", Driver: dra.DefaultDriverName, Pool: p[0], Device: p[1]})
	}
	claim.Status.Allocation = alloc
	claim, err = n.Admin.ResourceV1().ResourceClaims(namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return claim
}

// Taint is the value of the plugin's taint (dra.TaintKey) on device name among devices: "" when it
// has none, "absent" when no device has that name.
func Taint(devices []resourceapi.Device, name string) string {
	for _, d := range devices {
		if d.Name != name {
			continue
		}
		for _, taint := range d.Taints {
			if taint.Key == dra.TaintKey {
				return taint.Value
			}
		}
		return ""
	}
	return "absent"
}
