package manifests

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

// helmTemplate renders the chart in dir (under deploy/) as `helm template hami-mig-dra` in
// kube-system with args; it returns helm's output and stderr, and its error.
func helmTemplate(t *testing.T, dir string, args ...string) ([]byte, string, error) {
	t.Helper()
	helm := tool(t, "helm")
	cmd := exec.Command(helm, slices.Concat([]string{"template", "hami-mig-dra", dir, "--namespace", PluginNamespace}, args)...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	return out, stderr.String(), err
}

func rendered(t *testing.T, args ...string) []byte {
	t.Helper()
	out, stderr, err := helmTemplate(t, filepath.Join(deployDir, DRAChart), args...)
	if err != nil {
		t.Fatalf("helm template %s %q: %v\n%s", DRAChart, args, err, stderr)
	}
	return out
}

// rawDRA is the objects of the raw files the chart renders with its defaults; replace changes one
// file's text first (a broken copy).
func rawDRA(t *testing.T, replace func(name, text string) string) map[string]map[string]any {
	t.Helper()
	all := map[string]map[string]any{}
	for _, name := range DRAChartFiles {
		text := read(t, name)
		if replace != nil {
			text = replace(name, text)
		}
		objs, err := Objects(name, []byte(text))
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range objs {
			all[k] = v
		}
	}
	return all
}

func renderedObjects(t *testing.T, args ...string) map[string]map[string]any {
	t.Helper()
	objs, err := Objects("the rendered chart", rendered(t, args...))
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// The chart with its defaults is deploy/dra/'s three files, object for object, and passes the
// checks those files pass; a raw file that drifted from the chart is found.
func TestTheDRAChartRendersTheRawManifestsWithItsDefaults(t *testing.T) {
	got := renderedObjects(t)
	for _, err := range SameObjects(rawDRA(t, nil), got) {
		t.Errorf("deploy/%s against deploy/dra/*.yaml: %v", DRAChart, err)
	}
	if len(got) != 9 {
		t.Errorf("rendered %d objects, want the ServiceAccount, ClusterRole, binding, node policy, its binding, DeviceClass, "+
			"adminAccess policy, its binding and DaemonSet", len(got))
	}
	docs, err := Decode("the rendered chart", rendered(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range CheckDRA(docs) {
		t.Errorf("the rendered chart: %v", err)
	}
	for _, m := range docs {
		if m.DaemonSet != nil {
			for _, err := range CheckDaemonSet(m.DaemonSet, measured(t)) {
				t.Errorf("the rendered DaemonSet: %v", err)
			}
		}
	}

	drifted := SameObjects(rawDRA(t, func(name, text string) string {
		if name != draDaemonSet {
			return text
		}
		return broken(t, text, "limits: {memory: 256Mi}", "limits: {memory: 512Mi}")
	}), got)
	if len(drifted) != 1 || !strings.Contains(drifted[0].Error(), "containers[1].resources.limits.memory (512Mi against 256Mi) differs") {
		t.Errorf("a raw DaemonSet whose sidecar memory limit drifted from the chart: %v", drifted)
	}
}

func renderedDaemonSet(t *testing.T, args ...string) *appsv1.DaemonSet {
	t.Helper()
	docs, err := Decode("the rendered chart", rendered(t, args...))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range docs {
		if m.DaemonSet != nil {
			return m.DaemonSet
		}
	}
	t.Fatal("no DaemonSet rendered")
	return nil
}

// The values reach the pod: images, GPUs, node selector, metrics on other ports or none, and the
// namespace in the node restriction's user; the result still passes the DaemonSet's checks and is
// scraped by deploy/podmonitor.yaml.
func TestTheDRAChartsValuesReachThePod(t *testing.T) {
	ds := renderedDaemonSet(t, "--set", "image.plugin.repository=registry.example/dra", "--set", "image.plugin.tag=1.2.3",
		"--set", "image.sidecar.tag=1.2.4", "--set", "image.pullPolicy=Always", "--set", "gpus={GPU-a,3}",
		"--set", "nodeSelector.pool=mig", "--set", "metrics.pluginPort=9500", "--set", "metrics.sidecarPort=9501")
	spec := &ds.Spec.Template.Spec
	plugin, sidecar := container(spec, DRAPluginContainer), container(spec, SidecarContainer)
	if plugin.Image != "registry.example/dra:1.2.3" || sidecar.Image != "ghcr.io/project-hami/hami-mig-sidecar:1.2.4" ||
		plugin.ImagePullPolicy != "Always" || sidecar.ImagePullPolicy != "Always" {
		t.Errorf("images %s (%s), %s (%s)", plugin.Image, plugin.ImagePullPolicy, sidecar.Image, sidecar.ImagePullPolicy)
	}
	if got := setting(plugin, "--gpus", "", ""); got != "GPU-a,3" {
		t.Errorf("--gpus %q, want GPU-a,3", got)
	}
	if spec.NodeSelector["pool"] != "mig" || spec.NodeSelector["mig.hami.io/dra"] != "true" {
		t.Errorf("nodeSelector %v", spec.NodeSelector)
	}
	if got := setting(plugin, "--metrics-address", "", ""); got != "0.0.0.0:9500" || plugin.Ports[0].ContainerPort != 9500 {
		t.Errorf("the plugin's metrics on %q, port %v", got, plugin.Ports)
	}
	if got := setting(sidecar, "--metrics-address", "HAMI_MIG_SIDECAR_METRICS_ADDRESS", ""); got != "0.0.0.0:9501" || sidecar.Ports[0].ContainerPort != 9501 {
		t.Errorf("the sidecar's metrics on %q, port %v", got, sidecar.Ports)
	}
	for _, err := range CheckDaemonSet(ds, measured(t)) {
		t.Errorf("the DaemonSet with values: %v", err)
	}
	pm, err := Decode(podMonitor, []byte(read(t, podMonitor)))
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range CheckPodMonitor(pm[0].PodMonitor, ds) {
		t.Errorf("the PodMonitor on the DaemonSet with values: %v", err)
	}

	quiet := renderedDaemonSet(t, "--set", "metrics.enabled=false")
	spec = &quiet.Spec.Template.Spec
	plugin, sidecar = container(spec, DRAPluginContainer), container(spec, SidecarContainer)
	if setting(plugin, "--metrics-address", "", "") != "" || setting(sidecar, "", "HAMI_MIG_SIDECAR_METRICS_ADDRESS", "") != "" ||
		len(plugin.Ports)+len(sidecar.Ports) != 0 || len(quiet.Spec.Template.Annotations) != 0 {
		t.Errorf("metrics.enabled=false still serves metrics: %v %v %v", plugin.Args, sidecar.Env, quiet.Spec.Template.Annotations)
	}

	other, err := Objects("the chart in hami-system", rendered(t, "--namespace", "hami-system"))
	if err != nil {
		t.Fatal(err)
	}
	policy, _ := json.Marshal(other["ValidatingAdmissionPolicy <nil>/hami-mig-dra-resourceslices"])
	if !strings.Contains(string(policy), `request.userInfo.username == \"system:serviceaccount:hami-system:hami-mig-dra\"`) {
		t.Errorf("in hami-system the node restriction does not match the plugin's account: %s", policy)
	}
}

// Values of the wrong type or name are refused by the chart's schema before anything renders, and
// a broken copy of the chart fails the checks its rendering passes.
func TestTheDRAChartRefusesBrokenValuesAndCopies(t *testing.T) {
	for _, c := range []struct {
		what string
		args []string
		want string
	}{
		{"GPUs as one string", []string{"--set", "gpus=GPU-a"}, "at '/gpus': got string, want array"},
		{"a GPU naming two", []string{"--set-string", "gpus={GPU-a GPU-b}"}, "/gpus/0"},
		{"a port out of range", []string{"--set", "metrics.pluginPort=70000"}, "/metrics/pluginPort"},
		{"a misspelt value", []string{"--set", "nodeSelecter.pool=mig"}, "additional properties 'nodeSelecter' not allowed"},
		{"an empty image tag", []string{"--set", "image.sidecar.tag="}, "/image/sidecar/tag"},
	} {
		_, stderr, err := helmTemplate(t, filepath.Join(deployDir, DRAChart), c.args...)
		if err == nil || !strings.Contains(stderr, c.want) {
			t.Errorf("%s: helm answered %v %q, want a refusal with %q", c.what, err, stderr, c.want)
		}
	}

	// A copy of the chart whose DaemonSet surges: it renders, and the check refuses it.
	dir := filepath.Join(t.TempDir(), "chart")
	if err := os.CopyFS(dir, os.DirFS(filepath.Join(deployDir, DRAChart))); err != nil {
		t.Fatal(err)
	}
	template := filepath.Join(dir, "templates", "daemonset.yaml")
	text, err := os.ReadFile(template)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(template, []byte(broken(t, string(text), "maxSurge: 0", "maxSurge: 1")), 0o600); err != nil {
		t.Fatal(err)
	}
	out, stderr, err := helmTemplate(t, dir)
	if err != nil {
		t.Fatalf("the broken copy does not render: %v\n%s", err, stderr)
	}
	docs, err := Decode("the broken copy", out)
	if err != nil {
		t.Fatal(err)
	}
	var errs []string
	for _, m := range docs {
		if m.DaemonSet != nil {
			for _, err := range CheckDaemonSet(m.DaemonSet, measured(t)) {
				errs = append(errs, err.Error())
			}
		}
	}
	if !strings.Contains(strings.Join(errs, "\n"), "two sidecars") {
		t.Errorf("a chart whose DaemonSet surges: %q", errs)
	}
}
