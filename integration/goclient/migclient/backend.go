package migclient

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"
)

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
		c.known = 0 // a generation of the process before is no fence for this one
	}
	c.known = max(c.known, info.Generation)
	c.seen = &inc
	c.backendOK = berr == nil
	c.mu.Unlock()
	if berr != nil {
		return Info{}, berr
	}
	return info, nil
}

// admitBackend fails closed on a sidecar this client must not use: a simulated one unless
// Options.AllowSimulatedBackend (the refusal names Options.AllowSimulatedSetting), or one naming a
// backend this client does not know.
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
				"so nothing was sent; set %s only for tests and demos", c.target, c.allowSimulatedSetting()),
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

// allowSimulatedSetting names what allows a simulated backend, as Options.AllowSimulatedSetting says.
func (c *Client) allowSimulatedSetting() string {
	if c.opts.AllowSimulatedSetting != "" {
		return c.opts.AllowSimulatedSetting
	}
	return "Options.AllowSimulatedBackend"
}
