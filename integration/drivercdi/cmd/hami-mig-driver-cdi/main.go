// Command hami-mig-driver-cdi prints, as JSON on stdout, the CDI spec whose one device gives a
// container the NVIDIA driver of a node (package drivercdi). The sidecar runs it at startup and
// writes what it prints into its CDI directory; run by hand it shows what a container would get.
//
//	hami-mig-driver-cdi --driver-root / --nvidia-cdi-hook-path /usr/bin/nvidia-cdi-hook
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/drivercdi"
)

func main() {
	var o drivercdi.Options
	flag.StringVar(&o.DriverRoot, "driver-root", "/", "where the driver's files are seen from here (/ or the GPU Operator's /run/nvidia/driver)")
	flag.StringVar(&o.DevRoot, "dev-root", "", "where the driver's device nodes are seen from here (default: --driver-root)")
	flag.StringVar(&o.HostDriverRoot, "host-driver-root", "", "--driver-root as the node's container runtime sees it (default: --driver-root)")
	flag.StringVar(&o.HostDevRoot, "host-dev-root", "", "--dev-root as the node's container runtime sees it (default: --host-driver-root)")
	flag.StringVar(&o.HookPath, "nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook", "nvidia-cdi-hook's path on the node")
	flag.StringVar(&o.Kind, "kind", "k8s.hami.io/mig-driver", "the spec's CDI kind (vendor/class)")
	flag.StringVar(&o.Name, "name", "common", "the name of the spec's one device")
	verbose := flag.Bool("v", false, "print nvcdi's messages on stderr")
	flag.Parse()
	if *verbose {
		o.Log = os.Stderr
	}
	spec, err := drivercdi.Spec(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "hami-mig-driver-cdi:", err)
		os.Exit(1)
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	if err := out.Encode(spec); err != nil {
		fmt.Fprintln(os.Stderr, "hami-mig-driver-cdi:", err)
		os.Exit(1)
	}
}
