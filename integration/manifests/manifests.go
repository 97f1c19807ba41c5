package manifests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/prometheus/promql/parser"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// What the sidecar's configuration and the node agree on (README, "Configure").
const (
	SidecarContainer = "mig-sidecar"
	PluginContainer  = "device-plugin"
	// The DRA kubelet plugin's container (deploy/dra/daemonset.yaml), in place of PluginContainer.
	DRAPluginContainer = "dra-plugin"
	// The DRA driver's name, and the directories the kubelet plugin helper serves in by default:
	// the driver's own (dra.sock) and the kubelet's registration directory.
	DRADriver          = "mig.hami.io"
	DRAPluginDir       = "/var/lib/kubelet/plugins/" + DRADriver
	DRARegistrationDir = "/var/lib/kubelet/plugins_registry"
	HealthCommand      = "health"
	ServiceName        = "hami.migsidecar.v1.MigSidecar"
	// kubelet removes what it does not know from this directory: never the socket's home.
	DevicePluginDir = "/var/lib/kubelet/device-plugins"
	// The container runtime reads CDI specs from the node's /var/run/cdi.
	CDIDir       = "/var/run/cdi"
	MetricPrefix = "hami_mig_sidecar_"
	// The DRA kubelet plugin's own metrics (its --metrics-address).
	DRAMetricPrefix = "hami_mig_dra_"
	defaultSocket   = "/var/lib/hami/mig-sidecar/sidecar.sock"
	defaultStateDir = "/var/run/hami/dynamic-mig-state"
)

// The alerts (README, "Alerts") and panels (docs/operations.md); a file without one is incomplete.
var (
	RequiredAlerts = []string{
		"HamiMigSidecarTargetDown",
		"HamiMigSidecarErrorInstances",
		"HamiMigSidecarPendingCdiRemovalsGrowing",
		"HamiMigSidecarNvmlErrors",
		"HamiMigSidecarNotRecovered",
		"HamiMigSidecarIdleOlderThanTtl",
		"HamiMigDraPrepareFailures",
	}
	RequiredPanels = []string{
		"Instances by state",
		"Reuse ratio",
		"Creations and reclaims per minute",
		"Allocate latency by outcome",
		"NVML errors by operation",
		"DRA prepares by result",
		"DRA prepare latency",
	}
)

// MeasuredLine is how bench/resident_memory.py prints the figure the DaemonSet's memory is set from,
// and how bench/README.md records it.
var MeasuredLine = regexp.MustCompile(`resident memory, 8 GPUs x 7 instances: ([0-9]+(?:\.[0-9]+)?) MiB`)

// Manifest is one decoded document of deploy/*.yaml.
type Manifest struct {
	File       string
	DaemonSet  *appsv1.DaemonSet
	PromRule   *monitoringv1.PrometheusRule
	PodMonitor *monitoringv1.PodMonitor
	ConfigMap  *corev1.ConfigMap
	// The device plugin's identity and rights, in the chart fixture.
	ServiceAccount     *corev1.ServiceAccount
	ClusterRole        *rbacv1.ClusterRole
	ClusterRoleBinding *rbacv1.ClusterRoleBinding
	// The DRA path's objects (deploy/dra/): its class, the node restriction of its slices, the
	// example claims and pod.
	DeviceClass           *resourcev1.DeviceClass
	ResourceClaimTemplate *resourcev1.ResourceClaimTemplate
	Pod                   *corev1.Pod
	AdmissionPolicy       *admissionregistrationv1.ValidatingAdmissionPolicy
	AdmissionBinding      *admissionregistrationv1.ValidatingAdmissionPolicyBinding
	Kind                  string
	APIVersion            string
}

// DecodeFile decodes every document of a deploy/*.yaml file strictly, by its kind.
func DecodeFile(file string) ([]Manifest, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	return Decode(filepath.Base(file), data)
}

// Decode decodes the YAML documents of data strictly with the type of each one's apiVersion and kind;
// a kind this package does not know is an error, so a new manifest cannot go unchecked.
func Decode(name string, data []byte) ([]Manifest, error) {
	var out []Manifest
	for i, doc := range splitDocuments(data) {
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		m := Manifest{File: name, Kind: meta.Kind, APIVersion: meta.APIVersion}
		var err error
		switch gvk := meta.APIVersion + "/" + meta.Kind; gvk {
		case "apps/v1/DaemonSet":
			m.DaemonSet, err = strict[appsv1.DaemonSet](doc)
		case "monitoring.coreos.com/v1/PrometheusRule":
			m.PromRule, err = strict[monitoringv1.PrometheusRule](doc)
		case "monitoring.coreos.com/v1/PodMonitor":
			m.PodMonitor, err = strict[monitoringv1.PodMonitor](doc)
		case "v1/ConfigMap":
			m.ConfigMap, err = strict[corev1.ConfigMap](doc)
		case "v1/ServiceAccount":
			m.ServiceAccount, err = strict[corev1.ServiceAccount](doc)
		case "rbac.authorization.k8s.io/v1/ClusterRole":
			m.ClusterRole, err = strict[rbacv1.ClusterRole](doc)
		case "rbac.authorization.k8s.io/v1/ClusterRoleBinding":
			m.ClusterRoleBinding, err = strict[rbacv1.ClusterRoleBinding](doc)
		case "resource.k8s.io/v1/DeviceClass":
			m.DeviceClass, err = strict[resourcev1.DeviceClass](doc)
		case "resource.k8s.io/v1/ResourceClaimTemplate":
			m.ResourceClaimTemplate, err = strict[resourcev1.ResourceClaimTemplate](doc)
		case "v1/Pod":
			m.Pod, err = strict[corev1.Pod](doc)
		case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy":
			m.AdmissionPolicy, err = strict[admissionregistrationv1.ValidatingAdmissionPolicy](doc)
		case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding":
			m.AdmissionBinding, err = strict[admissionregistrationv1.ValidatingAdmissionPolicyBinding](doc)
		default:
			err = fmt.Errorf("no type known for %q", gvk)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: document %d (%s): %w", name, i, meta.Kind, err)
		}
		out = append(out, m)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no document", name)
	}
	return out, nil
}

func splitDocuments(data []byte) [][]byte {
	var docs [][]byte
	for _, part := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		if strings.TrimSpace(stripComments(part)) != "" {
			docs = append(docs, []byte(part))
		}
	}
	return docs
}

func stripComments(text string) string {
	var kept []string
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			kept = append(kept, line)
		}
	}
	return strings.Join(kept, "\n")
}

// MeasuredMiB reads the benchmark's figure from text (bench/README.md).
func MeasuredMiB(text []byte) (float64, error) {
	match := MeasuredLine.FindSubmatch(text)
	if match == nil {
		return 0, fmt.Errorf("no line matching %q", MeasuredLine)
	}
	return strconv.ParseFloat(string(match[1]), 64)
}

// -- DaemonSet ----------------------------------------------------------------------------------------

func container(spec *corev1.PodSpec, name string) *corev1.Container {
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i]
		}
	}
	return nil
}

func volume(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

// setting is what the sidecar reads for a flag: the flag in args, else its environment variable, else
// the default (the order of sidecar/config).
func setting(c *corev1.Container, flag, env, fallback string) string {
	args := slices.Concat(c.Command, c.Args)
	for i, arg := range args {
		if arg == flag && i+1 < len(args) {
			return args[i+1]
		}
		if value, ok := strings.CutPrefix(arg, flag+"="); ok {
			return value
		}
	}
	for _, e := range c.Env {
		if e.Name == env {
			return e.Value
		}
	}
	return fallback
}

func within(dir, parent string) bool {
	dir, parent = path.Clean(dir), path.Clean(parent)
	return dir == parent || strings.HasPrefix(dir, parent+"/")
}

// mountOf is the mount of c that holds dir (the deepest one), with the host path under it when the
// volume is a hostPath ("" otherwise).
func mountOf(spec *corev1.PodSpec, c *corev1.Container, dir string) (*corev1.VolumeMount, string) {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		if within(dir, m.MountPath) && (best == nil || len(m.MountPath) > len(best.MountPath)) {
			best = m
		}
	}
	if best == nil {
		return nil, ""
	}
	v := volume(spec, best.Name)
	if v == nil || v.HostPath == nil {
		return best, ""
	}
	rest := strings.TrimPrefix(path.Clean(dir), path.Clean(best.MountPath))
	return best, path.Join(v.HostPath.Path, best.SubPath, rest)
}

// CheckDaemonSet returns every way ds breaks what an operator relies on; measuredMiB is the resident
// memory of a sidecar serving 8 GPUs x 7 instances (bench/resident_memory.py). The sidecar's client
// in the pod is HAMi's device plugin (PluginContainer) or the DRA kubelet plugin
// (DRAPluginContainer), never both: one sidecar, one client per pod.
func CheckDaemonSet(ds *appsv1.DaemonSet, measuredMiB float64) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	spec := &ds.Spec.Template.Spec
	sidecar, plugin, dra := container(spec, SidecarContainer), container(spec, PluginContainer), container(spec, DRAPluginContainer)
	if sidecar == nil || (plugin == nil) == (dra == nil) {
		fail("the pod needs the container %q and one of %q and %q", SidecarContainer, PluginContainer, DRAPluginContainer)
		return errs
	}
	socket := setting(sidecar, "--socket", "HAMI_MIG_SIDECAR_SOCKET", defaultSocket)
	if plugin == nil {
		plugin = dra
		errs = append(errs, checkDRAPlugin(spec, dra, socket)...)
	}

	socketDir := path.Dir(socket)
	sMount, sHost := mountOf(spec, sidecar, socketDir)
	pMount, pHost := mountOf(spec, plugin, socketDir)
	switch {
	case sMount == nil || pMount == nil:
		fail("both containers must mount the socket directory %s", socketDir)
	case sMount.Name != pMount.Name || sHost != pHost:
		fail("the containers mount the socket directory %s from different volumes (%s, %s)",
			socketDir, sMount.Name, pMount.Name)
	case sHost == "":
		fail("the socket directory %s must be a hostPath volume (the plugin of the next pod finds it there)", socketDir)
	}
	for _, dir := range []string{socketDir, sHost} {
		if dir != "" && within(dir, DevicePluginDir) {
			fail("the socket directory %s is under %s, which kubelet wipes", dir, DevicePluginDir)
		}
	}

	stateDir := setting(sidecar, "--state-dir", "HAMI_MIG_SIDECAR_STATE_DIR", defaultStateDir)
	if _, host := mountOf(spec, sidecar, stateDir); host == "" {
		fail("the state directory %s must be on a hostPath volume (the records outlive the container)", stateDir)
	}
	cdiDir := setting(sidecar, "--cdi-dir", "HAMI_MIG_SIDECAR_CDI_DIR", CDIDir)
	if _, host := mountOf(spec, sidecar, cdiDir); path.Clean(host) != CDIDir {
		fail("the CDI directory %s must be the node's %s through a hostPath volume (found %q)", cdiDir, CDIDir, host)
	}

	errs = append(errs, checkProbe("readinessProbe", sidecar.ReadinessProbe, socket, ServiceName)...)
	errs = append(errs, checkProbe("livenessProbe", sidecar.LivenessProbe, socket, "")...)

	strategy := ds.Spec.UpdateStrategy
	switch strategy.Type {
	case appsv1.OnDeleteDaemonSetStrategyType:
	case appsv1.RollingUpdateDaemonSetStrategyType, "":
		if r := strategy.RollingUpdate; r != nil && r.MaxSurge != nil && !zero(*r.MaxSurge) {
			fail("rollingUpdate.maxSurge %s starts the new pod beside the old one: two sidecars on a node",
				r.MaxSurge.String())
		}
		if r := strategy.RollingUpdate; r != nil && r.MaxUnavailable != nil && zero(*r.MaxUnavailable) {
			fail("rollingUpdate.maxUnavailable 0 needs a surge, which would run two sidecars on a node")
		}
	default:
		fail("unknown update strategy %q", strategy.Type)
	}

	errs = append(errs, checkResources(sidecar.Resources, measuredMiB)...)
	errs = append(errs, CheckPodReferences(spec)...)
	return errs
}

// checkDRAPlugin: the DRA plugin serves the kubelet in the node's own plugin directories, where the
// kubelet looks (hostPath at the same path, so the socket paths it registers are the kubelet's too),
// knows its node, whose ResourceSlices alone it may write, dials the sidecar's socket, and, as the
// only client of the pod's sidecar, recovers that sidecar after a restart (nothing else would: every
// Allocate would then be refused NOT_RECOVERED).
func checkDRAPlugin(spec *corev1.PodSpec, dra *corev1.Container, socket string) []error {
	var errs []error
	if got := setting(dra, "--socket", "", defaultSocket); got != socket {
		errs = append(errs, fmt.Errorf("the %s container dials %s, the sidecar serves on %s", DRAPluginContainer, got, socket))
	}
	if !slices.Contains(slices.Concat(dra.Command, dra.Args), "--recover-sidecar") {
		errs = append(errs, fmt.Errorf("the %s container is its sidecar's only client and needs --recover-sidecar, "+
			"or no client recovers a restarted sidecar", DRAPluginContainer))
	}
	for _, dir := range []string{DRAPluginDir, DRARegistrationDir} {
		if m, host := mountOf(spec, dra, dir); m == nil || path.Clean(host) != dir {
			errs = append(errs, fmt.Errorf("the %s container must mount the node's %s at the same path (found %q)",
				DRAPluginContainer, dir, host))
		}
	}
	node := false
	for _, e := range dra.Env {
		if e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName" {
			node = true
		}
	}
	if !node {
		errs = append(errs, fmt.Errorf("the %s container needs NODE_NAME from the pod's spec.nodeName", DRAPluginContainer))
	}
	return errs
}

// CheckPodReferences returns what the API server's validation would refuse in a pod spec that
// decodes: a container or volume name used twice, a mount of a volume the pod does not have, a port
// name used twice in the pod (a PodMonitor picks the port by name).
func CheckPodReferences(spec *corev1.PodSpec) []error {
	var errs []error
	volumes := map[string]bool{}
	for _, v := range spec.Volumes {
		if volumes[v.Name] {
			errs = append(errs, fmt.Errorf("volume %q is defined twice", v.Name))
		}
		volumes[v.Name] = true
	}
	containers, ports := map[string]bool{}, map[string]string{}
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		if containers[c.Name] {
			errs = append(errs, fmt.Errorf("container %q is defined twice", c.Name))
		}
		containers[c.Name] = true
		for _, m := range c.VolumeMounts {
			if !volumes[m.Name] {
				errs = append(errs, fmt.Errorf("container %q mounts volume %q, which the pod does not have", c.Name, m.Name))
			}
		}
		for _, p := range c.Ports {
			if owner, ok := ports[p.Name]; ok && p.Name != "" {
				errs = append(errs, fmt.Errorf("port name %q is used by containers %q and %q", p.Name, owner, c.Name))
			}
			ports[p.Name] = c.Name
		}
	}
	return errs
}

// -- PodMonitor ---------------------------------------------------------------------------------------

// NodeLabel is what the PodMonitor's relabelling reads the node from (the pod's spec.nodeName).
const NodeLabel = "__meta_kubernetes_pod_node_name"

// CheckPodMonitor returns every way pm fails to scrape the sidecar of ds's pods with `instance` set to
// the node: a selector that does not match the pod's labels, no endpoint on the sidecar's metrics
// port, no relabelling of instance from the node name.
func CheckPodMonitor(pm *monitoringv1.PodMonitor, ds *appsv1.DaemonSet) []error {
	var errs []error
	selector, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
	switch {
	case err != nil:
		errs = append(errs, fmt.Errorf("selector: %w", err))
	case selector.Empty() || !selector.Matches(labels.Set(ds.Spec.Template.Labels)):
		errs = append(errs, fmt.Errorf("the selector %s does not match the pods of DaemonSet %s", selector, ds.Name))
	}
	if ns := pm.Spec.NamespaceSelector; !ns.Any && len(ns.MatchNames) > 0 && !slices.Contains(ns.MatchNames, ds.Namespace) {
		errs = append(errs, fmt.Errorf("the namespace selector %v leaves out %s", ns.MatchNames, ds.Namespace))
	}
	sidecar := container(&ds.Spec.Template.Spec, SidecarContainer)
	found := false
	for _, ep := range pm.Spec.PodMetricsEndpoints {
		if ep.Port == nil || sidecar == nil {
			continue
		}
		for _, p := range sidecar.Ports {
			if p.Name == *ep.Port {
				found = true
				if !relabelsInstanceToNode(ep.RelabelConfigs) {
					errs = append(errs, fmt.Errorf("endpoint %s: instance is not relabelled from %s", *ep.Port, NodeLabel))
				}
			}
		}
	}
	if !found {
		errs = append(errs, errors.New("no endpoint scrapes a named port of the mig-sidecar container"))
	}
	return append(errs, checkDRAMetricsEndpoint(pm, ds)...)
}

func relabelsInstanceToNode(configs []monitoringv1.RelabelConfig) bool {
	for _, c := range configs {
		action := strings.ToLower(c.Action)
		target := c.TargetLabel
		if (action == "" || action == "replace") && target == "instance" &&
			len(c.SourceLabels) == 1 && string(c.SourceLabels[0]) == NodeLabel {
			return true
		}
	}
	return false
}

// -- the dashboard's ConfigMap ------------------------------------------------------------------------

// GrafanaDashboardLabel is the label Grafana's dashboard sidecar (the Grafana Helm chart's default)
// loads ConfigMaps by.
const GrafanaDashboardLabel = "grafana_dashboard"

// CheckDashboardConfigMap returns every way cm fails to hand dashboard (the bytes of
// deploy/grafana-dashboard.json) to Grafana's sidecar: no grafana_dashboard label, no .json key, or
// a copy that differs from the dashboard file.
func CheckDashboardConfigMap(cm *corev1.ConfigMap, dashboard []byte) []error {
	var errs []error
	if cm.Labels[GrafanaDashboardLabel] == "" {
		errs = append(errs, fmt.Errorf("ConfigMap %s has no %s label", cm.Name, GrafanaDashboardLabel))
	}
	var keys []string
	for key, value := range cm.Data {
		if !strings.HasSuffix(key, ".json") {
			continue
		}
		keys = append(keys, key)
		var inMap, inFile any
		if err := json.Unmarshal([]byte(value), &inMap); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", key, err))
			continue
		}
		if err := json.Unmarshal(dashboard, &inFile); err != nil {
			errs = append(errs, err)
			continue
		}
		a, _ := json.Marshal(inMap)
		b, _ := json.Marshal(inFile)
		if !bytes.Equal(a, b) {
			errs = append(errs, fmt.Errorf("%s differs from grafana-dashboard.json", key))
		}
	}
	if len(keys) != 1 {
		errs = append(errs, fmt.Errorf("ConfigMap %s needs exactly one .json key, has %v", cm.Name, keys))
	}
	return errs
}

func zero(v intstr.IntOrString) bool {
	return (v.Type == intstr.Int && v.IntVal == 0) || (v.Type == intstr.String && strings.TrimSuffix(v.StrVal, "%") == "0")
}

// checkProbe: the probe runs the sidecar's own health check on its socket, for service ("" = the
// process, which turns NOT_SERVING when NVML or the reconciler is stuck).
func checkProbe(name string, probe *corev1.Probe, socket, service string) []error {
	if probe == nil || probe.Exec == nil {
		return []error{fmt.Errorf("%s: the sidecar needs an exec probe running `hami-mig-sidecar %s`", name, HealthCommand)}
	}
	command := probe.Exec.Command
	var errs []error
	if len(command) < 2 || command[0] != "hami-mig-sidecar" || command[1] != HealthCommand {
		errs = append(errs, fmt.Errorf("%s: runs %q, not `hami-mig-sidecar %s`", name, command, HealthCommand))
	}
	probed := &corev1.Container{Args: command}
	if got := setting(probed, "--socket", "", defaultSocket); got != socket {
		errs = append(errs, fmt.Errorf("%s: asks the socket %s, the sidecar serves on %s", name, got, socket))
	}
	if got := setting(probed, "--service", "", ""); got != service {
		errs = append(errs, fmt.Errorf("%s: asks the health of service %q, want %q", name, got, service))
	}
	if probe.TimeoutSeconds < 2 {
		errs = append(errs, fmt.Errorf("%s: timeoutSeconds %d leaves the CLI no time to start", name, probe.TimeoutSeconds))
	}
	return errs
}

func checkResources(r corev1.ResourceRequirements, measuredMiB float64) []error {
	var errs []error
	measured := measuredMiB * 1024 * 1024
	request, hasRequest := r.Requests[corev1.ResourceMemory]
	limit, hasLimit := r.Limits[corev1.ResourceMemory]
	if _, ok := r.Requests[corev1.ResourceCPU]; !ok {
		errs = append(errs, errors.New("the sidecar requests no CPU"))
	}
	mib := func(q resource.Quantity) float64 { return float64(q.Value()) / 1024 / 1024 }
	switch {
	case !hasRequest || !hasLimit:
		errs = append(errs, errors.New("the sidecar needs a memory request and limit"))
	case float64(request.Value()) < measured:
		errs = append(errs, fmt.Errorf("memory request %.0f MiB is below the measured %.1f MiB", mib(request), measuredMiB))
	case float64(request.Value()) > 2*measured:
		errs = append(errs, fmt.Errorf("memory request %.0f MiB is over twice the measured %.1f MiB", mib(request), measuredMiB))
	case float64(limit.Value()) < 2*measured:
		errs = append(errs, fmt.Errorf("memory limit %.0f MiB leaves less than the measured %.1f MiB again for growth",
			mib(limit), measuredMiB))
	}
	return errs
}

// -- PromQL -------------------------------------------------------------------------------------------

var promql = parser.NewParser(parser.Options{})

// MetricNames parses expr as PromQL and returns the metric names it selects, sorted.
func MetricNames(expr string) ([]string, error) {
	node, err := promql.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		if v, ok := n.(*parser.VectorSelector); ok && v.Name != "" {
			seen[v.Name] = true
		}
		return nil
	})
	names := make([]string, 0, len(seen))
	for name := range seen {
		names = append(names, name)
	}
	sort.Strings(names)
	return names, nil
}

func checkExpr(where, expr string) []error {
	if strings.TrimSpace(expr) == "" {
		return []error{fmt.Errorf("%s: no expression", where)}
	}
	names, err := MetricNames(expr)
	if err != nil {
		return []error{fmt.Errorf("%s: %w", where, err)}
	}
	for _, name := range names {
		// up: the scrape's own series, what the target-down alert reads.
		if strings.HasPrefix(name, MetricPrefix) || strings.HasPrefix(name, DRAMetricPrefix) || name == "up" {
			return nil
		}
	}
	return []error{fmt.Errorf("%s: names no %s* or %s* metric", where, MetricPrefix, DRAMetricPrefix)}
}

// -- PrometheusRule -----------------------------------------------------------------------------------

// CheckRules returns every way rule breaks: an expression that does not parse or names none of the
// sidecar's metrics, an alert without severity, summary or description, a required alert missing.
func CheckRules(rule *monitoringv1.PrometheusRule) []error {
	var errs []error
	alerts := map[string]bool{}
	for _, group := range rule.Spec.Groups {
		for i, r := range group.Rules {
			where := fmt.Sprintf("group %s rule %d (%s%s)", group.Name, i, r.Alert, r.Record)
			if (r.Alert == "") == (r.Record == "") {
				errs = append(errs, fmt.Errorf("%s: exactly one of alert and record", where))
			}
			errs = append(errs, checkExpr(where, r.Expr.String())...)
			if r.Alert == "" {
				continue
			}
			alerts[r.Alert] = true
			if r.Labels["severity"] == "" {
				errs = append(errs, fmt.Errorf("%s: no severity label", where))
			}
			for _, key := range []string{"summary", "description"} {
				if strings.TrimSpace(r.Annotations[key]) == "" {
					errs = append(errs, fmt.Errorf("%s: no %s annotation", where, key))
				}
			}
		}
	}
	for _, name := range RequiredAlerts {
		if !alerts[name] {
			errs = append(errs, fmt.Errorf("alert %s is missing", name))
		}
	}
	return errs
}

// -- Grafana dashboard --------------------------------------------------------------------------------

// Dashboard is the part of Grafana's dashboard model deploy/grafana-dashboard.json uses; it is decoded
// with unknown fields refused, so a misspelt key fails instead of being ignored by Grafana.
type Dashboard struct {
	Title         string          `json:"title"`
	UID           string          `json:"uid"`
	Description   string          `json:"description"`
	Tags          []string        `json:"tags"`
	Editable      bool            `json:"editable"`
	SchemaVersion int             `json:"schemaVersion"`
	Version       int             `json:"version"`
	Refresh       string          `json:"refresh"`
	Time          json.RawMessage `json:"time"`
	Timezone      string          `json:"timezone"`
	Templating    struct {
		List []Variable `json:"list"`
	} `json:"templating"`
	Annotations json.RawMessage `json:"annotations"`
	Panels      []Panel         `json:"panels"`
}

// Datasource is a Grafana panel's or variable's data source.
type Datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// Variable is one of the dashboard's template variables.
type Variable struct {
	Name       string          `json:"name"`
	Label      string          `json:"label"`
	Type       string          `json:"type"`
	Datasource *Datasource     `json:"datasource,omitempty"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition,omitempty"`
	IncludeAll bool            `json:"includeAll,omitempty"`
	AllValue   string          `json:"allValue,omitempty"`
	Multi      bool            `json:"multi,omitempty"`
	Refresh    int             `json:"refresh,omitempty"`
	Current    json.RawMessage `json:"current"`
	Hide       int             `json:"hide"`
}

// Panel is one panel of the dashboard.
type Panel struct {
	Type        string          `json:"type"`
	Title       string          `json:"title"`
	Description string          `json:"description"`
	ID          int             `json:"id"`
	Datasource  Datasource      `json:"datasource"`
	GridPos     json.RawMessage `json:"gridPos"`
	FieldConfig json.RawMessage `json:"fieldConfig"`
	Options     json.RawMessage `json:"options"`
	Targets     []Target        `json:"targets"`
}

// Target is one query of a panel.
type Target struct {
	Datasource   Datasource `json:"datasource"`
	Expr         string     `json:"expr"`
	LegendFormat string     `json:"legendFormat"`
	RefID        string     `json:"refId"`
}

// DecodeDashboard decodes data strictly (an unknown field fails; so does trailing content).
func DecodeDashboard(data []byte) (*Dashboard, error) {
	decoder := json.NewDecoder(bytes.NewReader(data))
	decoder.DisallowUnknownFields()
	var d Dashboard
	if err := decoder.Decode(&d); err != nil {
		return nil, err
	}
	if decoder.More() {
		return nil, errors.New("content after the dashboard object")
	}
	return &d, nil
}

// grafanaVariables stand in for what Grafana substitutes before the query reaches Prometheus.
var grafanaVariables = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "${datasource}", "x")

// CheckDashboard returns every way d breaks: a panel without a query, a query that does not parse as
// PromQL (Grafana's variables substituted) or names none of the sidecar's metrics, a variable used
// but not defined, a required panel missing.
func CheckDashboard(d *Dashboard) []error {
	var errs []error
	defined := map[string]bool{}
	for _, v := range d.Templating.List {
		defined[v.Name] = true
	}
	variable := regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)`)
	used := func(where, text string) {
		for _, m := range variable.FindAllStringSubmatch(text, -1) {
			if !strings.HasPrefix(m[1], "__") && !defined[m[1]] {
				errs = append(errs, fmt.Errorf("%s: variable $%s is not defined", where, m[1]))
			}
		}
	}
	titles := map[string]bool{}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		where := fmt.Sprintf("panel %q", p.Title)
		if titles[p.Title] || ids[p.ID] {
			errs = append(errs, fmt.Errorf("%s: title or id %d used twice", where, p.ID))
		}
		titles[p.Title], ids[p.ID] = true, true
		if strings.TrimSpace(p.Description) == "" {
			errs = append(errs, fmt.Errorf("%s: no description", where))
		}
		if len(p.Targets) == 0 {
			errs = append(errs, fmt.Errorf("%s: no query", where))
		}
		for _, t := range p.Targets {
			used(where, t.Expr)
			expr := grafanaVariables.Replace(t.Expr)
			for name := range defined {
				expr = strings.ReplaceAll(expr, "$"+name, ".*")
			}
			errs = append(errs, checkExpr(fmt.Sprintf("%s query %s", where, t.RefID), expr)...)
		}
	}
	for _, v := range d.Templating.List {
		used("variable "+v.Name, string(v.Query))
	}
	for _, title := range RequiredPanels {
		if !titles[title] {
			errs = append(errs, fmt.Errorf("panel %q is missing", title))
		}
	}
	return errs
}

// strict decodes doc into a new T, refusing a field T does not have.
func strict[T any](doc []byte) (*T, error) {
	v := new(T)
	if err := yaml.UnmarshalStrict(doc, v); err != nil {
		return nil, err
	}
	return v, nil
}

// -- the DRA path's class and example claims ----------------------------------------------------------

// DRAAttributes and DRACapacities are what the plugin publishes per device, under the driver's domain.
var (
	DRAAttributes = []string{"profile", "gpuUUID", "placementStart", "placementSize", "warm"}
	DRACapacities = []string{"memory"}
	driverField   = regexp.MustCompile(`device\.(attributes|capacity)\["([^"]+)"\]\.(\w+)`)
)

// CheckDRA returns every way the DRA path's objects (deploy/dra/ and its examples, decoded together)
// miss the driver: a DeviceClass mig.hami.io that does not select the driver, a claim's request on
// another class or on an attribute or capacity the plugin does not publish, a pod whose claim names
// a template that is not there or that no container uses.
func CheckDRA(docs []Manifest) []error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	templates, class := map[string]bool{}, false
	for _, m := range docs {
		if m.ResourceClaimTemplate != nil {
			templates[m.ResourceClaimTemplate.Name] = true
		}
		if c := m.DeviceClass; c != nil && c.Name == DRADriver {
			class = true
			if len(c.Spec.Selectors) != 1 || c.Spec.Selectors[0].CEL == nil ||
				strings.TrimSpace(c.Spec.Selectors[0].CEL.Expression) != `device.driver == "`+DRADriver+`"` {
				fail("DeviceClass %s must select exactly the driver's devices", DRADriver)
			}
		}
	}
	if !class {
		fail("no DeviceClass %s", DRADriver)
	}
	for _, m := range docs {
		if t := m.ResourceClaimTemplate; t != nil {
			for _, r := range t.Spec.Spec.Devices.Requests {
				errs = append(errs, checkDRARequest(t.Name, r)...)
			}
		}
		if p := m.Pod; p != nil {
			used := map[string]bool{}
			for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
				for _, claim := range c.Resources.Claims {
					used[claim.Name] = true
				}
			}
			for _, rc := range p.Spec.ResourceClaims {
				if name := rc.ResourceClaimTemplateName; name != nil && !templates[*name] {
					fail("pod %s: claim %s names the template %s, which is not among the examples", p.Name, rc.Name, *name)
				}
				if !used[rc.Name] {
					fail("pod %s: no container uses the claim %s", p.Name, rc.Name)
				}
			}
		}
	}
	return errs
}

func checkDRARequest(template string, r resourcev1.DeviceRequest) []error {
	type sub struct {
		name, class string
		selectors   []resourcev1.DeviceSelector
	}
	var subs []sub
	if r.Exactly != nil {
		subs = append(subs, sub{r.Name, r.Exactly.DeviceClassName, r.Exactly.Selectors})
	}
	for _, s := range r.FirstAvailable {
		subs = append(subs, sub{r.Name + "/" + s.Name, s.DeviceClassName, s.Selectors})
	}
	var errs []error
	for _, s := range subs {
		if s.class != DRADriver {
			errs = append(errs, fmt.Errorf("template %s, request %s: device class %q, not %s", template, s.name, s.class, DRADriver))
		}
		for _, sel := range s.selectors {
			if sel.CEL == nil {
				continue
			}
			for _, m := range driverField.FindAllStringSubmatch(sel.CEL.Expression, -1) {
				known := DRAAttributes
				if m[1] == "capacity" {
					known = DRACapacities
				}
				if m[2] != DRADriver || !slices.Contains(known, m[3]) {
					errs = append(errs, fmt.Errorf("template %s, request %s: %s %s/%s is not one the plugin publishes",
						template, s.name, m[1], m[2], m[3]))
				}
			}
		}
	}
	return errs
}
