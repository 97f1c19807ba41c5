package dra

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	migsidecarv1 "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
)

const gpu0, gpuUnpublished = "GPU-0", "GPU-unpublished"

// resolve names devices as the plugin publishes them; GPU-unpublished has no pool.
func resolve(u *migsidecarv1.InstanceHealthUpdate) (pool, device string, ok bool) {
	if u.GetGpuUuid() != gpu0 {
		return "", "", false
	}
	name := strings.NewReplacer(".", "-", "+", "-").Replace(u.GetProfile())
	return "node-gpu0", fmt.Sprintf("gpu0-%s-at%d", name, u.GetPlacement().GetStart()), true
}

// sidecar serves the fake's table on a socket of its own, so a test can stop and start it again
// as a restarted sidecar (the table, like the sidecar's records, survives).
type sidecar struct {
	fake   *fakesidecar.Server
	socket string
	srv    *grpc.Server
}

func startSidecar(t *testing.T) *sidecar {
	t.Helper()
	fake, _ := fakesidecar.Start(t, gpu0, gpuUnpublished)
	s := &sidecar{fake: fake, socket: filepath.Join(t.TempDir(), "sidecar.sock")}
	s.start(t)
	t.Cleanup(func() { s.srv.Stop() })
	return s
}

func (s *sidecar) start(t *testing.T) {
	t.Helper()
	lis, err := net.Listen("unix", s.socket)
	if err != nil {
		t.Fatal(err)
	}
	s.srv = grpc.NewServer()
	migsidecarv1.RegisterMigSidecarServer(s.srv, s.fake)
	go func() { _ = s.srv.Serve(lis) }()
}

func (s *sidecar) client(t *testing.T) migsidecarv1.MigSidecarClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+s.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return migsidecarv1.NewMigSidecarClient(conn)
}

// serveHealth serves h as the plugin does and returns a client of it, as the kubelet dials it.
func serveHealth(t *testing.T, h *Health) drahealth.DRAResourceHealthClient {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "dra.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	drahealth.RegisterDRAResourceHealthServer(srv, h)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return drahealth.NewDRAResourceHealthClient(conn)
}

type watch struct {
	stream drahealth.DRAResourceHealth_NodeWatchResourcesClient
	cancel context.CancelFunc
}

func (k kubelet) watch(t *testing.T) *watch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a bound on a hung test only
	t.Cleanup(cancel)
	stream, err := k.NodeWatchResources(ctx, &drahealth.NodeWatchResourcesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return &watch{stream: stream, cancel: cancel}
}

type kubelet struct {
	drahealth.DRAResourceHealthClient
}

// health is one response as device -> "Healthy" or "Unhealthy: message".
func health(resp *drahealth.NodeWatchResourcesResponse) map[string]string {
	out := map[string]string{}
	for _, d := range resp.GetDevices() {
		v := "Healthy"
		if d.GetHealth() == drahealth.HealthStatus_UNHEALTHY {
			v = "Unhealthy: " + d.GetMessage()
		}
		out[d.GetDevice().GetPoolName()+"/"+d.GetDevice().GetDeviceName()] = v
	}
	return out
}

// until reads responses until one satisfies ok and returns it; the test fails if the stream ends.
func (w *watch) until(t *testing.T, what string, ok func(map[string]string) bool) map[string]string {
	t.Helper()
	var seen []map[string]string
	for {
		resp, err := w.stream.Recv()
		if err != nil {
			t.Fatalf("the stream ended (%v) before %s; responses: %v", err, what, seen)
		}
		for _, d := range resp.GetDevices() {
			if d.GetLastUpdatedTime() == 0 || d.GetHealthCheckTimeoutSeconds() < 1 {
				t.Fatalf("a device without its time or timeout: %v", d)
			}
		}
		h := health(resp)
		if ok(h) {
			return h
		}
		seen = append(seen, h)
	}
}

func put(s *sidecar, start uint32) *fakesidecar.Instance {
	return s.fake.Put(fakesidecar.Instance{GPU: gpu0, Profile: "1g.10gb", Start: start, Size: 1,
		State: migsidecarv1.InstanceState_ACTIVE, Owner: &fakesidecar.Key{PodUID: fmt.Sprintf("claim-%d", start)}})
}

const dev0, dev1, dev2 = "node-gpu0/gpu0-1g-10gb-at0", "node-gpu0/gpu0-1g-10gb-at1", "node-gpu0/gpu0-1g-10gb-at2"

func TestAnXidOnAClaimsInstanceTurnsItsDeviceUnhealthyOnTheStream(t *testing.T) {
	s := startSidecar(t)
	hit, _ := put(s, 0), put(s, 1)
	s.fake.Put(fakesidecar.Instance{GPU: gpuUnpublished, Profile: "1g.10gb", Start: 0, Size: 1, State: migsidecarv1.InstanceState_IDLE})
	// A refresh of an hour: the change below can reach the stream only through the follow stream.
	k := kubelet{serveHealth(t, NewHealth(s.client(t), resolve, HealthOptions{Refresh: time.Hour}))}
	w := k.watch(t)

	first := w.until(t, "the health as it stands", func(map[string]string) bool { return true })
	if want := map[string]string{dev0: "Healthy", dev1: "Healthy"}; fmt.Sprint(first) != fmt.Sprint(want) {
		t.Fatalf("opening list %v, want %v (the unpublished GPU's instance left out)", first, want)
	}

	s.fake.Fault(hit.MigUUID, 79)
	got := w.until(t, "the Xid's change", func(h map[string]string) bool { return h[dev0] != "Healthy" })
	if !strings.HasPrefix(got[dev0], "Unhealthy: Xid 79 faulted MIG instance "+hit.MigUUID) || got[dev1] != "Healthy" || len(got) != 2 {
		t.Fatalf("after Xid 79 on %s: %v", hit.MigUUID, got)
	}
}

func TestEveryKubeletWatcherGetsTheChangesAndEndingOneClosesItsSidecarStream(t *testing.T) {
	s := startSidecar(t)
	a, b := put(s, 0), put(s, 1)
	k := kubelet{serveHealth(t, NewHealth(s.client(t), resolve, HealthOptions{Refresh: time.Hour}))}
	watches := []*watch{k.watch(t), k.watch(t), k.watch(t)}
	for _, w := range watches {
		w.until(t, "the opening", func(h map[string]string) bool { return h[dev0] == "Healthy" })
	}
	waitFollowing(t, s, len(watches))

	s.fake.Fault(a.MigUUID, 48)
	for _, w := range watches {
		w.until(t, "Xid 48", func(h map[string]string) bool { return strings.Contains(h[dev0], "Xid 48") })
	}

	watches[0].cancel()
	waitFollowing(t, s, 2)
	s.fake.Fault(b.MigUUID, 94)
	for _, w := range watches[1:] {
		got := w.until(t, "Xid 94", func(h map[string]string) bool { return strings.Contains(h[dev1], "Xid 94") })
		if !strings.Contains(got[dev0], "Xid 48") {
			t.Fatalf("the first fault was lost: %v", got)
		}
	}
	watches[1].cancel()
	watches[2].cancel()
	waitFollowing(t, s, 0)
}

func TestTheWatchBacksOffFromASidecarWithAsManyFollowersAsItAdmits(t *testing.T) {
	s := startSidecar(t)
	hit := put(s, 0)
	s.fake.RefuseFollowers(3) // RESOURCE_EXHAUSTED OVERLOADED, as past the sidecar's --max-followers
	k := kubelet{serveHealth(t, NewHealth(s.client(t), resolve, HealthOptions{Refresh: time.Hour}))}
	w := k.watch(t)
	w.until(t, "the opening", func(h map[string]string) bool { return h[dev0] == "Healthy" })
	waitFollowing(t, s, 1) // admitted once the sidecar has a place again
	if n := s.fake.RefusedFollowers(); n != 3 {
		t.Fatalf("the sidecar refused %d following streams, want 3 before the one admitted", n)
	}
	s.fake.Fault(hit.MigUUID, 79) // a refresh of an hour: only the follow stream tells it
	w.until(t, "the fault", func(h map[string]string) bool { return strings.Contains(h[dev0], "Xid 79") })
}

// waitFollowing waits until the sidecar has n following WatchHealth streams.
func waitFollowing(t *testing.T, s *sidecar, n int) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); s.fake.Following() != n; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar has %d following streams, want %d", s.fake.Following(), n)
		}
	}
}

func TestTheWatchFollowsARestartedSidecar(t *testing.T) {
	s := startSidecar(t)
	a, b := put(s, 0), put(s, 1)
	k := kubelet{serveHealth(t, NewHealth(s.client(t), resolve, HealthOptions{Refresh: time.Hour}))}
	w := k.watch(t)
	w.until(t, "the opening", func(h map[string]string) bool { return h[dev0] == "Healthy" && h[dev1] == "Healthy" })
	waitFollowing(t, s, 1)

	s.srv.Stop() // the sidecar goes away
	waitFollowing(t, s, 0)
	s.fake.Fault(a.MigUUID, 79) // told to nobody: the watch learns it when it reads again
	s.start(t)

	w.until(t, "the fault made while the sidecar was down", func(h map[string]string) bool { return strings.Contains(h[dev0], "Xid 79") })
	s.fake.Fault(b.MigUUID, 31)
	got := w.until(t, "a fault after the restart", func(h map[string]string) bool { return strings.Contains(h[dev1], "Xid 31") })
	if !strings.Contains(got[dev0], "Xid 79") {
		t.Fatalf("after the restart: %v", got)
	}
}

func TestARefreshShowsANewInstanceAndForgetsADestroyedFaultedOne(t *testing.T) {
	s := startSidecar(t)
	a := put(s, 0)
	k := kubelet{serveHealth(t, NewHealth(s.client(t), resolve, HealthOptions{Refresh: 50 * time.Millisecond}))}
	w := k.watch(t)
	s.fake.Fault(a.MigUUID, 79)
	w.until(t, "the fault", func(h map[string]string) bool { return strings.Contains(h[dev0], "Xid 79") })

	// The faulted instance is destroyed at its release and a healthy one made at its placement;
	// another claim's instance appears at placement 2. WatchHealth follows neither.
	s.fake.Destroy(a.MigUUID)
	put(s, 0)
	put(s, 2)
	got := w.until(t, "the new instances", func(h map[string]string) bool { return len(h) == 2 && h[dev0] == "Healthy" })
	if got[dev2] != "Healthy" {
		t.Fatalf("after the refresh: %v", got)
	}
}
