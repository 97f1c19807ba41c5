package manifests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

const (
	deployDir   = "../../deploy"
	benchReadme = "../../bench/README.md"
	daemonSet   = "daemonset.yaml"
	rules       = "prometheus-rules.yaml"
	dashboard   = "grafana-dashboard.json"
	dashboardCM = "grafana-dashboard-configmap.yaml"
	podMonitor  = "podmonitor.yaml"
	// The DRA path (deploy/dra/): its DaemonSet, RBAC, class and examples.
	draDir       = "dra"
	draDaemonSet = "dra/daemonset.yaml"
	draRBAC      = "dra/rbac.yaml"
	draClass     = "dra/deviceclass.yaml"
	draClaims    = "dra/examples/claims.yaml"
	draPod       = "dra/examples/pod.yaml"
)

// draFiles are the DRA path's manifests, as names under deploy/.
var draFiles = []string{draDaemonSet, draRBAC, draClass, draClaims, draPod}

func read(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(deployDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func measured(t *testing.T) float64 {
	t.Helper()
	text, err := os.ReadFile(benchReadme)
	if err != nil {
		t.Fatal(err)
	}
	mib, err := MeasuredMiB(text)
	if err != nil {
		t.Fatalf("%s: %v", benchReadme, err)
	}
	return mib
}

// broken is text with old replaced by new; the test fails if old is not there (the file changed and
// the broken copy would silently be the good file).
func broken(t *testing.T, text, old, replacement string) string {
	t.Helper()
	if !strings.Contains(text, old) {
		t.Fatalf("the file no longer contains %q", old)
	}
	return strings.Replace(text, old, replacement, 1)
}

// checkAll decodes text as the file name and runs the checks of its kind.
func checkAll(t *testing.T, name, text string) []error {
	t.Helper()
	if strings.HasSuffix(name, ".json") {
		d, err := DecodeDashboard([]byte(text))
		if err != nil {
			return []error{err}
		}
		return CheckDashboard(d)
	}
	docs, err := Decode(name, []byte(text))
	if err != nil {
		return []error{err}
	}
	var errs []error
	if strings.HasPrefix(name, draDir+"/") { // the DRA path's objects are checked together
		all := docs
		for _, other := range draFiles {
			if other != name {
				more, err := Decode(other, []byte(read(t, other)))
				if err != nil {
					t.Fatal(err)
				}
				all = append(all, more...)
			}
		}
		errs = append(errs, CheckDRA(all)...)
	}
	for _, m := range docs {
		switch {
		case m.DaemonSet != nil:
			errs = append(errs, CheckDaemonSet(m.DaemonSet, measured(t))...)
		case m.PromRule != nil:
			errs = append(errs, CheckRules(m.PromRule)...)
		case m.PodMonitor != nil:
			errs = append(errs, CheckPodMonitor(m.PodMonitor, standalone(t, daemonSet))...)
			errs = append(errs, CheckPodMonitor(m.PodMonitor, standalone(t, draDaemonSet))...)
		case m.ConfigMap != nil:
			errs = append(errs, CheckDashboardConfigMap(m.ConfigMap, []byte(read(t, dashboard)))...)
		}
	}
	return errs
}

// standalone is the DaemonSet of deploy/daemonset.yaml or deploy/dra/daemonset.yaml, which the
// PodMonitor must scrape too.
func standalone(t *testing.T, name string) *appsv1.DaemonSet {
	t.Helper()
	docs, err := Decode(name, []byte(read(t, name)))
	if err != nil || len(docs) != 1 || docs[0].DaemonSet == nil {
		t.Fatalf("%s: %v", name, err)
	}
	return docs[0].DaemonSet
}

func TestEveryManifestDecodesStrictlyAndPassesItsChecks(t *testing.T) {
	var files []string
	for _, dir := range []string{".", draDir, draDir + "/examples"} {
		matched, err := filepath.Glob(filepath.Join(deployDir, dir, "*"))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, matched...)
	}
	seen := map[string]bool{}
	for _, file := range files {
		name, err := filepath.Rel(deployDir, file)
		if err != nil {
			t.Fatal(err)
		}
		if info, err := os.Stat(file); err == nil && info.IsDir() {
			continue // helm/ (the post-renderer, postrender_test.go), tests/ (promtool's), dra/ (above)
		}
		if !strings.HasSuffix(name, ".yaml") && !strings.HasSuffix(name, ".json") {
			t.Errorf("%s: not a manifest this check knows (.yaml, .json)", name)
			continue
		}
		seen[name] = true
		for _, err := range checkAll(t, name, read(t, name)) {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, name := range append([]string{daemonSet, rules, dashboard, dashboardCM, podMonitor}, draFiles...) {
		if !seen[name] {
			t.Errorf("deploy/%s is missing", name)
		}
	}
}

func TestTheMeasuredFigureIsOnTheBenchmarksPrintedLine(t *testing.T) {
	if mib := measured(t); mib < 8 || mib > 4096 {
		t.Fatalf("measured %.1f MiB: not a sidecar's resident memory", mib)
	}
}

// Each broken copy of a good file must fail, with an error that says why.
func TestBrokenCopiesFail(t *testing.T) {
	ds, rule, dash, dra := read(t, daemonSet), read(t, rules), read(t, dashboard), read(t, draDaemonSet)
	cases := []struct {
		name, file, text, want string
	}{
		{"an unknown field of a container", daemonSet,
			broken(t, ds, "          args: [\"serve\"]\n", "          args: [\"serve\"]\n          restartPolicyy: Always\n"),
			"unknown field"},
		{"a misspelt key of the update strategy", daemonSet,
			broken(t, ds, "maxUnavailable: 1", "maxUnavailabel: 1"), "unknown field"},
		{"a surge that starts a second sidecar on the node", daemonSet,
			broken(t, ds, "maxSurge: 0", "maxSurge: 1"), "two sidecars"},
		{"the socket under the device-plugins directory", daemonSet,
			strings.ReplaceAll(ds, "/var/lib/hami/mig-sidecar", "/var/lib/kubelet/device-plugins/mig-sidecar"),
			"kubelet wipes"},
		{"the plugin not mounting the socket directory", daemonSet,
			broken(t, ds, "            - name: mig-sidecar-socket\n              mountPath: /var/lib/hami/mig-sidecar\n            - name: device-plugins\n",
				"            - name: device-plugins\n"),
			"both containers must mount the socket directory"},
		{"the state directory on an emptyDir", daemonSet,
			broken(t, ds, "        - name: mig-state\n          hostPath:\n            path: /var/run/hami/dynamic-mig-state\n            type: DirectoryOrCreate\n",
				"        - name: mig-state\n          emptyDir: {}\n"),
			"state directory"},
		{"CDI specs written somewhere the runtime does not read", daemonSet,
			broken(t, ds, "            path: /var/run/cdi\n", "            path: /etc/cdi-elsewhere\n"),
			"CDI directory"},
		{"a liveness probe that only checks the socket answers", daemonSet,
			broken(t, ds, "livenessProbe:\n            exec:\n              command: [\"hami-mig-sidecar\", \"health\"",
				"livenessProbe:\n            exec:\n              command: [\"hami-mig-sidecar\", \"status\""),
			"livenessProbe"},
		{"a memory request below the measured figure", daemonSet,
			broken(t, ds, "memory: 64Mi", "memory: 16Mi"), "below the measured"},
		{"an unknown field of a rule", rules,
			broken(t, rule, "          for: 5m\n", "          for: 5m\n          severity: warning\n"),
			"unknown field"},
		{"a rule expression that does not parse", rules,
			broken(t, rule, `sum by (instance, gpu) (hami_mig_sidecar_instances{state="ERROR"}) > 0`,
				`sum by (instance, gpu) (hami_mig_sidecar_instances{state="ERROR"} > 0`),
			"parse error"},
		{"a rule naming no metric of the sidecar", rules,
			broken(t, rule, `max by (instance, part) (hami_mig_sidecar_busy_seconds) > 120`, `vector(1) > 0`),
			"names no"},
		{"a required alert gone", rules,
			broken(t, rule, "alert: HamiMigSidecarNotRecovered", "alert: SomethingElse"),
			"HamiMigSidecarNotRecovered is missing"},
		{"a PodMonitor selecting pods the DaemonSet does not have", podMonitor,
			broken(t, read(t, podMonitor), "app.kubernetes.io/component: hami-device-plugin", "app.kubernetes.io/component: other"),
			"does not match"},
		{"a PodMonitor leaving instance the pod's address", podMonitor,
			broken(t, read(t, podMonitor), "          targetLabel: instance\n", "          targetLabel: node\n"),
			"instance is not relabelled"},
		{"a PodMonitor on a port the sidecar does not name", podMonitor,
			broken(t, read(t, podMonitor), "port: mig-metrics", "port: metrics"), "no endpoint"},
		{"a PodMonitor leaving out the DRA plugin's own metrics", podMonitor,
			broken(t, read(t, podMonitor), "port: dra-metrics", "port: dra-metrix"),
			"no endpoint scrapes the dra-plugin container's port dra-metrics"},
		{"the dashboard ConfigMap without Grafana's label", dashboardCM,
			broken(t, read(t, dashboardCM), "grafana_dashboard: \"1\"", "dashboard: \"1\""), "grafana_dashboard label"},
		{"the dashboard ConfigMap out of date", dashboardCM,
			broken(t, read(t, dashboardCM), `"title": "hami-mig-sidecar"`, `"title": "old"`), "differs"},
		{"a mount of a volume the pod does not have", daemonSet,
			broken(t, ds, "              mountPath: /var/run/cdi\n", "              mountPath: /var/run/cdi\n            - name: nowhere\n              mountPath: /nowhere\n"),
			"which the pod does not have"},
		{"the DRA plugin without the kubelet's registration directory", draDaemonSet,
			broken(t, dra, "            - name: registration-dir\n              mountPath: /var/lib/kubelet/plugins_registry\n", ""),
			"plugins_registry at the same path"},
		{"the DRA plugin's directory somewhere the kubelet does not look", draDaemonSet,
			broken(t, dra, "            path: /var/lib/kubelet/plugins/mig.hami.io\n", "            path: /var/lib/hami/dra\n"),
			"plugins/mig.hami.io at the same path"},
		{"the DRA plugin not knowing its node", draDaemonSet,
			broken(t, dra, "fieldPath: spec.nodeName", "fieldPath: metadata.name"), "NODE_NAME"},
		{"the DRA plugin beside HAMi's device plugin in one pod", draDaemonSet,
			broken(t, dra, "        - name: mig-sidecar\n", "        - name: device-plugin\n          image: projecthami/hami:latest\n        - name: mig-sidecar\n"),
			"one of"},
		{"the DRA plugin not mounting the socket directory", draDaemonSet,
			broken(t, dra, "            - name: mig-sidecar-socket\n              mountPath: /var/lib/hami/mig-sidecar\n            - name: plugin-dir\n",
				"            - name: plugin-dir\n"),
			"both containers must mount the socket directory"},
		{"the DRA plugin leaving its sidecar unrecovered after a restart", draDaemonSet,
			broken(t, dra, ` "--recover-sidecar",`, ``), "needs --recover-sidecar"},
		{"the DRA plugin dialling another socket", draDaemonSet,
			broken(t, dra, `args: ["--socket", "/var/lib/hami/mig-sidecar/sidecar.sock"`, `args: ["--socket", "/var/lib/hami/mig-sidecar/dra.sock"`),
			"the sidecar serves on"},
		{"the DRA sidecar with a surge", draDaemonSet, broken(t, dra, "maxSurge: 0", "maxSurge: 1"), "two sidecars"},
		{"a DeviceClass selecting another driver", draClass,
			broken(t, read(t, draClass), `device.driver == "mig.hami.io"`, `device.driver == "gpu.nvidia.com"`), "exactly the driver's devices"},
		{"a claim on an attribute the plugin does not publish", draClaims,
			broken(t, read(t, draClaims), `device.attributes["mig.hami.io"].warm`, `device.attributes["mig.hami.io"].idle`), "mig.hami.io/idle"},
		{"a claim on another device class", draClaims,
			broken(t, read(t, draClaims), "deviceClassName: mig.hami.io", "deviceClassName: gpu.nvidia.com"), "not mig.hami.io"},
		{"a misspelt field of a claim", draClaims,
			broken(t, read(t, draClaims), "firstAvailable:", "firstAvaliable:"), "unknown field"},
		{"a pod naming a template that is not there", draPod,
			broken(t, read(t, draPod), "resourceClaimTemplateName: mig-1g-10gb-warm-first", "resourceClaimTemplateName: mig-warm"), "not among the examples"},
		{"a pod whose container does not use its claim", draPod,
			broken(t, read(t, draPod), "      resources:\n        claims:\n          - name: gpu\n", ""), "no container uses"},
		{"an unknown key in the dashboard", dashboard,
			broken(t, dash, `"legendFormat"`, `"legend"`), "unknown field"},
		{"a panel query that does not parse", dashboard,
			broken(t, dash, `sum by (instance, operation, code) (rate(`, `sum by (instance, operation, code (rate(`),
			"parse error"},
		{"a variable the dashboard does not define", dashboard,
			broken(t, dash, `instance=~\"$node\"`, `instance=~\"$host\"`), "$host is not defined"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			errs := checkAll(t, c.file, c.text)
			for _, err := range errs {
				if strings.Contains(err.Error(), c.want) {
					return
				}
			}
			t.Fatalf("want an error containing %q, got %v", c.want, errs)
		})
	}
}

func TestMetricNamesAreTheSelectedSeries(t *testing.T) {
	names, err := MetricNames(`sum(rate(hami_mig_sidecar_a_total{x="1"}[5m])) / ignoring(y) hami_mig_sidecar_b > 0`)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(names, ",") != "hami_mig_sidecar_a_total,hami_mig_sidecar_b" {
		t.Fatalf("got %v", names)
	}
}
