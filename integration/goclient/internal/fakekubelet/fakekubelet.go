// Package fakekubelet is the kubelet side of a DRA kubelet plugin, for tests: it registers the
// plugin as kubelet's plugin watcher does (GetInfo on the registration socket, then
// NotifyRegistrationStatus), then calls NodePrepareResources and NodeUnprepareResources on the
// endpoint the plugin named, over gRPC, as kubelet does for a pod's claims. No kubelet binary,
// container runtime or node is needed, and what a test asserts is what kubelet would get.
package fakekubelet

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	resourceapi "k8s.io/api/resource/v1"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Kubelet is registered with one plugin.
type Kubelet struct {
	Info   *registerapi.PluginInfo
	client drapb.DRAPluginClient
	health drahealth.DRAResourceHealthClient
}

func dial(t testing.TB, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Register registers the plugin of driver whose registration socket is in registryDir (the
// helper's default name, <driver>-reg.sock), and connects to its DRA service. It fails the test
// unless the plugin is a DRA plugin of that name offering the v1 service.
func Register(ctx context.Context, t testing.TB, registryDir, driver string) *Kubelet {
	t.Helper()
	reg := registerapi.NewRegistrationClient(dial(t, filepath.Join(registryDir, driver+"-reg.sock")))
	info, err := reg.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("registration GetInfo: %v", err)
	}
	if info.GetType() != registerapi.DRAPlugin || info.GetName() != driver || !slices.Contains(info.GetSupportedVersions(), drapb.DRAPluginService) {
		t.Fatalf("registration: the plugin says %+v", info)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	conn := dial(t, info.GetEndpoint())
	return &Kubelet{Info: info, client: drapb.NewDRAPluginClient(conn), health: drahealth.NewDRAResourceHealthClient(conn)}
}

func ref(c *resourceapi.ResourceClaim) *drapb.Claim {
	return &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}
}

// Prepare is NodePrepareResources for one claim: its answer for that claim (Error set on a
// per-claim failure), or an error when the call itself failed.
func (k *Kubelet) Prepare(ctx context.Context, claim *resourceapi.ResourceClaim) (*drapb.NodePrepareResourceResponse, error) {
	resp, err := k.client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{ref(claim)}})
	if err != nil {
		return nil, err
	}
	got, ok := resp.GetClaims()[string(claim.UID)]
	if !ok {
		return nil, fmt.Errorf("NodePrepareResources answered no entry for claim %s", claim.UID)
	}
	return got, nil
}

// Unprepare is NodeUnprepareResources for one claim: the per-claim error, or the call's.
func (k *Kubelet) Unprepare(ctx context.Context, claim *resourceapi.ResourceClaim) error {
	resp, err := k.client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{ref(claim)}})
	if err != nil {
		return err
	}
	got, ok := resp.GetClaims()[string(claim.UID)]
	switch {
	case !ok:
		return fmt.Errorf("NodeUnprepareResources answered no entry for claim %s", claim.UID)
	case got.GetError() != "":
		return fmt.Errorf("unprepare claim %s: %s", claim.UID, got.GetError())
	}
	return nil
}

// CDIDevices are the CDI device IDs of a prepare answer, in order.
func CDIDevices(r *drapb.NodePrepareResourceResponse) []string {
	var out []string
	for _, d := range r.GetDevices() {
		out = append(out, d.GetCdiDeviceIds()...)
	}
	return out
}

// ContainerCDIDevices are the CDI names the kubelet hands a container that uses the claim's request
// (all of the claim's when request is ""): the devices answered for that request, and those answered
// with no request names, which belong to every request of the claim.
func ContainerCDIDevices(r *drapb.NodePrepareResourceResponse, request string) []string {
	var out []string
	for _, d := range r.GetDevices() {
		if request == "" || len(d.GetRequestNames()) == 0 || slices.Contains(d.GetRequestNames(), request) {
			out = append(out, d.GetCdiDeviceIds()...)
		}
	}
	return out
}

// WatchHealth opens NodeWatchResources, kubelet's watch of the plugin's device health, on the
// plugin's endpoint; it fails the test unless the plugin registered that service.
func (k *Kubelet) WatchHealth(ctx context.Context, t testing.TB) drahealth.DRAResourceHealth_NodeWatchResourcesClient {
	t.Helper()
	if !slices.Contains(k.Info.GetSupportedVersions(), drahealth.DRAResourceHealth_ServiceDesc.ServiceName) {
		t.Fatalf("the plugin registered no health service: %v", k.Info.GetSupportedVersions())
	}
	stream, err := k.health.NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return stream
}
