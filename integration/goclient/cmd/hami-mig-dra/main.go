// Command hami-mig-dra is the DRA kubelet plugin of hami-mig-sidecar: it publishes the MIG
// profiles and placements of the GPUs it serves as ResourceSlices of driver mig.hami.io, and
// prepares each claim the scheduler allocated from them through the sidecar's Allocate, so a
// claim lands on a warm IDLE instance whenever one fits (package dra says how).
//
// It runs beside the sidecar on every node (deploy/), with the sidecar's socket and kubelet's
// plugin directories mounted. The GPUs it serves (--gpus; every MIG-enabled GPU by default) are
// its alone: where HAMi's device plugin shares the sidecar, its filterdevices setting must leave
// them out, and only one of the two recovers the sidecar after a restart (--recover-sidecar
// here when the DRA plugin is the sidecar's only client).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "hami-mig-dra:", err)
		os.Exit(1)
	}
}

func list(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// run serves until ctx is done or the helper fails for good.
func run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("hami-mig-dra", flag.ContinueOnError)
	fs.SetOutput(stderr)
	node := fs.String("node-name", os.Getenv("NODE_NAME"), "the node this plugin runs on (default $NODE_NAME)")
	driver := fs.String("driver-name", dra.DefaultDriverName, "the DRA driver name")
	socket := fs.String("socket", "/var/lib/hami/mig-sidecar/sidecar.sock", "the sidecar's Unix socket")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (default: the in-cluster ServiceAccount)")
	registry := fs.String("registry-dir", kubeletplugin.KubeletRegistryDir, "kubelet's plugin registration directory")
	dataDir := fs.String("plugin-dir", "", "the plugin's directory for dra.sock (default "+kubeletplugin.KubeletPluginsDir+"/<driver name>)")
	gpus := fs.String("gpus", "", "comma-separated GPUs served, by UUID or the sidecar's index (default: every MIG-enabled GPU)")
	profiles := fs.String("profiles", "", "comma-separated MIG profiles published, full names (default: all)")
	minInterval := fs.Duration("republish-min-interval", dra.DefaultMinInterval, "least time between two updates of the node's slices")
	keepFree := fs.Duration("keep-free-within", dra.DefaultKeepFreeWithin,
		"how long after the last claim for a profile the sidecar is asked to keep its next cold device free of IDLE instances (negative: never)")
	destroy := fs.Bool("destroy-at-unprepare", false, "destroy a claim's instances at unprepare instead of keeping them IDLE (create-per-claim)")
	recoverSidecar := fs.Bool("recover-sidecar", false, "recover a restarted sidecar with no active pod: only when this plugin is the sidecar's only client")
	allowSim := fs.Bool("allow-simulated-backend", false, "accept a sidecar on simulated GPUs (tests and demos)")
	callTimeout := fs.Duration("call-timeout", 10*time.Second, "deadline of each sidecar call but Allocate")
	allocateTimeout := fs.Duration("allocate-timeout", 60*time.Second, "deadline of a claim's Allocate, retries included")
	metricsAddress := fs.String("metrics-address", "", "host:port to serve the plugin's Prometheus metrics on, at /metrics (default: none)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *node == "" {
		return fmt.Errorf("--node-name (or $NODE_NAME) is required")
	}
	if *dataDir == "" {
		*dataDir = path.Join(kubeletplugin.KubeletPluginsDir, *driver)
	}
	if err := os.MkdirAll(*dataDir, 0o750); err != nil {
		return err
	}
	cfg, err := kubeConfig(*kubeconfig)
	if err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	copts := migclient.Options{CallTimeout: *callTimeout, AllocateTimeout: *allocateTimeout, AllowSimulatedBackend: *allowSim,
		AllowSimulatedSetting: "--allow-simulated-backend"}
	if *recoverSidecar {
		copts.ListActive = dra.RecoverNoPods
	}
	c, err := migclient.New(ctx, *socket, copts)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	logger := log.New(stderr, "hami-mig-dra: ", log.LstdFlags)
	metrics, err := serveMetrics(ctx, *metricsAddress, logger)
	if err != nil {
		return err
	}
	d, err := dra.New(c, kube, dra.Options{
		NodeName: *node, DriverName: *driver, GPUs: list(*gpus), Profiles: list(*profiles), MinInterval: *minInterval,
		KeepFreeWithin:     *keepFree,
		DestroyAtUnprepare: *destroy, RecoverSidecar: *recoverSidecar, Fatal: cancel, Log: logger.Printf, Metrics: metrics,
	})
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	helper, err := dra.Start(ctx, d, kubeletplugin.RegistrarDirectoryPath(*registry), kubeletplugin.PluginDataDirectoryPath(*dataDir))
	if err != nil {
		return err
	}
	logger.Printf("serving driver %s on node %s (%d pools)", *driver, *node, len(d.Model().Resources().Pools))
	<-ctx.Done()
	helper.Stop()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

func kubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		return rest.InClusterConfig()
	}
	return clientcmd.BuildConfigFromFlags("", path)
}
