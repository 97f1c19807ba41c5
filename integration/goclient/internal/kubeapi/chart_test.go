package kubeapi_test

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
)

// draChart is the DRA path's Helm chart (its default rendering is deploy/dra/'s files; integration/manifests).
const draChart = "deploy/dra/chart"

// renderDRAChart is `helm template hami-mig-dra deploy/dra/chart` in kube-system with args.
func renderDRAChart(t *testing.T, args ...string) []byte {
	t.Helper()
	helm := kubeapi.Tool(t, "helm", "make go-plugins")
	cmd := exec.Command(helm, slices.Concat([]string{"template", "hami-mig-dra", draChart, "--namespace", kubeapi.PluginNamespace}, args)...)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template %s %q: %v\n%s", draChart, args, err, stderr.String())
	}
	return out
}

// TestTheDRAChartPassesAServerSideDryRun applies what the chart renders, with its defaults and with
// every value set, by server-side dry-run: the server's validation, defaulting and admission
// (the ValidatingAdmissionPolicy's CEL is compiled there). Broken renderings are refused: a value
// the chart's schema lets through but the server does not, a policy whose CEL does not compile, a
// DaemonSet whose selector misses its pods.
func TestTheDRAChartPassesAServerSideDryRun(t *testing.T) {
	s := kubeapi.Get(t)
	a := newApplier(t, s)
	dryRun := func(what string, data []byte) []string {
		var errs []string
		kinds := map[string]int{}
		for _, obj := range objects(t, what, data) {
			kinds[obj.GetKind()]++
			if err := a.apply(obj, true); err != nil {
				errs = append(errs, obj.GetKind()+" "+obj.GetName()+": "+err.Error())
			}
		}
		if len(kinds) != 7 {
			t.Errorf("%s rendered %v, want the DaemonSet, its RBAC and policy, and the DeviceClass", what, kinds)
		}
		return errs
	}
	defaults := renderDRAChart(t)
	for name, data := range map[string][]byte{
		"the defaults": defaults,
		"every value": renderDRAChart(t, "--set", "image.plugin.repository=registry.example/dra", "--set", "image.plugin.tag=1.2.3",
			"--set", "image.sidecar.tag=1.2.4", "--set", "image.pullPolicy=IfNotPresent", "--set", "gpus={GPU-a,3}",
			"--set", "nodeSelector.pool=mig", "--set", "tolerations[0].key=nvidia.com/gpu", "--set", "tolerations[0].operator=Exists",
			"--set", "tolerations[0].effect=NoSchedule", "--set", "metrics.pluginPort=9500", "--set", "metrics.sidecarPort=9501"),
		"no metrics": renderDRAChart(t, "--set", "metrics.enabled=false"),
	} {
		if errs := dryRun(name, data); len(errs) > 0 {
			t.Errorf("the chart with %s: %s", name, strings.Join(errs, "\n"))
		}
	}

	for _, c := range []struct {
		what     string
		rendered []byte
		refusal  string
	}{
		{"a node selector key the API refuses", renderDRAChart(t, "--set", "nodeSelector.not a label=x"), "spec.template.spec.nodeSelector"},
		{"a toleration the API refuses", renderDRAChart(t, "--set", "tolerations[0].operator=Exists", "--set", "tolerations[0].value=x"),
			"value must be empty when `operator` is 'Exists'"},
		{"a node-restriction policy whose CEL does not compile", broken(t, defaults, `variables.userNode != ""`, `variables.userNode !== ""`),
			"compilation failed"},
		{"a DaemonSet whose selector misses its pods", broken(t, defaults,
			"      labels:\n        app.kubernetes.io/name: hami-mig-dra\n        app.kubernetes.io/component",
			"      labels:\n        app.kubernetes.io/name: other\n        app.kubernetes.io/component"), "does not match template"},
	} {
		errs := dryRun(c.what, c.rendered)
		if len(errs) == 0 || !strings.Contains(strings.Join(errs, "\n"), c.refusal) {
			t.Errorf("%s: the server answered %q, want a refusal with %q", c.what, errs, c.refusal)
		}
		t.Logf("%s: %s", c.what, strings.Join(errs, "; "))
	}
}
