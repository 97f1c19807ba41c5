package manifests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
)

const (
	repoRoot     = "../.."
	chartFixture = "integration/manifests/testdata/hami-shaped-chart"
	installMark  = "helm upgrade --install "
)

// tool finds a Go-installed binary on PATH or in GOPATH/bin (where `make go-plugins` and .ci/run put
// helm and kustomize); without it the test skips, except under CI, where it fails.
func tool(t *testing.T, name string) string {
	t.Helper()
	if found, err := exec.LookPath(name); err == nil {
		return found
	}
	if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		candidate := filepath.Join(strings.TrimSpace(string(out)), "bin", name)
		if _, err := os.Stat(candidate); err == nil {
			return candidate
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("%s not found (scripts/go-plugins.txt pins it; .ci/run installs it)", name)
	}
	t.Skipf("%s not found: `make go-plugins` installs it", name)
	return ""
}

// installCommand is the README's install command, its continuation lines joined, split into words.
func installCommand(t *testing.T) []string {
	t.Helper()
	text, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var joined []string
	found := 0
	lines := strings.Split(string(text), "\n")
	for i := 0; i < len(lines); i++ {
		if !strings.HasPrefix(lines[i], installMark) {
			continue
		}
		found++
		for ; i < len(lines); i++ {
			line := strings.TrimSpace(lines[i])
			joined = append(joined, strings.TrimSuffix(line, `\`))
			if !strings.HasSuffix(line, `\`) {
				break
			}
		}
	}
	if found != 1 {
		t.Fatalf("README.md: want one line starting %q, found %d", installMark, found)
	}
	return strings.Fields(strings.Join(joined, " "))
}

// asTemplate turns `helm upgrade --install RELEASE CHART FLAGS...` into `helm template RELEASE FIXTURE
// FLAGS...`: the same release name, flags and post-renderer, rendered offline from the chart fixture.
func asTemplate(t *testing.T, words []string) []string {
	t.Helper()
	if len(words) < 5 || words[0] != "helm" || words[1] != "upgrade" || words[2] != "--install" {
		t.Fatalf("not a helm upgrade --install command: %q", words)
	}
	return slices.Concat([]string{"template", words[3], chartFixture}, words[5:])
}

func flag(words []string, name string) string {
	for i, w := range words {
		if w == name && i+1 < len(words) {
			return words[i+1]
		}
		if value, ok := strings.CutPrefix(w, name+"="); ok {
			return value
		}
	}
	return ""
}

func TestTheReadmeInstallCommandAddsTheSidecarToTheChartsDaemonSet(t *testing.T) {
	helm, kustomize := tool(t, "helm"), tool(t, "kustomize")
	words := installCommand(t)
	args := asTemplate(t, words)
	for _, required := range []string{"--post-renderer", "--namespace"} {
		if flag(words, required) == "" {
			t.Fatalf("the README's command has no %s: %q", required, words)
		}
	}
	cmd := exec.Command(helm, args...)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(kustomize)+string(os.PathListSeparator)+os.Getenv("PATH"),
		"HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}

	docs, err := Decode("rendered", out)
	if err != nil {
		t.Fatal(err)
	}
	var plugin, mock *appsv1.DaemonSet
	for _, m := range docs {
		if m.DaemonSet == nil {
			if m.ServiceAccount == nil && m.ClusterRole == nil && m.ClusterRoleBinding == nil {
				t.Fatalf("the fixture renders DaemonSets and the plugin's RBAC, got %s", m.Kind)
			}
			continue
		}
		switch m.DaemonSet.Labels["app.kubernetes.io/component"] {
		case "hami-device-plugin":
			plugin = m.DaemonSet
		case "hami-mock-device-plugin":
			mock = m.DaemonSet
		}
	}
	if plugin == nil || mock == nil {
		t.Fatalf("want the device-plugin and the mock DaemonSets, got %d documents", len(docs))
	}

	// What the chart rendered is still there: name, selector, its containers and their commands.
	release := words[3]
	if plugin.Name != release+"-device-plugin" || plugin.Namespace != flag(words, "--namespace") {
		t.Errorf("the DaemonSet is %s/%s, the chart names it %s/%s-device-plugin",
			plugin.Namespace, plugin.Name, flag(words, "--namespace"), release)
	}
	if got := plugin.Spec.Selector.MatchLabels["app.kubernetes.io/instance"]; got != release {
		t.Errorf("selector changed: %v", plugin.Spec.Selector.MatchLabels)
	}
	spec := &plugin.Spec.Template.Spec
	var names []string
	for _, c := range spec.Containers {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{PluginContainer, SidecarContainer, "vgpu-monitor"}) {
		t.Errorf("containers %v: want the chart's device-plugin and vgpu-monitor, and %s", names, SidecarContainer)
	}
	pluginC, sidecar := container(spec, PluginContainer), container(spec, SidecarContainer)
	if pluginC == nil || sidecar == nil {
		t.Fatal("a container is missing")
	}
	if len(pluginC.Command) == 0 || pluginC.Command[0] != "nvidia-device-plugin" {
		t.Errorf("the plugin's command changed: %q", pluginC.Command)
	}
	if got := setting(pluginC, "", "HAMI_MIG_SIDECAR_SOCKET", ""); got != setting(sidecar, "--socket", "HAMI_MIG_SIDECAR_SOCKET", defaultSocket) {
		t.Errorf("the plugin's HAMI_MIG_SIDECAR_SOCKET %q is not the sidecar's socket", got)
	}
	if image := flag(words, "--post-renderer-args"); image == "" || sidecar.Image != image {
		t.Errorf("the sidecar's image is %q, the command asks for %q", sidecar.Image, image)
	}
	for _, err := range CheckDaemonSet(plugin, measured(t)) {
		t.Errorf("rendered DaemonSet: %v", err)
	}

	// The PodMonitor of deploy/ scrapes what was rendered; the mock plugin is not touched.
	pm, err := Decode(podMonitor, []byte(read(t, podMonitor)))
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range CheckPodMonitor(pm[0].PodMonitor, plugin) {
		t.Errorf("podmonitor on the rendered DaemonSet: %v", err)
	}
	if container(&mock.Spec.Template.Spec, SidecarContainer) != nil || len(mock.Spec.Template.Spec.Volumes) != 0 {
		t.Errorf("the mock device plugin's DaemonSet was patched too")
	}
}

// The post-renderer adds nothing to a release that has no device-plugin DaemonSet of the chart: its
// patch is matched by the chart's label, never by a name it would have to guess.
func TestThePostRendererLeavesOtherDaemonSetsAlone(t *testing.T) {
	kustomize := tool(t, "kustomize")
	input := read(t, daemonSet)
	cmd := exec.Command(filepath.Join(repoRoot, "deploy/helm/post-render"))
	cmd.Env = append(os.Environ(), "KUSTOMIZE="+kustomize)
	// The standalone example's DaemonSet metadata has no component label (only its pods do).
	cmd.Stdin = strings.NewReader(input)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("post-render: %v\n%s", err, stderr.String())
	}
	docs, err := Decode("rendered", out)
	if err != nil {
		t.Fatal(err)
	}
	before := standalone(t, daemonSet)
	after := docs[0].DaemonSet
	if len(after.Spec.Template.Spec.Containers) != len(before.Spec.Template.Spec.Containers) ||
		len(after.Spec.Template.Spec.Volumes) != len(before.Spec.Template.Spec.Volumes) {
		t.Fatalf("a DaemonSet without the chart's component label was patched")
	}
}
