package manifests

import (
	"fmt"
	"reflect"
	"sort"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// The DRA path's Helm chart (deploy/dra/chart): with its default values, rendered in PluginNamespace,
// it is the raw manifests of deploy/dra/ (DRAChartFiles), object for object. The two are kept equal by
// hand, not generated, so that the raw files keep their comments; SameObjects is the check.
const (
	DRAChart        = "dra/chart"
	PluginNamespace = "kube-system"
)

// DRAChartFiles are the files of deploy/ the chart renders with its defaults.
var DRAChartFiles = []string{"dra/rbac.yaml", "dra/deviceclass.yaml", "dra/daemonset.yaml"}

// objectKey names an object: kind, namespace and name.
func objectKey(obj map[string]any) string {
	meta, _ := obj["metadata"].(map[string]any)
	return fmt.Sprintf("%v %v/%v", obj["kind"], meta["namespace"], meta["name"])
}

// Objects decodes the YAML documents of data as generic objects by key (kind namespace/name).
func Objects(name string, data []byte) (map[string]map[string]any, error) {
	out := map[string]map[string]any{}
	for i, doc := range splitDocuments(data) {
		var obj map[string]any
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		if len(obj) == 0 {
			continue
		}
		key := objectKey(obj)
		if _, twice := out[key]; twice {
			return nil, fmt.Errorf("%s: %s twice", name, key)
		}
		out[key] = obj
	}
	return out, nil
}

// SameObjects returns every difference between the objects of want and got: an object in one only,
// or a field whose value differs (by its path). YAML's spelling (comments, flow or block style,
// quoting) is not a difference.
func SameObjects(want, got map[string]map[string]any) []error {
	var errs []error
	keys := map[string]bool{}
	for k := range want {
		keys[k] = true
	}
	for k := range got {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		w, inWant := want[k]
		g, inGot := got[k]
		switch {
		case !inGot:
			errs = append(errs, fmt.Errorf("%s: missing", k))
		case !inWant:
			errs = append(errs, fmt.Errorf("%s: not expected", k))
		default:
			for _, path := range differences("", w, g) {
				errs = append(errs, fmt.Errorf("%s: %s differs", k, path))
			}
		}
	}
	return errs
}

// differences are the paths under which a and b differ.
func differences(path string, a, b any) []string {
	am, aMap := a.(map[string]any)
	bm, bMap := b.(map[string]any)
	if aMap && bMap {
		var out []string
		keys := map[string]bool{}
		for k := range am {
			keys[k] = true
		}
		for k := range bm {
			keys[k] = true
		}
		for k := range keys {
			out = append(out, differences(path+"."+k, am[k], bm[k])...)
		}
		sort.Strings(out)
		return out
	}
	al, aList := a.([]any)
	bl, bList := b.([]any)
	if aList && bList && len(al) == len(bl) {
		var out []string
		for i := range al {
			out = append(out, differences(fmt.Sprintf("%s[%d]", path, i), al[i], bl[i])...)
		}
		return out
	}
	if reflect.DeepEqual(a, b) {
		return nil
	}
	return []string{fmt.Sprintf("%s (%s against %s)", strings.TrimPrefix(path, "."), brief(a), brief(b))}
}

func brief(v any) string {
	s := fmt.Sprint(v)
	if len(s) > 80 {
		s = s[:77] + "..."
	}
	return s
}

// checkDRAMetricsEndpoint: where ds runs the DRA plugin with a named port (its --metrics-address), an
// endpoint of pm scrapes that port with `instance` set to the node, as for the sidecar.
func checkDRAMetricsEndpoint(pm *monitoringv1.PodMonitor, ds *appsv1.DaemonSet) []error {
	dra := container(&ds.Spec.Template.Spec, DRAPluginContainer)
	if dra == nil {
		return nil
	}
	var errs []error
	for _, p := range dra.Ports {
		if p.Name == "" {
			errs = append(errs, fmt.Errorf("the %s container's port %d has no name for the PodMonitor", DRAPluginContainer, p.ContainerPort))
			continue
		}
		found := false
		for _, ep := range pm.Spec.PodMetricsEndpoints {
			if ep.Port != nil && *ep.Port == p.Name {
				found = true
				if !relabelsInstanceToNode(ep.RelabelConfigs) {
					errs = append(errs, fmt.Errorf("endpoint %s: instance is not relabelled from %s", p.Name, NodeLabel))
				}
			}
		}
		if !found {
			errs = append(errs, fmt.Errorf("no endpoint scrapes the %s container's port %s", DRAPluginContainer, p.Name))
		}
	}
	return errs
}
