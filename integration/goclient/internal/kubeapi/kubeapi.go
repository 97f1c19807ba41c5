// Package kubeapi runs a real Kubernetes API server for the tests: etcd and kube-apiserver at the
// versions scripts/kube-binaries pins (`make kube-binaries` builds them into GOBIN), on random local
// ports, with a temporary data directory, a self-signed certificate, RBAC on and two token users
// (Admin, and Plugin, which has the name of the device plugin's ServiceAccount and no rights until a
// test binds some). No controllers run: ServiceAccount admission is off and nothing reconciles
// endpoints, so the server holds exactly what a test writes. Every request is written to an audit
// log, from which the tests count the API writes a pod's start and stop cost.
//
// Why a real server beside client-go's fake clientset: the fake accepts what the server refuses (an
// annotation over 256 KiB, a field selector the server does not support, a verb RBAC does not
// grant, a DaemonSet its validation rejects, an object that does not match its CRD). The fake stays
// where a test injects errors the real server does not make on demand.
//
// A test package runs Main from its TestMain; a test calls Get, which starts the server on first use
// (about 4 s) and shares it with the package's other tests; Main stops it after the last test. When
// the binaries are missing Get skips with the make target that builds them, except under CI, which
// builds them (.ci/run) and so fails.
//
// GetWithScheduler also runs the real kube-scheduler of the same version against the server (see
// StartScheduler), for tests of Dynamic Resource Allocation: the scheduler allocates ResourceClaims
// from the ResourceSlices a test or a DRA plugin publishes and binds the pods. What a test must know,
// established by scheduler_test.go against this version:
//   - Nothing else runs. A Node needs its status written (allocatable pods, cpu, memory) and the
//     not-ready taint that admission gives a new node removed. A pod names a ResourceClaim the test
//     created: a ResourceClaimTemplate needs kube-controller-manager to create the pod's claim. A
//     bound pod is deleted with a grace period of 0 (no kubelet confirms it), and its claim with
//     DeleteClaim, which frees its devices as the resourceclaim controller would.
//   - The scheduler takes the first device that fits in the order the slice lists them, not the
//     lowest placement nor the first name, and counts the shared counters (one per memory slice)
//     across claims, so two claims never get overlapping placements.
//   - A request's firstAvailable list (DRAPrioritizedList, GA in 1.36) is honoured in order: a first
//     subrequest selecting `warm` devices gets a warm one wherever it sits in the slice, the next
//     subrequest any device of the profile; the allocation names the request "<request>/<subrequest>".
package kubeapi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"
)

// The users of the token file. PluginUser is what the device plugin's ServiceAccount
// kube-system/hami-device-plugin (the chart's) authenticates as, StandaloneUser that of
// deploy/rbac.yaml's kube-system/hami-mig-sidecar-standalone, so a ClusterRoleBinding to either
// ServiceAccount applies to its user. Neither may do anything until a test binds a role.
const (
	AdminUser           = "admin"
	PluginNamespace     = "kube-system"
	PluginAccount       = "hami-device-plugin"
	PluginUser          = "system:serviceaccount:" + PluginNamespace + ":" + PluginAccount
	StandaloneAccount   = "hami-mig-sidecar-standalone"
	StandaloneUser      = "system:serviceaccount:" + PluginNamespace + ":" + StandaloneAccount
	SchedulerUser       = "system:kube-scheduler" // kube-scheduler's own user (see StartScheduler)
	readyTimeout        = 90 * time.Second        // a loaded 2-core machine; /readyz is ok after ~4 s when idle
	stopTimeout         = 10 * time.Second
	buildTarget         = "make kube-binaries"
	auditPolicyDocument = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
`
	// The scheduler's configuration; %s is its kubeconfig.
	schedulerConfigDocument = `apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %s
  qps: 1000
  burst: 1000
leaderElection:
  leaderElect: false
`
)

// tokens are the bearer tokens of the token file's users.
var tokens = map[string]string{AdminUser: "admin-token", PluginUser: "plugin-token", StandaloneUser: "standalone-token",
	SchedulerUser: "scheduler-token"}

// Server is a running etcd and kube-apiserver, and the kube-scheduler once GetWithScheduler started it.
type Server struct {
	dir                   string
	url                   string
	caPEM                 []byte
	auditLog              string
	etcd, kube, scheduler *process
	marks                 int
	mu                    sync.Mutex
}

// process is a program the server runs, its output in a log file of the server's directory.
type process struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{} // closed when it exits
}

var shared struct {
	once   sync.Once
	server *Server
	err    error
	skip   string

	schedulerOnce sync.Once
	schedulerErr  error
	schedulerSkip string
}

// Main runs a test package's tests and then stops the server (and its scheduler) if one was started.
func Main(m *testing.M) int {
	code := m.Run()
	if shared.server != nil {
		shared.server.Stop()
	}
	return code
}

// Get returns the package's server, starting it on the first call. Without the binaries it skips
// the test (fails it under CI); a server that does not start fails it.
func Get(t testing.TB) *Server {
	t.Helper()
	shared.once.Do(func() {
		etcd, kube, missing := binaries()
		if missing != "" {
			shared.skip = missing + " not built: `" + buildTarget + "` builds the pinned kube-apiserver and etcd (about 10 minutes once)"
			return
		}
		shared.server, shared.err = Start(etcd, kube)
	})
	skipUnbuilt(t, shared.skip)
	if shared.err != nil {
		t.Fatalf("start the API server: %v", shared.err)
	}
	return shared.server
}

// GetWithScheduler is Get with the package's kube-scheduler running against the server, started on
// the first call (see StartScheduler) and stopped by Main. Without the binary it skips (fails under
// CI) as Get does.
func GetWithScheduler(t testing.TB) *Server {
	t.Helper()
	s := Get(t)
	shared.schedulerOnce.Do(func() {
		bin := Find("kube-scheduler")
		if bin == "" {
			shared.schedulerSkip = "kube-scheduler not built: `" + buildTarget + "` builds it beside the API server"
			return
		}
		shared.schedulerErr = s.StartScheduler(bin)
	})
	skipUnbuilt(t, shared.schedulerSkip)
	if shared.schedulerErr != nil {
		t.Fatalf("start the scheduler: %v", shared.schedulerErr)
	}
	return s
}

// skipUnbuilt skips the test when why says a binary is missing, except under CI, which builds them.
func skipUnbuilt(t testing.TB, why string) {
	t.Helper()
	if why == "" {
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("%s (.ci/run builds them)", why)
	}
	t.Skip(why)
}

// binaries finds etcd and kube-apiserver; missing names what is not there.
func binaries() (etcd, kube, missing string) {
	etcd, kube = Find("etcd"), Find("kube-apiserver")
	var absent []string
	if etcd == "" {
		absent = append(absent, "etcd")
	}
	if kube == "" {
		absent = append(absent, "kube-apiserver")
	}
	return etcd, kube, strings.Join(absent, " and ")
}

// Find looks for a Go-installed program on PATH, then in GOPATH/bin (where `make kube-binaries` and
// `make go-plugins` put theirs); "" when it is in neither.
func Find(name string) string {
	if found, err := exec.LookPath(name); err == nil {
		return found
	}
	if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		candidate := filepath.Join(strings.TrimSpace(string(out)), "bin", name)
		if _, err := os.Stat(candidate); err == nil {
			return candidate
		}
	}
	return ""
}

// Tool is Find for a test: without the program the test skips, naming the make target that installs
// it, except under CI, where it fails.
func Tool(t testing.TB, name, target string) string {
	t.Helper()
	found := Find(name)
	if found == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not found (.ci/run installs it with `%s`)", name, target)
		}
		t.Skipf("%s not found: `%s` installs it", name, target)
	}
	return found
}

// freePorts asks the kernel for n free local ports. They are free when asked; another process could
// take one before the server binds it, which fails the start with a clear error.
func freePorts(n int) ([]int, error) {
	var ports []int
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		listeners = append(listeners, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// selfSigned writes a certificate for 127.0.0.1 and its key, and returns the certificate in PEM.
func selfSigned(certFile, keyFile string) ([]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubeapi-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true,
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		return nil, err
	}
	return certPEM, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
}

// Start starts etcd and the API server in a new temporary directory and waits for /readyz.
func Start(etcdBin, kubeBin string) (*Server, error) {
	dir, err := os.MkdirTemp("", "kubeapi-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, auditLog: filepath.Join(dir, "audit.log")}
	if err := s.start(etcdBin, kubeBin); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Server) start(etcdBin, kubeBin string) error {
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	client, peer, secure := ports[0], ports[1], ports[2]
	cert, key := filepath.Join(s.dir, "tls.crt"), filepath.Join(s.dir, "tls.key")
	if s.caPEM, err = selfSigned(cert, key); err != nil {
		return err
	}
	// The service account flags are required even with its admission off; the key signs nothing here.
	lines := []string{fmt.Sprintf("%s,%s,%s,\"system:masters\"", tokens[AdminUser], AdminUser, AdminUser),
		fmt.Sprintf("%s,%s,%s", tokens[SchedulerUser], SchedulerUser, SchedulerUser)}
	for _, account := range []string{PluginAccount, StandaloneAccount} {
		user := "system:serviceaccount:" + PluginNamespace + ":" + account
		lines = append(lines, fmt.Sprintf("%s,%s,%s,\"system:serviceaccounts,system:serviceaccounts:%s\"",
			tokens[user], user, account, PluginNamespace))
	}
	tokenFile := strings.Join(lines, "\n") + "\n"
	files := map[string]string{"tokens.csv": tokenFile, "audit-policy.yaml": auditPolicyDocument}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(s.dir, name), []byte(text), 0o600); err != nil {
			return err
		}
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", client)
	etcd := exec.Command(etcdBin, "--data-dir", filepath.Join(s.dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peer),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", peer),
		"--unsafe-no-fsync", "--log-level", "warn")
	if s.etcd, err = s.launch(etcd, "etcd"); err != nil {
		return err
	}
	s.url = fmt.Sprintf("https://127.0.0.1:%d", secure)
	kube := exec.Command(kubeBin,
		"--etcd-servers", etcdURL, "--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(secure),
		"--advertise-address", "127.0.0.1", "--tls-cert-file", cert, "--tls-private-key-file", key,
		"--token-auth-file", filepath.Join(s.dir, "tokens.csv"), "--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubeapi.test", "--service-account-key-file", key,
		"--service-account-signing-key-file", key, "--service-cluster-ip-range", "10.0.0.0/24",
		"--disable-admission-plugins", "ServiceAccount", "--endpoint-reconciler-type", "none",
		"--allow-privileged", // as a cluster that runs device plugins does
		"--audit-policy-file", filepath.Join(s.dir, "audit-policy.yaml"), "--audit-log-path", s.auditLog,
		"--audit-log-format", "json", "--audit-log-mode", "blocking")
	if s.kube, err = s.launch(kube, "kube-apiserver"); err != nil {
		return err
	}
	return s.waitReady(s.kube, s.url, tokens[AdminUser])
}

// StartScheduler starts kube-scheduler against the server and waits for its /readyz, which reports
// ready once its informers have synced. It authenticates as SchedulerUser, the user a kubeadm
// cluster's scheduler has, so the API server's bootstrap ClusterRoles system:kube-scheduler and
// system:volume-scheduler, bound to that user, grant it what the scheduler of this Kubernetes version
// needs (DRA's device classes, slices and claims included); admin would hide a missing grant. Leader
// election is off (one scheduler), its client is not rate limited (as Config's), and it serves
// /readyz on a free local port with the server's certificate; with neither authentication- nor
// authorization-kubeconfig given, only the always-allowed health paths answer there.
func (s *Server) StartScheduler(bin string) error {
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(s.dir, "scheduler.kubeconfig")
	if err := s.writeKubeconfig(SchedulerUser, kubeconfig); err != nil {
		return err
	}
	config := filepath.Join(s.dir, "scheduler.yaml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(schedulerConfigDocument, kubeconfig)), 0o600); err != nil {
		return err
	}
	scheduler := exec.Command(bin, "--config", config, "--bind-address", "127.0.0.1",
		"--secure-port", fmt.Sprint(ports[0]), "--tls-cert-file", filepath.Join(s.dir, "tls.crt"),
		"--tls-private-key-file", filepath.Join(s.dir, "tls.key"))
	if s.scheduler, err = s.launch(scheduler, "kube-scheduler"); err != nil {
		return err
	}
	return s.waitReady(s.scheduler, fmt.Sprintf("https://127.0.0.1:%d", ports[0]), "")
}

// launch starts cmd with its output in the server's directory, as name.log.
func (s *Server) launch(cmd *exec.Cmd, name string) (*process, error) {
	out, err := os.Create(filepath.Join(s.dir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the test binary
	if err := cmd.Start(); err != nil {
		_ = out.Close()
		return nil, err
	}
	p := &process{name: name, cmd: cmd, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); _ = out.Close(); close(p.exited) }()
	return p, nil
}

// waitReady polls p's /readyz at url (with token as bearer, if any) until it answers 200.
func (s *Server) waitReady(p *process, url, token string) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.caPEM)
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	deadline := time.Now().Add(readyTimeout)
	last := "no answer"
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			return fmt.Errorf("%s exited: %s", p.name, s.tail(p.name+".log"))
		default:
		}
		req, _ := http.NewRequest(http.MethodGet, url+"/readyz", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		if resp, err := client.Do(req); err == nil {
			body := new(bytes.Buffer)
			_, _ = body.ReadFrom(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, body.String())
		} else {
			last = err.Error()
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("%s: /readyz not ok after %s (%s): %s", p.name, readyTimeout, last, s.tail(p.name+".log"))
}

// LogTail is the end of a program's log ("kube-scheduler", "kube-apiserver" or "etcd"), for a test's
// failure message.
func (s *Server) LogTail(program string) string { return s.tail(program + ".log") }

// tail is the end of one of the server's logs, for an error message.
func (s *Server) tail(name string) string {
	data, _ := os.ReadFile(filepath.Join(s.dir, name))
	if len(data) > 2000 {
		data = data[len(data)-2000:]
	}
	return string(data)
}

// Stop stops the scheduler, the API server, then etcd, and removes the directory.
func (s *Server) Stop() {
	for _, p := range []*process{s.scheduler, s.kube, s.etcd} {
		if p == nil {
			continue
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(stopTimeout):
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
	}
	_ = os.RemoveAll(s.dir)
}

// Config is a client configuration of user (AdminUser, PluginUser or StandaloneUser).
func (s *Server) Config(user string) *rest.Config {
	return &rest.Config{Host: s.url, BearerToken: tokens[user], TLSClientConfig: rest.TLSClientConfig{CAData: s.caPEM},
		QPS: 1000, Burst: 1000}
}

// Client is a clientset of user (see Config).
func (s *Server) Client(t testing.TB, user string) *kubernetes.Clientset {
	t.Helper()
	cs, err := kubernetes.NewForConfig(s.Config(user))
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// Kubeconfig writes a kubeconfig of user for a program the test runs, and returns its path.
func (s *Server) Kubeconfig(t testing.TB, user string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := s.writeKubeconfig(user, path); err != nil {
		t.Fatal(err)
	}
	return path
}

func (s *Server) writeKubeconfig(user, path string) error {
	c := s.Config(user)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: c.Host, CertificateAuthorityData: s.caPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: c.BearerToken}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: user}
	cfg.CurrentContext = "test"
	return clientcmd.WriteToFile(*cfg, path)
}

// DeleteClaim deletes a pod's ResourceClaim once the pod is gone, as kube-controller-manager's
// resourceclaim controller would finish it (it does not run here): it empties the claim's reservedFor
// and clears its allocation, which frees the devices for the scheduler, removes the finalizer the
// scheduler added at allocation, then deletes it. The pod must be deleted first: a claim still
// reserved for a live pod is the controller's to keep.
func DeleteClaim(ctx context.Context, client kubernetes.Interface, namespace, name string) error {
	claims := client.ResourceV1().ResourceClaims(namespace)
	// The scheduler may still be writing the claim (one it just found no device for): read it again.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		claim, err := claims.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if claim.Status.Allocation != nil || len(claim.Status.ReservedFor) > 0 {
			claim.Status.Allocation, claim.Status.ReservedFor = nil, nil
			if claim, err = claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		if i := slices.Index(claim.Finalizers, resourcev1.Finalizer); i >= 0 {
			claim.Finalizers = slices.Delete(claim.Finalizers, i, i+1)
			if _, err := claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return claims.Delete(ctx, name, metav1.DeleteOptions{})
}

// Event is one audit log entry, the fields the tests read.
type Event struct {
	Stage     string                    `json:"stage"`
	Verb      string                    `json:"verb"`
	User      struct{ Username string } `json:"user"`
	ObjectRef *struct {
		Resource  string `json:"resource"`
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
}

// Write reports whether the request changed, or tried to change, an object.
func (e Event) Write() bool {
	switch e.Verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}

// Key is "verb resource" ("patch nodes"), the name RBAC gives the request.
func (e Event) Key() string {
	if e.ObjectRef == nil {
		return e.Verb
	}
	return e.Verb + " " + e.ObjectRef.Resource
}

// Audit is a position in the audit log; Events reads what came after it.
type Audit struct {
	s      *Server
	offset int64
}

// Mark is the audit log's current end: the requests made after it, once Events returns them. It
// makes a request of its own and waits for it in the log, so everything before it is there too.
func (s *Server) Mark(t testing.TB) Audit {
	t.Helper()
	s.sync(t)
	info, err := os.Stat(s.auditLog)
	if err != nil {
		t.Fatal(err)
	}
	return Audit{s: s, offset: info.Size()}
}

// sync makes a uniquely named admin GET and waits until the audit log holds its completion: the log
// backend writes each request's line as it completes, in the order the requests completed.
func (s *Server) sync(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	s.marks++
	name := fmt.Sprintf("audit-mark-%d", s.marks)
	s.mu.Unlock()
	_, err := s.Client(t, AdminUser).CoreV1().Namespaces().Get(context.Background(), name, metav1.GetOptions{})
	if err == nil {
		t.Fatalf("namespace %s exists", name)
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		data, err := os.ReadFile(s.auditLog)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(data, []byte(`"name":"`+name+`"`)) {
			return
		}
	}
	t.Fatalf("the audit log never showed %s", name)
}

// Events are the completed requests of user since the mark, the mark's own sync requests left out.
func (a Audit) Events(t testing.TB, user string) []Event {
	t.Helper()
	a.s.sync(t)
	f, err := os.Open(a.s.auditLog)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }() // read only
	if _, err := f.Seek(a.offset, 0); err != nil {
		t.Fatal(err)
	}
	var out []Event
	scan := bufio.NewScanner(f)
	scan.Buffer(make([]byte, 1<<20), 16<<20)
	for scan.Scan() {
		var e Event
		if err := json.Unmarshal(scan.Bytes(), &e); err != nil {
			t.Fatalf("audit log: %v", err)
		}
		if e.Stage == "ResponseComplete" && e.User.Username == user {
			out = append(out, e)
		}
	}
	if err := scan.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Writes counts the write requests among events by Key ("patch pods": 1).
func Writes(events []Event) map[string]int {
	out := map[string]int{}
	for _, e := range events {
		if e.Write() {
			out[e.Key()]++
		}
	}
	return out
}
