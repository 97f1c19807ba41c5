package migclient

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

// Defaults used when an Options field is zero. The package documentation explains the numbers.
const (
	DefaultCallTimeout     = 10 * time.Second
	DefaultAllocateTimeout = 60 * time.Second
	DefaultBackoffInitial  = 100 * time.Millisecond
	DefaultBackoffMax      = 2 * time.Second
)

// Backends a sidecar reports in GetInfo.
const (
	BackendNVML      = "nvml"
	BackendSimulated = "simulated"
)

// recoverTries bounds how often one recovery (or one release pass) starts over because the
// sidecar restarted, or its generation moved, while the plugin's pod list was being taken.
const recoverTries = 3

// Backoff spaces the retries of a call that failed with UNAVAILABLE or OVERLOADED: the n-th retry waits a
// random time in [d/2, d] where d = min(Max, Initial*2^(n-1)), so that a restarting sidecar is
// not hit by every caller at once.
type Backoff struct {
	Initial time.Duration
	Max     time.Duration
}

// ListActiveFunc returns every allocation the plugin knows to be live, as read from the
// hami.io/vgpu-mig-allocations annotations of a fresh pod list. It must fail rather than return
// a partial list: the sidecar treats a missing entry as a released allocation.
type ListActiveFunc func(ctx context.Context) ([]*pb.ActiveAllocation, error)

// Options configure a Client. Zero values take the defaults above.
type Options struct {
	// CallTimeout bounds every RPC except Allocate, retries included, and the recovery that
	// GetInfo, EnsureRecovered or ReleaseByPodList start, pod list included.
	CallTimeout time.Duration
	// AllocateTimeout bounds Allocate, retries included. kubelet gives Allocate no deadline,
	// so without this a wedged sidecar would hang container creation forever.
	AllocateTimeout time.Duration
	// MaxAttempts caps the calls per RPC (first call included); only UNAVAILABLE and OVERLOADED
	// (RESOURCE_EXHAUSTED: the sidecar was full) are retried.
	// Zero means no cap: the call's deadline alone bounds the retries, which is what lets
	// Allocate wait out an INSTANCE_IN_USE that lasts a pod's termination grace period.
	MaxAttempts int
	// Backoff spaces the retries.
	Backoff Backoff
	// ListActive enables automatic recovery: when the sidecar answers NOT_RECOVERED (it
	// restarted) or GetInfo shows it has not recovered, the client calls Recover with this
	// list and retries the call once. Its context carries the deadline of the call that needed
	// the recovery. Nil disables recovery; such calls then fail closed.
	ListActive ListActiveFunc
	// AllowSimulatedBackend lets the client work with a sidecar whose GetInfo reports the
	// "simulated" backend. Leave it false on a real node: a simulated sidecar creates no MIG
	// instance, and a container given one of its MIG UUIDs would fail to start or, worse, see
	// another device. Without it, every call to such a sidecar fails with SIMULATED_BACKEND.
	// Tests, demos and the mock plugin set it.
	AllowSimulatedBackend bool
	// AllowSimulatedSetting is what the SIMULATED_BACKEND refusal tells the operator to set, in the
	// words of the program built on this client: a command's flag ("--allow-simulated-backend"), an
	// environment variable. Empty: "Options.AllowSimulatedBackend", for a program's own code.
	AllowSimulatedSetting string
	// DialOptions are appended to the client's own (tests, interceptors).
	DialOptions []grpc.DialOption
}

func (o Options) withDefaults() Options {
	if o.CallTimeout <= 0 {
		o.CallTimeout = DefaultCallTimeout
	}
	if o.AllocateTimeout <= 0 {
		o.AllocateTimeout = DefaultAllocateTimeout
	}
	if o.MaxAttempts < 0 {
		o.MaxAttempts = 0
	}
	if o.Backoff.Initial <= 0 {
		o.Backoff.Initial = DefaultBackoffInitial
	}
	if o.Backoff.Max < o.Backoff.Initial {
		o.Backoff.Max = max(DefaultBackoffMax, o.Backoff.Initial)
	}
	return o
}

// Client talks to one sidecar over its Unix socket. It is safe for concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	rpc    pb.MigSidecarClient
	target string
	opts   Options

	mu       sync.Mutex
	seen     *incarnation
	restarts int
	// backendOK: a GetInfo answer from the process now behind the socket showed a backend this
	// client may use. Cleared whenever that process may have changed (the connection left
	// READY, a connection-level UNAVAILABLE, a NOT_RECOVERED answer), so the next call checks
	// again before it sends anything.
	backendOK bool
	// known is the largest generation this sidecar answered with (GetInfo or a call's answer),
	// meaningful once seen is set. Generations never go back, across restarts too, so it is never above the
	// sidecar's current one: a pod list taken after it was read may be fenced with it
	// (ReleaseWithKnownGeneration) without a GetInfo first. Every GetInfo sets it (0 is a
	// generation too); one that sees another process resets it to that process's value.
	known uint64

	// recovering holds a token while a recovery runs, so that concurrent calls that all hit
	// NOT_RECOVERED share one Recover. A channel rather than a mutex: a call waits for the
	// token only as long as its own context allows.
	recovering chan struct{}
}

// New prepares a client for the sidecar listening on socketPath. It does not wait for the
// sidecar: at node start the plugin may come up first, and each call waits for the socket
// (wait-for-ready) within its own deadline instead.
func New(ctx context.Context, socketPath string, opts Options) (*Client, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if socketPath == "" {
		return nil, errors.New("migclient: empty socket path")
	}
	abs, err := filepath.Abs(socketPath)
	if err != nil {
		return nil, fmt.Errorf("migclient: socket path %q: %w", socketPath, err)
	}
	opts = opts.withDefaults()
	target := "unix://" + abs
	dial := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Wait for the socket instead of failing fast: a restarting sidecar is the normal
		// case, and every call carries a deadline that bounds the wait.
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)),
		// gRPC's default reconnect backoff grows to two minutes; a local socket that comes
		// back should be noticed within a call's deadline, so keep the delay short.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   time.Second,
			},
			MinConnectTimeout: 2 * time.Second,
		}),
	}
	conn, err := grpc.NewClient(target, append(dial, opts.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("migclient: dial %s: %w", target, err)
	}
	conn.Connect()
	c := &Client{
		conn: conn, rpc: pb.NewMigSidecarClient(conn), target: target, opts: opts,
		recovering: make(chan struct{}, 1),
	}
	go c.watchConnection()
	return c, nil
}

// watchConnection forgets the backend check whenever the connection leaves READY: the next
// connection may reach another sidecar process (restarted with other flags, or replaced by
// hand) that another client has already recovered, so no NOT_RECOVERED would reveal it. It
// ends when the connection is closed.
func (c *Client) watchConnection() {
	state := c.conn.GetState()
	for state != connectivity.Shutdown {
		if !c.conn.WaitForStateChange(context.Background(), state) {
			return
		}
		if state == connectivity.Ready {
			c.forgetBackend()
		}
		state = c.conn.GetState()
	}
}

func (c *Client) forgetBackend() {
	c.mu.Lock()
	c.backendOK = false
	c.mu.Unlock()
}

func (c *Client) backendChecked() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.backendOK
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Target is the gRPC target the client dials ("unix:///...").
func (c *Client) Target() string { return c.target }

// Restarts counts the sidecar restarts this client has noticed (boot_id or started_at changed
// between two GetInfo answers).
func (c *Client) Restarts() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.restarts
}
