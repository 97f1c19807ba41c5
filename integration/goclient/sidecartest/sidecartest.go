// Package sidecartest is a test double of the sidecar for HAMi's own tests of its port
// (docs/porting-hami.md, "HAMi's tests"): the contract's real gRPC service, in process, over a
// Unix socket in the test's temp directory, with an instance table in the contract's states and
// no NVML, no records and no Python. HAMi's tests point HAMI_MIG_SIDECAR_SOCKET at Socket, set
// HAMI_MIG_SIDECAR_ALLOW_SIMULATED=true (the double reports the simulated backend) and assert
// what the table holds afterwards.
//
// It answers as the sidecar does for what HAMi's plugin calls (ListGpus, Recover, SyncActive,
// Allocate with reuse and reclaim of IDLE instances, UndoDevice's owner guard, GetState), far more
// simply; this repository's e2e tests hold the real sidecar to the same answers.
package sidecartest

import (
	"testing"

	pb "github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/internal/fakesidecar"
)

// Sidecar is a running double; it stops when the test ends.
type Sidecar struct {
	s *fakesidecar.Server
	// Socket is the path HAMi's plugin dials.
	Socket string
}

// Start serves a double with the given GPU UUIDs, in MIG mode, indexed 0, 1, ... in that order.
func Start(t *testing.T, gpus ...string) *Sidecar {
	s, socket := fakesidecar.Start(t, gpus...)
	return &Sidecar{s: s, Socket: socket}
}

// State is what the double holds for one MIG UUID: "ACTIVE", "IDLE" or "ERROR", the pod UID that
// holds it (empty unless ACTIVE), and "" when the instance is gone or was never there.
func (s *Sidecar) State(migUUID string) (state, podUID string) {
	for _, in := range s.s.Instances() {
		if in.MigUUID == migUUID {
			if in.Owner != nil {
				podUID = in.Owner.PodUID
			}
			return in.State.String(), podUID
		}
	}
	return "", ""
}

// PutIdle caches an IDLE instance of profile at start:size on gpu, as one a pod released, and
// returns its MIG UUID.
func (s *Sidecar) PutIdle(gpu, profile string, start, size uint32) string {
	return s.s.Put(fakesidecar.Instance{GPU: gpu, Profile: profile, Start: start, Size: size, State: pb.InstanceState_IDLE}).MigUUID
}

// SetDriverCDIDevices makes every later Allocate answer these CDI names of the node's driver, as
// the sidecar answers the name of the driver's spec it wrote, which the port hands out once beside
// the instances' names; none until it is called.
func (s *Sidecar) SetDriverCDIDevices(names ...string) { s.s.SetDriverCDIDevices(names...) }

// Count is the number of instances the double holds, in any state.
func (s *Sidecar) Count() int { return len(s.s.Instances()) }
