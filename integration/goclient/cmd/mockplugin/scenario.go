package main

import (
	"fmt"
	"os"

	"sigs.k8s.io/yaml"
)

// Scenario is a list of pod events replayed in order. YAML or JSON.
type Scenario struct {
	Steps []Step `json:"steps"`
}

// Step is exactly one event; the field that is set says which.
type Step struct {
	// Schedule: the scheduler chose reservations for a pod and wrote hami.io/vgpu-mig-allocations.
	Schedule *ScheduleStep `json:"schedule,omitempty"`
	// Allocate: kubelet calls Allocate for one container of a scheduled pod.
	Allocate *AllocateStep `json:"allocate,omitempty"`
	// Delete: the pod is gone from the API server; the plugin releases by pod list.
	Delete *PodStep `json:"delete,omitempty"`
	// Sync: a periodic release pass without an event.
	Sync *struct{} `json:"sync,omitempty"`
	// Restart: the sidecar restarts (runs --restart-cmd); the next call recovers it.
	Restart *struct{} `json:"restart,omitempty"`
	// Undo: the plugin rolls back a container's successful Allocate (UndoAllocate).
	Undo *AllocateStep `json:"undo,omitempty"`
	// ReclaimIdle: destroy a GPU's IDLE instances (all, or those of the steps named).
	ReclaimIdle *GPUStep `json:"reclaim-idle,omitempty"`
	// DisableMig: switch a GPU to hami-core mode, destroying its IDLE instances first.
	DisableMig *GPUStep `json:"disable-mig,omitempty"`
	// State: print the sidecar's instance table.
	State *struct{} `json:"state,omitempty"`
	// Expect checks the step's result; a mismatch makes the run exit non-zero.
	Expect *Expect `json:"expect,omitempty"`
}

// ScheduleStep places a pod's containers' devices.
type ScheduleStep struct {
	Pod        string          `json:"pod"`
	Namespace  string          `json:"namespace,omitempty"`
	UID        string          `json:"uid,omitempty"`
	Containers []ContainerSpec `json:"containers"`
}

// ContainerSpec lists one container's devices in device-index order.
type ContainerSpec struct {
	Name    string       `json:"name"`
	Devices []DeviceSpec `json:"devices"`
}

// DeviceSpec names the GPU by index (resolved through ListGpus) or by UUID.
type DeviceSpec struct {
	GPU       *uint32       `json:"gpu,omitempty"`
	GPUUUID   string        `json:"gpuUUID,omitempty"`
	Profile   string        `json:"profile"`
	Placement PlacementSpec `json:"placement"`
}

// PlacementSpec is the scheduler's {start,size}.
type PlacementSpec struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

// AllocateStep allocates container Container (HAMi's index, init containers first).
type AllocateStep struct {
	Pod       string `json:"pod"`
	Namespace string `json:"namespace,omitempty"`
	Container uint32 `json:"container"`
}

// GPUStep names a GPU by index and, for reclaim-idle, the MIG UUIDs returned by earlier
// allocate steps (1-based step numbers); none means every IDLE instance of the GPU.
type GPUStep struct {
	GPU       uint32 `json:"gpu"`
	MigOfStep []int  `json:"migOfStep,omitempty"`
}

// PodStep names a pod.
type PodStep struct {
	Pod       string `json:"pod"`
	Namespace string `json:"namespace,omitempty"`
}

// Expect states what a step must return.
type Expect struct {
	// Outcomes per device, e.g. [CREATED] or [REUSED, CREATED].
	Outcomes []string `json:"outcomes,omitempty"`
	// Reason of the expected error (e.g. PLACEMENT_BUSY); "" expects success.
	Reason string `json:"reason,omitempty"`
	// Reclaimed, Idled: counts of instances.
	Reclaimed *int `json:"reclaimed,omitempty"`
	Idled     *int `json:"idled,omitempty"`
	Destroyed *int `json:"destroyed,omitempty"`
	// SameMigAsStep: the allocation returned the MIG UUIDs of that earlier step (1-based).
	SameMigAsStep int `json:"sameMigAsStep,omitempty"`
}

func loadScenario(path string) (Scenario, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Scenario{}, err
	}
	var s Scenario
	if err := yaml.UnmarshalStrict(data, &s); err != nil {
		return Scenario{}, fmt.Errorf("scenario %s: %w", path, err)
	}
	for i, st := range s.Steps {
		n := 0
		for _, set := range []bool{st.Schedule != nil, st.Allocate != nil, st.Delete != nil, st.Sync != nil, st.Restart != nil, st.State != nil,
			st.Undo != nil, st.ReclaimIdle != nil, st.DisableMig != nil} {
			if set {
				n++
			}
		}
		if n != 1 {
			return Scenario{}, fmt.Errorf("scenario %s: step %d must be exactly one of schedule, allocate, delete, sync, restart, state, undo, reclaim-idle, disable-mig", path, i+1)
		}
	}
	return s, nil
}
