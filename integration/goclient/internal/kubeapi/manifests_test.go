package kubeapi_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/annotation"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/hami/kube"
	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/kubeapi"
)

const (
	repoRoot     = "../../../.."
	chartFixture = "integration/manifests/testdata/hami-shaped-chart"
	// The CRDs of PodMonitor and PrometheusRule, from prometheus-operator's own module: its example/
	// directory holds them as the operator installs them. v0.85.0 is the newest version of that
	// module on the module proxy (the API types, integration/manifests, come from its newer
	// pkg/apis/monitoring module); monitoring.coreos.com/v1 is the same API in both.
	operatorModule = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
	operatorCRDs   = "example/prometheus-operator-crd"
)

// objects reads the YAML documents of data as unstructured objects.
func objects(t *testing.T, name string, data []byte) []*unstructured.Unstructured {
	t.Helper()
	var out []*unstructured.Unstructured
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var obj map[string]any
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(obj) > 0 {
			out = append(out, &unstructured.Unstructured{Object: obj})
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s: no document", name)
	}
	return out
}

func file(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, path))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// applier applies objects with server-side apply, as `kubectl apply --server-side` does.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newApplier(t *testing.T, s *kubeapi.Server) *applier {
	t.Helper()
	cfg := s.Config(kubeapi.AdminUser)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(cs.Discovery()))}
}

// namespaces creates the namespaces objs name that the server does not have yet (monitoring, for
// the dashboard's ConfigMap): an install creates them first.
func (a *applier) namespaces(t *testing.T, objs []*unstructured.Unstructured) {
	t.Helper()
	for _, obj := range objs {
		if obj.GetNamespace() == "" {
			continue
		}
		ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace",
			"metadata": map[string]any{"name": obj.GetNamespace()}}}
		if err := a.apply(ns, false); err != nil {
			t.Fatal(err)
		}
	}
}

// apply applies obj; dryRun: the server validates, admits and answers it, and stores nothing.
func (a *applier) apply(obj *unstructured.Unstructured, dryRun bool) error {
	gvk := obj.GroupVersionKind()
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return err
	}
	var client dynamic.ResourceInterface = a.dyn.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		client = a.dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace())
	}
	opts := metav1.ApplyOptions{FieldManager: "kubeapi-test", Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err = client.Apply(context.Background(), obj.GetName(), obj, opts)
	return err
}

// install applies obj for the test and deletes it when the test ends.
func (a *applier) install(t *testing.T, obj *unstructured.Unstructured) {
	t.Helper()
	if err := a.apply(obj, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		gvk := obj.GroupVersionKind()
		mapping, _ := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		_ = a.dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace()).Delete(context.Background(), obj.GetName(), metav1.DeleteOptions{})
	})
}

// crds installs the PodMonitor and PrometheusRule CRDs from prometheus-operator's module (the module
// cache has it after the first download) and waits until the server serves them.
func crds(t *testing.T, a *applier) {
	t.Helper()
	out, err := exec.Command("go", "mod", "download", "-json", operatorModule).Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v", operatorModule, err)
	}
	var mod struct{ Dir, Error string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s: %s %v", operatorModule, mod.Error, err)
	}
	for _, kind := range []string{"podmonitors", "prometheusrules"} {
		path := filepath.Join(mod.Dir, operatorCRDs, "monitoring.coreos.com_"+kind+".yaml")
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, obj := range objects(t, path, data) {
			if err := a.apply(obj, false); err != nil {
				t.Fatalf("install %s: %v", path, err)
			}
		}
	}
	for _, kind := range []string{"PodMonitor", "PrometheusRule"} {
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			a.mapper.Reset()
			_, err := a.mapper.RESTMapping(schema.GroupKind{Group: "monitoring.coreos.com", Kind: kind}, "v1")
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the server does not serve %s: %v", kind, err)
			}
		}
	}
}

// render is the chart fixture as the README's install renders it: helm, then deploy/helm/post-render.
func render(t *testing.T) []byte {
	t.Helper()
	helm, kustomize := kubeapi.Tool(t, "helm", "make go-plugins"), kubeapi.Tool(t, "kustomize", "make go-plugins")
	cmd := exec.Command(helm, "template", "hami", chartFixture, "--namespace", kubeapi.PluginNamespace,
		"--post-renderer", "./deploy/helm/post-render", "--post-renderer-args", "ghcr.io/project-hami/hami-mig-sidecar:0.1.0")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "KUSTOMIZE="+kustomize,
		"HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, stderr.String())
	}
	return out
}

// broken is text with from, which must be there, replaced by to.
func broken(t *testing.T, text []byte, from, to string) []byte {
	t.Helper()
	if !bytes.Contains(text, []byte(from)) {
		t.Fatalf("%q is not in the manifest any more: the broken copy would test nothing", from)
	}
	return bytes.Replace(text, []byte(from), []byte(to), 1)
}

// TestEveryManifestPassesAServerSideDryRun applies every manifest a user installs with server-side
// dry-run: the server's validation, defaulting and admission, the monitoring objects against the
// prometheus-operator CRDs. A broken copy of each is refused, so the dry-run is not a formality.
func TestEveryManifestPassesAServerSideDryRun(t *testing.T) {
	s := kubeapi.Get(t)
	a := newApplier(t, s)
	crds(t, a)
	manifests := map[string][]byte{}
	for _, name := range []string{"deploy/rbac.yaml", "deploy/daemonset.yaml", "deploy/grafana-dashboard-configmap.yaml",
		"deploy/podmonitor.yaml", "deploy/prometheus-rules.yaml", draRBAC, draDaemonSet, draClass, draClaims, draPod} {
		manifests[name] = file(t, name)
	}
	t.Run("deploy", func(t *testing.T) {
		for name, data := range manifests {
			objs := objects(t, name, data)
			inExamples(objs)
			a.namespaces(t, objs)
			for _, obj := range objs {
				if err := a.apply(obj, true); err != nil {
					t.Errorf("%s: %s %s: %v", name, obj.GetKind(), obj.GetName(), err)
				}
			}
		}
	})
	t.Run("chart", func(t *testing.T) {
		rendered := render(t)
		kinds := map[string]int{}
		for _, obj := range objects(t, "the rendered chart", rendered) {
			kinds[obj.GetKind()]++
			if err := a.apply(obj, true); err != nil {
				t.Errorf("the rendered chart: %s %s: %v", obj.GetKind(), obj.GetName(), err)
			}
		}
		if kinds["DaemonSet"] != 2 || kinds["ClusterRole"] != 1 {
			t.Errorf("rendered %v, want the two DaemonSets and the plugin's RBAC", kinds)
		}
	})

	for _, c := range []struct{ what, file, old, new, refusal string }{
		{"a misspelt PodMonitor field", "deploy/podmonitor.yaml", "podMetricsEndpoints:", "podMetricEndpoints:", "field not declared in schema"},
		{"a misspelt PrometheusRule field", "deploy/prometheus-rules.yaml", "expr:", "expression:", "field not declared in schema"},
		{"a DaemonSet whose selector misses its pods' labels", "deploy/daemonset.yaml",
			"      labels:\n        app.kubernetes.io/name: hami-mig-sidecar-standalone", "      labels:\n        app.kubernetes.io/name: other", "does not match template"},
		{"a ConfigMap with a key a file cannot have", "deploy/grafana-dashboard-configmap.yaml", "hami-mig-sidecar.json:", "hami mig sidecar.json:", "a valid config key"},
		{"a claim whose CEL does not compile", draClaims, `.profile == "2g.20gb"`, `.profile = "2g.20gb"`, "compilation failed"},
		{"a claim comparing a quantity with a number", draClaims, `.memory.compareTo(quantity("20Gi")) >= 0`, `.memory >= 20`, "no matching overload"},
		{"a DeviceClass with a misspelt selector", draClass, "    - cel:", "    - cell:", "field not declared in schema"},
		{"a node-restriction policy whose CEL does not compile", draRBAC, `variables.userNode != ""`, `variables.userNode !== ""`, "compilation failed"},
	} {
		var errs []string
		objs := objects(t, c.file, broken(t, manifests[c.file], c.old, c.new))
		inExamples(objs)
		for _, obj := range objs {
			if err := a.apply(obj, true); err != nil {
				errs = append(errs, err.Error())
			}
		}
		if len(errs) == 0 || !strings.Contains(strings.Join(errs, "\n"), c.refusal) {
			t.Errorf("%s: the server answered %q, want a refusal with %q", c.what, errs, c.refusal)
		}
		t.Logf("%s: %s", c.what, strings.Join(errs, "; "))
	}
}

// The DRA path's manifests (deploy/dra/), its examples applied in exampleNamespace as a user would.
const (
	draRBAC          = "deploy/dra/rbac.yaml"
	draDaemonSet     = "deploy/dra/daemonset.yaml"
	draClass         = "deploy/dra/deviceclass.yaml"
	draClaims        = "deploy/dra/examples/claims.yaml"
	draPod           = "deploy/dra/examples/pod.yaml"
	exampleNamespace = "dra-examples"
)

// inExamples puts the namespaced objects that name no namespace (the examples) in exampleNamespace.
func inExamples(objs []*unstructured.Unstructured) {
	for _, obj := range objs {
		if obj.GetNamespace() == "" && (obj.GetKind() == "ResourceClaimTemplate" || obj.GetKind() == "Pod") {
			obj.SetNamespace(exampleNamespace)
		}
	}
}

// allowed asks the server whether a ServiceAccount's user may make one request; resource is
// spelt as kubectl auth can-i spells it ("pods", "resourceclaims.resource.k8s.io").
func allowed(t *testing.T, admin kubernetes.Interface, user, verb, resource string) bool {
	t.Helper()
	resource, group, _ := strings.Cut(resource, ".")
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + kubeapi.PluginNamespace, "system:authenticated"},
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: verb, Group: group, Resource: resource}}}
	got, err := admin.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), review, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got.Status.Allowed
}

// TestThePluginsRBACPermitsWhatTheAdapterAndThePublisherDo, for the chart fixture's ServiceAccount,
// ClusterRole and binding (HAMi 2.10's rules) and for deploy/rbac.yaml's: with them applied, a pod's
// start and stop succeed as the ServiceAccount; the requests they make (from the audit log) are
// exactly list and patch of pods and patch of nodes, each granted; and with each of those verbs taken
// out of the ClusterRole the step that needs it fails with the Forbidden an operator reads in the
// plugin's log.
func TestThePluginsRBACPermitsWhatTheAdapterAndThePublisherDo(t *testing.T) {
	t.Run("chart", func(t *testing.T) { checkRBAC(t, render(t), kubeapi.PluginUser) })
	t.Run("deploy", func(t *testing.T) { checkRBAC(t, file(t, "deploy/rbac.yaml"), kubeapi.StandaloneUser) })
}

func checkRBAC(t *testing.T, manifests []byte, user string) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	ns := namespace(t, admin)
	a := newApplier(t, s)
	var role *rbacv1.ClusterRole
	for _, obj := range objects(t, "the RBAC", manifests) {
		switch obj.GetKind() {
		case "ServiceAccount", "ClusterRole", "ClusterRoleBinding":
			a.install(t, obj)
			if obj.GetKind() == "ClusterRole" {
				role = &rbacv1.ClusterRole{}
				data, _ := json.Marshal(obj.Object)
				if err := json.Unmarshal(data, role); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if role == nil {
		t.Fatal("no ClusterRole")
	}
	ctx := context.Background()
	p := dial(t, s.Client(t, user), ns)
	mark := s.Mark(t)
	pod := scheduled(t, admin, ns, ns, "a", annotation.Placement{Start: 0, Size: 1})
	if err := p.start(ctx, pod); err != nil {
		t.Fatalf("a pod's start as %s: %v", user, err)
	}
	if err := admin.CoreV1().Pods(ns).Delete(ctx, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := p.stop(ctx); err != nil {
		t.Fatalf("a pod's stop as %s: %v", user, err)
	}
	var made []string
	for _, e := range mark.Events(t, user) {
		if !slices.Contains(made, e.Key()) {
			made = append(made, e.Key())
		}
	}
	slices.Sort(made)
	if want := []string{"list pods", "patch nodes", "patch pods"}; !slices.Equal(made, want) {
		t.Fatalf("the adapter and the publisher made %v, want %v", made, want)
	}

	for _, c := range []struct {
		verb, resource string
		step           func() error
	}{
		{"list", "pods", p.m.ReconcileNodePods},
		{"patch", "pods", func() error {
			return p.patchPod(ctx, scheduled(t, admin, ns, ns, "b", annotation.Placement{Start: 1, Size: 1}), "[]")
		}},
		{"patch", "nodes", func() error { // a new publisher's first pass always writes
			_, err := hami.NewPublisher(p.m.Client(), kube.PatchIdle(p.cs.CoreV1().Nodes(), p.node)).Publish(ctx)
			return err
		}},
	} {
		if !allowed(t, admin, user, c.verb, c.resource) {
			t.Fatalf("the ClusterRole does not grant %s %s", c.verb, c.resource)
		}
		without := role.DeepCopy()
		for i := range without.Rules {
			if slices.Contains(without.Rules[i].Resources, c.resource) {
				without.Rules[i].Verbs = slices.DeleteFunc(slices.Clone(without.Rules[i].Verbs), func(v string) bool { return v == c.verb })
			}
		}
		update(t, admin, without)
		for deadline := time.Now().Add(30 * time.Second); allowed(t, admin, user, c.verb, c.resource); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s %s is still allowed after the ClusterRole lost it", c.verb, c.resource)
			}
		}
		// What the plugin logs: `... is forbidden: User "system:serviceaccount:kube-system:hami-device-plugin"
		// cannot patch resource "nodes" in API group "" at the cluster scope`.
		err := c.step()
		want := `is forbidden: User "` + user + `" cannot ` + c.verb + ` resource "` + c.resource + `"`
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("without %s %s: %v, want %q", c.verb, c.resource, err, want)
		}
		t.Logf("without %s %s the plugin logs: %v", c.verb, c.resource, err)
		update(t, admin, role)
		for deadline := time.Now().Add(30 * time.Second); !allowed(t, admin, user, c.verb, c.resource); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s %s is not allowed again", c.verb, c.resource)
			}
		}
	}
}

func update(t *testing.T, admin kubernetes.Interface, role *rbacv1.ClusterRole) {
	t.Helper()
	current, err := admin.RbacV1().ClusterRoles().Get(context.Background(), role.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	current.Rules = role.Rules
	if _, err := admin.RbacV1().ClusterRoles().Update(context.Background(), current, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// draUser is deploy/dra/rbac.yaml's ServiceAccount, as a pod's token on node authenticates it: the
// token names the node (the user's extra authentication.kubernetes.io/node-name; "" for a token
// that names none). The admin impersonates it, extra included.
func draUser(t *testing.T, s *kubeapi.Server, node string) *kubernetes.Clientset {
	t.Helper()
	cfg := s.Config(kubeapi.AdminUser)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: draAccount,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + kubeapi.PluginNamespace, "system:authenticated"}}
	if node != "" {
		cfg.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

const draAccount = "system:serviceaccount:" + kubeapi.PluginNamespace + ":hami-mig-dra"

// deviceSlice is the device slice of one GPU's pool on node, as the plugin publishes it.
func deviceSlice(node string) *resourcev1.ResourceSlice {
	profile := "1g.10gb"
	return &resourcev1.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: node + "-gpu0-devices"},
		Spec: resourcev1.ResourceSliceSpec{Driver: "mig.hami.io", NodeName: &node,
			Pool: resourcev1.ResourcePool{Name: node + "-gpu0", Generation: 1, ResourceSliceCount: 1},
			Devices: []resourcev1.Device{{Name: "gpu0-1g-10gb-at0",
				Attributes: map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{"profile": {StringValue: &profile}}}}},
	}
}

// TestTheDRAPluginsRBACLetsItWriteOnlyItsOwnNodesSlices applies deploy/dra/rbac.yaml and acts as its
// ServiceAccount from a pod on node-a: it creates, updates and deletes node-a's ResourceSlice and
// reads claims and its Node, while a slice of node-b, one of no node, and any slice written with a
// token that names no node are refused by the policy with its message; what the kubelet plugin
// helper never does (writing claims, pods or nodes) is not granted.
func TestTheDRAPluginsRBACLetsItWriteOnlyItsOwnNodesSlices(t *testing.T) {
	s := kubeapi.Get(t)
	admin := s.Client(t, kubeapi.AdminUser)
	a := newApplier(t, s)
	for _, obj := range objects(t, draRBAC, file(t, draRBAC)) {
		a.install(t, obj)
	}
	ctx := context.Background()
	onA, noNode := draUser(t, s, "node-a").ResourceV1().ResourceSlices(), draUser(t, s, "").ResourceV1().ResourceSlices()

	// The policy takes effect once the server has loaded it: until then node-b's slice goes through.
	var refusal error
	for deadline := time.Now().Add(60 * time.Second); refusal == nil; time.Sleep(100 * time.Millisecond) {
		if _, refusal = onA.Create(ctx, deviceSlice("node-b"), metav1.CreateOptions{}); refusal == nil {
			_ = admin.ResourceV1().ResourceSlices().Delete(ctx, "node-b-gpu0-devices", metav1.DeleteOptions{})
		}
		if time.Now().After(deadline) {
			t.Fatal("the node restriction never refused a slice of another node")
		}
	}
	if !strings.Contains(refusal.Error(), "hami-mig-dra on node node-a may not write a ResourceSlice of node node-b") {
		t.Fatalf("node-b's slice from node-a: %v", refusal)
	}

	own, err := onA.Create(ctx, deviceSlice("node-a"), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("node-a's slice from node-a: %v", err)
	}
	own.Spec.Pool.Generation = 2
	if own, err = onA.Update(ctx, own, metav1.UpdateOptions{}); err != nil || own.Spec.Pool.Generation != 2 {
		t.Fatalf("update of node-a's slice from node-a: %v", err)
	}
	if _, err := noNode.Create(ctx, deviceSlice("node-c"), metav1.CreateOptions{}); err == nil ||
		!strings.Contains(err.Error(), "only with a pod's token, which names its node") {
		t.Fatalf("a slice written with a token that names no node: %v", err)
	}
	if err := noNode.Delete(ctx, own.Name, metav1.DeleteOptions{}); err == nil {
		t.Fatal("a token that names no node deleted node-a's slice")
	}
	unowned := deviceSlice("node-a")
	unowned.Name, unowned.Spec.NodeName, unowned.Spec.AllNodes = "cluster-wide", nil, new(true)
	if _, err := onA.Create(ctx, unowned, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "of no node") {
		t.Fatalf("a slice of no node from node-a: %v", err)
	}
	if err := onA.Delete(ctx, own.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete of node-a's slice from node-a: %v", err)
	}
	if got, err := admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{}); err != nil || len(got.Items) != 0 {
		t.Fatalf("slices left: %v %v", got, err)
	}

	for _, c := range []struct {
		verb, resource string
		want           bool
	}{
		{"list", "resourceclaims.resource.k8s.io", true},
		{"watch", "resourceslices.resource.k8s.io", true},
		{"get", "nodes", true},
		{"update", "resourceclaims.resource.k8s.io", false},
		{"patch", "nodes", false},
		{"create", "pods", false},
	} {
		if got := allowed(t, admin, draAccount, c.verb, c.resource); got != c.want {
			t.Errorf("%s %s: allowed %v, want %v", c.verb, c.resource, got, c.want)
		}
	}
}
