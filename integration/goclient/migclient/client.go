package migclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
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

// Backoff spaces the retries of a call that failed with UNAVAILABLE: the n-th retry waits a
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
	// MaxAttempts caps the calls per RPC (first call included); only UNAVAILABLE is retried.
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

// call runs fn under one deadline of its own, retrying UNAVAILABLE with backoff. fn must send
// the same request every time: that is what makes a retried Allocate converge on the same
// instance.
func (c *Client) call(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
}

// retry runs fn within ctx until it succeeds, fails with anything but UNAVAILABLE, reaches
// maxAttempts (0: no cap) or runs out of time. Before each attempt it makes sure the backend
// of the sidecar behind the socket has been checked (GetInfo itself excepted).
func (c *Client) retry(ctx context.Context, op string, timeout time.Duration, maxAttempts int, fn func(context.Context) error) error {
	var last *Error // the last UNAVAILABLE answer that carried a reason (INSTANCE_IN_USE, ...)
	attempt := 0
	for {
		attempt++
		var err error
		if op != opGetInfo {
			err = c.checkBackend(ctx, op)
		}
		if err == nil {
			err = fn(ctx)
		}
		if err == nil {
			return nil
		}
		var stop *stopRetry
		if errors.As(err, &stop) {
			return err
		}
		e := fromRPC(op, err, attempt)
		switch {
		case e.Reason == ReasonNotRecovered || e.Code == codes.Unavailable && e.Reason == "":
			// A restarted sidecar, or a lost connection: maybe another process from now on.
			c.forgetBackend()
		case e.Code == codes.Unavailable && e.Reason != ReasonSidecarUnreachable:
			last = e
		}
		if e.Code != codes.Unavailable || maxAttempts > 0 && attempt >= maxAttempts {
			return c.finalError(ctx, op, timeout, e, attempt, last)
		}
		if !c.pause(ctx, attempt) {
			return c.finalError(ctx, op, timeout, e, attempt, last)
		}
	}
}

// finalError turns the last error of a call into the error the caller sees.
//
// When time ran out, the sidecar's last reason wins over a bare deadline: a plugin that logs
// "INSTANCE_IN_USE after 60s" knows that a pod in its grace period still holds the instance,
// not that the sidecar hung. Failing that, a call that ran out of time while the connection was
// not ready is SIDECAR_UNREACHABLE, so the plugin can tell "the sidecar is down" from "the
// sidecar said no". A call the caller cancelled is neither: see cancelledError.
func (c *Client) finalError(ctx context.Context, op string, timeout time.Duration, e *Error, attempts int, last *Error) error {
	e.Attempts = attempts
	if ctx.Err() == nil && e.Code != codes.DeadlineExceeded {
		if e.Code == codes.Unavailable && e.Reason == "" {
			return c.attemptsRanOut(op, e, attempts, last)
		}
		return e
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return cancelledError(ctx, op, e, attempts, last)
	}
	// gRPC can answer DEADLINE_EXCEEDED (the server's timer, from the grpc-timeout header)
	// a moment before ctx's own timer fires; either way the call's deadline is what ended it.
	// Such an answer came from the sidecar, so the sidecar is reachable whatever state the
	// connection shows (gRPC hands a ready connection to calls a moment before GetState
	// reports it READY).
	timeUp := ctx.Err()
	answered := timeUp == nil
	if timeUp == nil {
		timeUp = context.DeadlineExceeded
	}
	if last != nil {
		out := *last
		out.Op, out.Attempts = op, attempts
		out.Metadata = maps.Clone(last.Metadata)
		out.Message = fmt.Sprintf("%s (still the answer when the deadline of %s ran out; the same request may succeed later)",
			last.Message, timeout)
		causes := []error{last.cause}
		if e.cause != last.cause {
			causes = append(causes, e.cause)
		}
		out.cause = errors.Join(append(causes, timeUp)...)
		return &out
	}
	if e.Code == codes.Unavailable && e.Reason != "" {
		return e
	}
	if state := c.conn.GetState(); state != connectivity.Ready && !answered {
		return &Error{
			Op: op, Code: codes.Unavailable, Reason: ReasonSidecarUnreachable, Attempts: attempts, cause: e.cause,
			Message: fmt.Sprintf("no sidecar answered on %s within %s (connection %s); nothing was changed by this call",
				c.target, timeout, state),
		}
	}
	e.Code = codes.DeadlineExceeded
	e.Message = fmt.Sprintf("sidecar did not answer within %s: %s; retry with the same request", timeout, e.Message)
	if !errors.Is(e.cause, timeUp) {
		e.cause = errors.Join(e.cause, timeUp)
	}
	return e
}

// attemptsRanOut is the error of a call whose MaxAttempts ran out on an UNAVAILABLE answer
// without a reason: gRPC's own, for a connection lost or refused, or a sidecar shutting down.
// As when time runs out, the sidecar's last reason wins; failing that, the sidecar never gave
// one and is SIDECAR_UNREACHABLE, so the plugin can tell "the sidecar is down" from "the
// sidecar said no" whichever limit ended the retries.
func (c *Client) attemptsRanOut(op string, e *Error, attempts int, last *Error) *Error {
	if last != nil {
		out := *last
		out.Op, out.Attempts = op, attempts
		out.Metadata = maps.Clone(last.Metadata)
		out.Message = fmt.Sprintf("%s (the sidecar's last reason; the attempts ran out on %s)", last.Message, e.detail())
		out.cause = errors.Join(last.cause, e.cause)
		return &out
	}
	return &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonSidecarUnreachable, Attempts: attempts, cause: e.cause,
		Message: fmt.Sprintf("the sidecar on %s answered UNAVAILABLE without a reason until the attempts ran out "+
			"(connection lost or refused, or the sidecar shutting down): %s; the same request may succeed later", c.target, e.Message),
	}
}

// cancelledError is the error of a call its caller cancelled: CANCELLED, which satisfies
// errors.Is(err, context.Canceled). The sidecar neither failed to answer nor refused, so the
// error carries no reason (a reason would say the sidecar refused this call); the sidecar's last
// answer, if there was one, is named in the message and kept in the chain.
func cancelledError(ctx context.Context, op string, e *Error, attempts int, last *Error) *Error {
	if last == nil && e.Code == codes.Canceled && errors.Is(e.cause, context.Canceled) {
		return e // already made here, by the backend check's GetInfo under the same context
	}
	msg := "cancelled by the caller before the sidecar answered"
	causes := []error{}
	switch {
	case last != nil:
		msg = "cancelled by the caller; the sidecar's last answer was " + last.detail()
		causes = append(causes, last.cause)
	case e.Code != codes.Canceled && e.Code != codes.DeadlineExceeded:
		msg = "cancelled by the caller; the last attempt ended with " + e.detail()
	}
	if last == nil || e.cause != last.cause {
		causes = append(causes, e.cause)
	}
	causes = append(causes, contextErrors(ctx)...)
	return &Error{Op: op, Code: codes.Canceled, Message: msg, Attempts: attempts, cause: errors.Join(causes...)}
}

// contextErrors is why ctx ended: its Err, and the cause given to its cancel function if that
// is another error.
func contextErrors(ctx context.Context) []error {
	errs := []error{ctx.Err()}
	if cause := context.Cause(ctx); cause != nil && cause != ctx.Err() {
		errs = append(errs, cause)
	}
	return errs
}

// pause waits out the backoff after the given attempt; false when ctx ended first.
func (c *Client) pause(ctx context.Context, attempt int) bool {
	if ctx.Err() != nil {
		return false // a select below would pick at random between a done ctx and a fired timer
	}
	t := time.NewTimer(c.delay(attempt))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (c *Client) delay(attempt int) time.Duration {
	d := c.opts.Backoff.Initial << min(attempt-1, 20)
	if d <= 0 || d > c.opts.Backoff.Max {
		d = c.opts.Backoff.Max
	}
	return d/2 + rand.N(d/2+1)
}

// withRecovery runs a mutating call; if the sidecar answers NOT_RECOVERED it recovers it (when
// a ListActive callback is configured) and repeats the call exactly once. One deadline covers
// the call, the recovery and the repeat: kubelet waits on Allocate as a whole.
func (c *Client) withRecovery(ctx context.Context, op string, timeout time.Duration, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
	if !IsReason(err, ReasonNotRecovered) {
		return err
	}
	if rerr := c.recoverFor(ctx, op, timeout, err); rerr != nil {
		return rerr
	}
	return c.retry(ctx, op, timeout, c.opts.MaxAttempts, fn)
}

// recoverFor runs Recover on behalf of op, within ctx, whose deadline is timeout long. Only one
// Recover runs at a time; callers that waited for it find the sidecar recovered and skip their
// own. A caller waits only as long as ctx allows: one whose context ends first says it was
// waiting for that recovery rather than blaming the sidecar (recoveryWaitError).
//
// The pod list is fenced like a release: GetInfo before it and again after it. If the sidecar
// restarted or its generation moved in between, the list may miss allocations made meanwhile,
// so it is thrown away and the recovery starts over at once; after recoverTries such passes it
// fails with RECOVERY_FAILED. If someone else recovered the sidecar meanwhile, nothing is sent.
//
// Recover answered UNAVAILABLE (NVML_ERROR or STATE_WRITE_FAILED while the sidecar gathers or
// records, or a connection lost to a restart) may succeed later, as the contract says. It is
// never repeated with the same list: after a backoff the recovery starts over with a fresh one,
// until ctx ends (or MaxAttempts Recover calls were made). The error then keeps the sidecar's
// last answer, as finalError does for any call, so "NVML_ERROR after 60s" reaches the plugin.
func (c *Client) recoverFor(ctx context.Context, op string, timeout time.Duration, cause error) error {
	if c.opts.ListActive == nil {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonNotRecovered, Attempts: 1, cause: cause,
			Message: "the sidecar has not recovered and this client has no ListActive callback to recover it",
		}
	}
	select {
	case c.recovering <- struct{}{}:
	case <-ctx.Done():
		return recoveryWaitError(ctx, op, cause)
	}
	defer func() { <-c.recovering }()
	rop := "Recover (needed by " + op + ")"
	var (
		spoiled  error  // why the last pod list was thrown away
		passes   int    // pod lists thrown away
		attempts int    // Recover calls made
		lastE    *Error // Recover's last UNAVAILABLE answer
		last     *Error // the last of them that carried a reason
	)
	// gaveUp is the error of a step that failed: once Recover has answered UNAVAILABLE, a step
	// that failed because ctx ended reports that answer with the deadline, not the step.
	gaveUp := func(err error) error {
		if lastE == nil || ctx.Err() == nil {
			return err
		}
		return c.finalError(ctx, rop, timeout, lastE, attempts, last)
	}
	for passes < recoverTries {
		before, err := c.getInfo(ctx)
		if err != nil {
			return gaveUp(err)
		}
		if before.Recovered {
			return nil
		}
		active, err := c.opts.ListActive(ctx)
		if err != nil {
			if lastE != nil && ctx.Err() != nil {
				return gaveUp(err)
			}
			// Never a partial list: the sidecar would take a missing allocation for a released one.
			return &Error{
				Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
				Message: fmt.Sprintf("listing active allocations to recover the sidecar: %v; Recover not sent", err),
			}
		}
		after, err := c.getInfo(ctx)
		if err != nil {
			return gaveUp(err)
		}
		if after.Recovered {
			return nil
		}
		if after.incarnation() != before.incarnation() || after.Generation != before.Generation {
			spoiled = fmt.Errorf("the sidecar restarted or handed out generations while the pod list was taken "+
				"(boot %s generation %d -> boot %s generation %d)", before.BootID, before.Generation, after.BootID, after.Generation)
			passes++
			continue
		}
		req := &pb.RecoverRequest{Active: active}
		attempts++
		err = c.call(ctx, rop, c.opts.CallTimeout, func(ctx context.Context) error {
			_, err := c.rpc.Recover(ctx, req)
			if CodeOf(err) == codes.Unavailable {
				// Do not repeat this list on whatever answers next: start over instead.
				return &stopRetry{err}
			}
			return err
		})
		var stop *stopRetry
		if !errors.As(err, &stop) {
			return gaveUp(err) // nil once recovered
		}
		lastE = fromRPC(rop, stop.err, attempts)
		if lastE.Reason != "" {
			last = lastE
		}
		if c.opts.MaxAttempts > 0 && attempts >= c.opts.MaxAttempts {
			return c.finalError(ctx, rop, timeout, lastE, attempts, last)
		}
		if !c.pause(ctx, attempts) {
			return c.finalError(ctx, rop, timeout, lastE, attempts, last)
		}
	}
	return &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonRecoveryFailed, Attempts: recoverTries, cause: spoiled,
		Message: fmt.Sprintf("the sidecar could not be recovered: it restarted or handed out generations during each of %d pod lists, "+
			"and no Recover was sent with a list that could be stale: %v", recoverTries, spoiled),
	}
}

// recoveryWaitError is the error of a call whose context ended while another call's recovery
// held the token: the sidecar was not slow to answer this call, it has not recovered yet and
// the recovery under way (its pod list, or Recover) has not finished. cause is what showed the
// sidecar not recovered (the NOT_RECOVERED answer), nil when GetInfo showed it.
func recoveryWaitError(ctx context.Context, op string, cause error) *Error {
	attempts := 1
	var e *Error
	if errors.As(cause, &e) {
		attempts = e.Attempts
	}
	out := &Error{Op: op, Attempts: attempts, cause: errors.Join(append([]error{cause}, contextErrors(ctx)...)...)}
	if errors.Is(ctx.Err(), context.Canceled) {
		out.Code = codes.Canceled
		out.Message = "cancelled by the caller while waiting for the recovery another call has under way " +
			"(the sidecar has not recovered: " + ReasonNotRecovered + "); the call was not repeated"
		return out
	}
	out.Code, out.Reason = codes.DeadlineExceeded, ReasonNotRecovered
	out.Message = "the sidecar has not recovered, and the deadline ran out while this call waited for the recovery " +
		"another call has under way (its pod list or Recover); the call was not repeated and may succeed once the sidecar has recovered"
	return out
}

// stopRetry carries an UNAVAILABLE answer out of retry without repeating the call.
type stopRetry struct{ err error }

func (s *stopRetry) Error() string { return s.err.Error() }
func (s *stopRetry) Unwrap() error { return s.err }

const opGetInfo = "GetInfo"

// getInfo calls GetInfo, notes a restart, and checks the backend, without triggering recovery.
func (c *Client) getInfo(ctx context.Context) (Info, error) {
	var resp *pb.GetInfoResponse
	err := c.call(ctx, opGetInfo, c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.GetInfo(ctx, &pb.GetInfoRequest{})
		return err
	})
	if err != nil {
		return Info{}, err
	}
	info := infoFromPB(resp)
	inc := info.incarnation()
	berr := c.admitBackend(info)
	c.mu.Lock()
	if c.seen != nil && *c.seen != inc {
		c.restarts++
	}
	c.seen = &inc
	c.backendOK = berr == nil
	c.mu.Unlock()
	if berr != nil {
		return Info{}, berr
	}
	return info, nil
}

// admitBackend fails closed on a sidecar this client must not use: a simulated one unless
// Options.AllowSimulatedBackend, or one naming a backend this client does not know.
func (c *Client) admitBackend(info Info) error {
	md := map[string]string{"backend": info.Backend, "sidecar_version": info.SidecarVersion, "boot_id": info.BootID}
	switch {
	case info.Backend == BackendNVML:
		return nil
	case info.Backend == BackendSimulated && c.opts.AllowSimulatedBackend:
		return nil
	case info.Backend == BackendSimulated:
		return &Error{
			Op: opGetInfo, Code: codes.FailedPrecondition, Reason: ReasonSimulatedBackend, Metadata: md, Attempts: 1,
			Message: fmt.Sprintf("the sidecar on %s runs the simulated NVML backend: it creates no real MIG instance, "+
				"so nothing was sent; set Options.AllowSimulatedBackend only for tests and demos", c.target),
		}
	default:
		return &Error{
			Op: opGetInfo, Code: codes.FailedPrecondition, Reason: ReasonInvalidResponse, Metadata: md, Attempts: 1,
			Message: fmt.Sprintf("the sidecar on %s reports backend %q, neither %q nor %q; nothing was sent",
				c.target, info.Backend, BackendNVML, BackendSimulated),
		}
	}
}

// checkBackend makes sure the sidecar now behind the socket was checked by a GetInfo answer
// before op sends anything to it. It costs one GetInfo after each (re)connection.
func (c *Client) checkBackend(ctx context.Context, op string) error {
	if c.backendChecked() {
		return nil
	}
	_, err := c.getInfo(ctx)
	var e *Error
	if errors.As(err, &e) && e.Reason != ReasonSidecarUnreachable {
		e.Op = opGetInfo + " (needed by " + op + ")"
	}
	return err
}

// GetInfo returns the sidecar's identity. When it shows a sidecar that has not recovered (a
// restart, or the first start of the node) and a ListActive callback is configured, the client
// recovers it first and returns the identity after recovery.
func (c *Client) GetInfo(ctx context.Context) (Info, error) {
	info, err := c.getInfo(ctx)
	if err != nil || info.Recovered || c.opts.ListActive == nil {
		return info, err
	}
	if err := c.recoverWithin(ctx, "GetInfo", nil); err != nil {
		return Info{}, err
	}
	return c.getInfo(ctx)
}

// recoverWithin runs a recovery that no deadline of its call bounds (GetInfo, ReleaseByPodList:
// their context may have none) under CallTimeout, as Release's and SetMigMode's recoveries are
// bounded by theirs, so that the pod list never runs without a deadline.
func (c *Client) recoverWithin(ctx context.Context, op string, cause error) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.CallTimeout)
	defer cancel()
	return c.recoverFor(ctx, op, c.opts.CallTimeout, cause)
}

// EnsureRecovered is what the plugin calls at startup before serving kubelet: it returns once
// the sidecar has recovered, recovering it with ListActive when needed.
func (c *Client) EnsureRecovered(ctx context.Context) (Info, error) {
	info, err := c.GetInfo(ctx)
	if err != nil {
		return Info{}, err
	}
	if !info.Recovered {
		return Info{}, newError("EnsureRecovered", codes.FailedPrecondition, ReasonNotRecovered,
			"the sidecar has not recovered and no ListActive callback is configured", nil)
	}
	return info, nil
}

// Recover sends the plugin's active allocations for startup recovery. It is idempotent.
func (c *Client) Recover(ctx context.Context, active []*pb.ActiveAllocation) (RecoverReport, error) {
	req := &pb.RecoverRequest{Active: active}
	var resp *pb.RecoverResponse
	err := c.call(ctx, "Recover", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Recover(ctx, req)
		return err
	})
	if err != nil {
		return RecoverReport{}, err
	}
	return recoverReportFromPB(resp), nil
}

// Allocate realizes the reservations of one container, all or nothing. UNAVAILABLE answers
// (and a connection lost mid-call) are retried with the identical request, so the allocation
// key is the same and a call that already succeeded server-side answers ALREADY_ALLOCATED.
// The result always holds exactly one device per requested device, in request order; any
// other answer is an INVALID_RESPONSE error, never a partial success.
func (c *Client) Allocate(ctx context.Context, req AllocateRequest) (AllocateResult, error) {
	if err := validateAllocate(req); err != nil {
		return AllocateResult{}, err
	}
	pbReq := req.toPB()
	var resp *pb.AllocateResponse
	err := c.withRecovery(ctx, "Allocate", c.opts.AllocateTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Allocate(ctx, pbReq)
		return err
	})
	if err != nil {
		return AllocateResult{}, err
	}
	return allocateResult(req, resp)
}

func validateAllocate(req AllocateRequest) error {
	bad := func(msg string, args ...any) error {
		return newError("Allocate", codes.InvalidArgument, ReasonInvalidRequest, fmt.Sprintf(msg, args...), nil)
	}
	if req.Pod.UID == "" {
		return bad("pod UID is empty")
	}
	if len(req.Devices) == 0 {
		return bad("no devices requested for pod %s container %d", req.Pod.UID, req.ContainerIndex)
	}
	seen := make(map[uint32]bool, len(req.Devices))
	for _, d := range req.Devices {
		if seen[d.DeviceIndex] {
			return bad("device index %d requested twice", d.DeviceIndex)
		}
		seen[d.DeviceIndex] = true
		if d.GPUUUID == "" || d.Profile == "" || d.Placement.Size == 0 {
			return bad("device %d: GPU UUID, profile and a placement of size > 0 are required", d.DeviceIndex)
		}
	}
	return nil
}

// migUUIDPrefix starts every MIG UUID NVML hands out (MIG-<uuid>, and the legacy
// MIG-GPU-<uuid>/<gi>/<ci>), as hami.io/vgpu-mig-allocations requires.
const migUUIDPrefix = "MIG-"

// allocateResult checks that the answer covers every requested device with the requested
// reservation and a complete runtime identity whose MIG UUID is one.
func allocateResult(req AllocateRequest, resp *pb.AllocateResponse) (AllocateResult, error) {
	invalid := func(msg string, args ...any) (AllocateResult, error) {
		return AllocateResult{}, newError("Allocate", codes.Internal, ReasonInvalidResponse, fmt.Sprintf(msg, args...), nil)
	}
	byIndex := make(map[uint32]*pb.AllocatedDevice, len(resp.GetDevices()))
	for _, d := range resp.GetDevices() {
		if _, dup := byIndex[d.GetDeviceIndex()]; dup {
			return invalid("device %d answered twice", d.GetDeviceIndex())
		}
		byIndex[d.GetDeviceIndex()] = d
	}
	if len(byIndex) != len(req.Devices) {
		return invalid("asked for %d devices, got %d", len(req.Devices), len(byIndex))
	}
	out := AllocateResult{Devices: make([]AllocatedDevice, 0, len(req.Devices)), Reclaimed: instanceRefsFromPB(resp.GetReclaimed())}
	for _, want := range req.Devices {
		got, ok := byIndex[want.DeviceIndex]
		if !ok {
			return invalid("device %d missing from the answer", want.DeviceIndex)
		}
		dev := AllocatedDevice{
			DeviceIndex:       got.GetDeviceIndex(),
			GPUUUID:           got.GetGpuUuid(),
			Profile:           got.GetProfile(),
			Placement:         placementFromPB(got.GetPlacement()),
			MigUUID:           got.GetMigUuid(),
			GPUInstanceID:     got.GetGpuInstanceId(),
			ComputeInstanceID: got.GetComputeInstanceId(),
			CDIDevice:         got.GetCdiDevice(),
			Outcome:           outcomeFromPB(got.GetOutcome()),
		}
		if dev.GPUUUID != want.GPUUUID || dev.Profile != want.Profile || dev.Placement != want.Placement {
			return invalid("device %d: asked for %s %s at %s, got %s %s at %s", want.DeviceIndex,
				want.GPUUUID, want.Profile, want.Placement, dev.GPUUUID, dev.Profile, dev.Placement)
		}
		if dev.MigUUID == "" || dev.Outcome == OutcomeUnspecified {
			return invalid("device %d: answer has no MIG UUID or no outcome", want.DeviceIndex)
		}
		if !strings.HasPrefix(dev.MigUUID, migUUIDPrefix) {
			// The sidecar hands out only MIG-<uuid> (it fails closed on anything else the driver
			// names a new instance); a GPU UUID here would give the container the whole GPU.
			return invalid("device %d: %q is not a MIG UUID (want %s...)", want.DeviceIndex, dev.MigUUID, migUUIDPrefix)
		}
		out.Devices = append(out.Devices, dev)
	}
	return out, nil
}

// Release reports a confirmed release of a pod: its ACTIVE instances become IDLE. Prefer
// ReleaseByPodList, which is level-triggered and cannot lose a release.
func (c *Client) Release(ctx context.Context, podUID string) ([]InstanceRef, error) {
	if podUID == "" {
		return nil, newError("Release", codes.InvalidArgument, ReasonInvalidRequest, "pod UID is empty", nil)
	}
	req := &pb.ReleaseRequest{PodUid: podUID}
	var resp *pb.ReleaseResponse
	err := c.withRecovery(ctx, "Release", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.Release(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	return instanceRefsFromPB(resp.GetReleased()), nil
}

// SyncActive sends a pod list taken after generation was read from the same sidecar process.
// It is not retried after a recovery: a fence read from another run of the sidecar proves
// nothing about this one, so the caller must read the generation again (ReleaseByPodList does).
func (c *Client) SyncActive(ctx context.Context, generation uint64, active []*pb.ActiveAllocation) (SyncResult, error) {
	req := &pb.SyncActiveRequest{Generation: generation, Active: active}
	var resp *pb.SyncActiveResponse
	err := c.call(ctx, "SyncActive", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SyncActive(ctx, req)
		return err
	})
	if err != nil {
		return SyncResult{}, err
	}
	return SyncResult{
		Generation:  generation,
		Idled:       instanceRefsFromPB(resp.GetIdled()),
		Reactivated: instanceRefsFromPB(resp.GetReactivated()),
	}, nil
}

// ReleaseByPodList is the plugin's release path: read the generation, then list pods, then
// SyncActive with that generation. Reading the generation first is the fence: an Allocate that
// completes while the list is being taken has a later generation, so the sidecar keeps it
// ACTIVE even though the list does not show it yet. A failed list sends nothing.
//
// A generation belongs to one sidecar process. GetInfo is read again after the list: if the
// sidecar restarted meanwhile (its boot id or start time changed), the pass starts over with a
// fresh generation and a fresh list instead of sending a fence from another run; so does a
// SyncActive answered NOT_RECOVERED (after recovering the sidecar), and a sidecar that restarted
// again right after the first GetInfo recovered it (no list is taken then). After recoverTries
// such restarts the pass fails with SIDECAR_RESTARTED and released nothing; the next pass
// retries. A sidecar that has not recovered, with no ListActive callback to recover it, fails
// the pass at once with NOT_RECOVERED before any pod list is taken.
func (c *Client) ReleaseByPodList(ctx context.Context, listActive ListActiveFunc) (SyncResult, error) {
	const op = "ReleaseByPodList"
	if listActive == nil {
		return SyncResult{}, newError(op, codes.InvalidArgument, ReasonInvalidRequest, "no pod-list callback", nil)
	}
	notRecovered := func(info Info, why string) error {
		return &Error{
			Op: op, Code: codes.FailedPrecondition, Reason: ReasonNotRecovered, Attempts: 1,
			Message: fmt.Sprintf("nothing released: the sidecar (boot %s started %s) has not recovered, %s",
				info.BootID, info.StartedAt.Format(time.RFC3339Nano), why),
		}
	}
	var lastErr error
	for range recoverTries {
		before, err := c.GetInfo(ctx)
		if err != nil {
			return SyncResult{}, err
		}
		if !before.Recovered {
			if c.opts.ListActive == nil {
				return SyncResult{}, notRecovered(before, "and this client has no ListActive callback to recover it; no pod list was taken")
			}
			// GetInfo recovered the sidecar, and it restarted again before GetInfo read it back
			// (recover succeeded, so this is another process): start over and recover it again
			// rather than take a list that SyncActive would refuse.
			lastErr = fmt.Errorf("the sidecar restarted again right after its recovery (now boot %s started %s)",
				before.BootID, before.StartedAt.Format(time.RFC3339Nano))
			continue
		}
		active, err := listActive(ctx)
		if err != nil {
			return SyncResult{}, &Error{
				Op: op, Code: codes.FailedPrecondition, Reason: ReasonPodListFailed, Attempts: 1, cause: err,
				Message: fmt.Sprintf("pod list failed, nothing released: %v", err),
			}
		}
		after, err := c.getInfo(ctx)
		if err != nil {
			return SyncResult{}, err
		}
		if after.incarnation() != before.incarnation() {
			lastErr = fmt.Errorf("the sidecar restarted while the pod list was taken (boot %s started %s -> boot %s started %s, recovered=%t)",
				before.BootID, before.StartedAt.Format(time.RFC3339Nano), after.BootID, after.StartedAt.Format(time.RFC3339Nano), after.Recovered)
			continue
		}
		if !after.Recovered {
			// The same process no longer says it recovered: a sidecar that contradicts itself
			// gets nothing.
			return SyncResult{}, notRecovered(after, "although it had before the pod list was taken; the list was not sent")
		}
		res, err := c.SyncActive(ctx, before.Generation, active)
		if IsReason(err, ReasonNotRecovered) && c.opts.ListActive != nil {
			// The sidecar restarted between the second GetInfo and SyncActive: recover, then
			// start over with a fresh generation and a fresh list.
			if rerr := c.recoverWithin(ctx, op, err); rerr != nil {
				return SyncResult{}, rerr
			}
			lastErr = err
			continue
		}
		return res, err
	}
	return SyncResult{}, &Error{
		Op: op, Code: codes.Unavailable, Reason: ReasonSidecarRestarted, Attempts: recoverTries, cause: lastErr,
		Message: fmt.Sprintf("nothing released: the sidecar kept restarting during %d passes: %v", recoverTries, lastErr),
	}
}

// ListGpus returns the node's GPUs with their MIG mode.
func (c *Client) ListGpus(ctx context.Context) ([]GPU, error) {
	var resp *pb.ListGpusResponse
	err := c.call(ctx, "ListGpus", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.ListGpus(ctx, &pb.ListGpusRequest{})
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]GPU, 0, len(resp.GetGpus()))
	for _, g := range resp.GetGpus() {
		out = append(out, GPU{
			Index: g.GetIndex(), UUID: g.GetUuid(), Minor: g.GetMinor(), Model: g.GetModel(),
			MemoryMB: g.GetMemoryMb(), MigMode: migModeFromPB(g.GetMigMode()), Busy: g.GetBusy(),
		})
	}
	return out, nil
}

// DiscoverProfiles returns the profiles of one GPU (allowed names only; nil = all).
func (c *Client) DiscoverProfiles(ctx context.Context, gpuUUID string, allowed []string) ([]Profile, error) {
	req := &pb.DiscoverProfilesRequest{GpuUuid: gpuUUID, AllowedProfiles: allowed}
	var resp *pb.DiscoverProfilesResponse
	err := c.call(ctx, "DiscoverProfiles", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.DiscoverProfiles(ctx, req)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make([]Profile, 0, len(resp.GetProfiles()))
	for _, p := range resp.GetProfiles() {
		pls := make([]Placement, 0, len(p.GetPlacements()))
		for _, pl := range p.GetPlacements() {
			pls = append(pls, placementFromPB(pl))
		}
		out = append(out, Profile{
			Name: p.GetName(), GIProfileID: p.GetGiProfileId(), CIProfileID: p.GetCiProfileId(),
			SliceCount: p.GetSliceCount(), MemoryMB: p.GetMemoryMb(), CorePercent: p.GetCorePercent(),
			InstanceCount: p.GetInstanceCount(), Placements: pls,
		})
	}
	return out, nil
}

// GetState returns the sidecar's full view for operators. It passes the contract message
// through unchanged: it is read by tools, not by allocation logic.
func (c *Client) GetState(ctx context.Context) (*pb.GetStateResponse, error) {
	var resp *pb.GetStateResponse
	err := c.call(ctx, "GetState", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.GetState(ctx, &pb.GetStateRequest{})
		return err
	})
	return resp, err
}

// SetMigMode enables or disables MIG mode on one GPU.
func (c *Client) SetMigMode(ctx context.Context, gpuUUID string, enabled bool) (SetMigModeResult, error) {
	req := &pb.SetMigModeRequest{GpuUuid: gpuUUID, Enabled: enabled}
	var resp *pb.SetMigModeResponse
	err := c.withRecovery(ctx, "SetMigMode", c.opts.CallTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rpc.SetMigMode(ctx, req)
		return err
	})
	if err != nil {
		return SetMigModeResult{}, err
	}
	return SetMigModeResult{MigMode: migModeFromPB(resp.GetMigMode()), NeedsReset: resp.GetNeedsReset()}, nil
}
