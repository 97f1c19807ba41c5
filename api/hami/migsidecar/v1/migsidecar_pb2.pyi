import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OwnerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OWNER_KIND_UNSPECIFIED: _ClassVar[OwnerKind]
    OWNER_KIND_POD: _ClassVar[OwnerKind]
    OWNER_KIND_CLAIM: _ClassVar[OwnerKind]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    CREATED: _ClassVar[Outcome]
    REUSED: _ClassVar[Outcome]
    ALREADY_ALLOCATED: _ClassVar[Outcome]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    CREATING: _ClassVar[InstanceState]
    ACTIVE: _ClassVar[InstanceState]
    IDLE: _ClassVar[InstanceState]
    DELETING: _ClassVar[InstanceState]
    ERROR: _ClassVar[InstanceState]

class PlacementCost(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_COST_UNSPECIFIED: _ClassVar[PlacementCost]
    REUSE: _ClassVar[PlacementCost]
    FREE: _ClassVar[PlacementCost]
    RECLAIM: _ClassVar[PlacementCost]
    BLOCKED: _ClassVar[PlacementCost]

class UndoSkip(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNDO_SKIP_UNSPECIFIED: _ClassVar[UndoSkip]
    UNDO_SKIP_UNKNOWN_INSTANCE: _ClassVar[UndoSkip]
    UNDO_SKIP_NOT_ACTIVE: _ClassVar[UndoSkip]
    UNDO_SKIP_OTHER_OWNER: _ClassVar[UndoSkip]

class InstanceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_HEALTH_UNSPECIFIED: _ClassVar[InstanceHealth]
    HEALTHY: _ClassVar[InstanceHealth]
    FAULTED: _ClassVar[InstanceHealth]
OWNER_KIND_UNSPECIFIED: OwnerKind
OWNER_KIND_POD: OwnerKind
OWNER_KIND_CLAIM: OwnerKind
OUTCOME_UNSPECIFIED: Outcome
CREATED: Outcome
REUSED: Outcome
ALREADY_ALLOCATED: Outcome
INSTANCE_STATE_UNSPECIFIED: InstanceState
CREATING: InstanceState
ACTIVE: InstanceState
IDLE: InstanceState
DELETING: InstanceState
ERROR: InstanceState
PLACEMENT_COST_UNSPECIFIED: PlacementCost
REUSE: PlacementCost
FREE: PlacementCost
RECLAIM: PlacementCost
BLOCKED: PlacementCost
UNDO_SKIP_UNSPECIFIED: UndoSkip
UNDO_SKIP_UNKNOWN_INSTANCE: UndoSkip
UNDO_SKIP_NOT_ACTIVE: UndoSkip
UNDO_SKIP_OTHER_OWNER: UndoSkip
INSTANCE_HEALTH_UNSPECIFIED: InstanceHealth
HEALTHY: InstanceHealth
FAULTED: InstanceHealth

class Placement(_message.Message):
    __slots__ = ("start", "size")
    START_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    start: int
    size: int
    def __init__(self, start: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class PodRef(_message.Message):
    __slots__ = ("uid", "namespace", "name")
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    uid: str
    namespace: str
    name: str
    def __init__(self, uid: _Optional[str] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ClaimRef(_message.Message):
    __slots__ = ("uid", "namespace", "name")
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    uid: str
    namespace: str
    name: str
    def __init__(self, uid: _Optional[str] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DeviceRequest(_message.Message):
    __slots__ = ("device_index", "gpu_uuid", "profile", "placement", "request")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    gpu_uuid: str
    profile: str
    placement: Placement
    request: str
    def __init__(self, device_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., request: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pod", "container_name", "container_index", "devices", "claim")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    container_name: str
    container_index: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceRequest]
    claim: ClaimRef
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., container_name: _Optional[str] = ..., container_index: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceRequest, _Mapping]]] = ..., claim: _Optional[_Union[ClaimRef, _Mapping]] = ...) -> None: ...

class AllocatedDevice(_message.Message):
    __slots__ = ("device_index", "gpu_uuid", "profile", "placement", "mig_uuid", "gpu_instance_id", "compute_instance_id", "cdi_device", "outcome")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CDI_DEVICE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    gpu_uuid: str
    profile: str
    placement: Placement
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    cdi_device: str
    outcome: Outcome
    def __init__(self, device_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., mig_uuid: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ..., cdi_device: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ...) -> None: ...

class InstanceRef(_message.Message):
    __slots__ = ("gpu_uuid", "profile", "placement", "mig_uuid", "gpu_instance_id", "compute_instance_id")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    profile: str
    placement: Placement
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    def __init__(self, gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., mig_uuid: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("devices", "reclaimed", "generation", "driver_cdi_devices")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DRIVER_CDI_DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[AllocatedDevice]
    reclaimed: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    generation: int
    driver_cdi_devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, devices: _Optional[_Iterable[_Union[AllocatedDevice, _Mapping]]] = ..., reclaimed: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., generation: _Optional[int] = ..., driver_cdi_devices: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pod_uid", "claim_uid")
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_UID_FIELD_NUMBER: _ClassVar[int]
    pod_uid: str
    claim_uid: str
    def __init__(self, pod_uid: _Optional[str] = ..., claim_uid: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    def __init__(self, released: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ...) -> None: ...

class ActiveAllocation(_message.Message):
    __slots__ = ("pod", "container_name", "container_index", "device_index", "gpu_uuid", "profile", "placement", "mig_uuid", "gpu_instance_id", "compute_instance_id")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    container_name: str
    container_index: int
    device_index: int
    gpu_uuid: str
    profile: str
    placement: Placement
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., container_name: _Optional[str] = ..., container_index: _Optional[int] = ..., device_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., mig_uuid: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ...) -> None: ...

class SyncActiveRequest(_message.Message):
    __slots__ = ("generation", "active")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    active: _containers.RepeatedCompositeFieldContainer[ActiveAllocation]
    def __init__(self, generation: _Optional[int] = ..., active: _Optional[_Iterable[_Union[ActiveAllocation, _Mapping]]] = ...) -> None: ...

class SyncActiveResponse(_message.Message):
    __slots__ = ("idled", "reactivated", "generation")
    IDLED_FIELD_NUMBER: _ClassVar[int]
    REACTIVATED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    idled: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    reactivated: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    generation: int
    def __init__(self, idled: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., reactivated: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class RecoverRequest(_message.Message):
    __slots__ = ("active",)
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    active: _containers.RepeatedCompositeFieldContainer[ActiveAllocation]
    def __init__(self, active: _Optional[_Iterable[_Union[ActiveAllocation, _Mapping]]] = ...) -> None: ...

class RecoverResponse(_message.Message):
    __slots__ = ("adopted_active", "restored_idle", "preserved_foreign", "adopted_foreign", "removed_orphan_gis", "dropped_stale_records", "errors")
    ADOPTED_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    RESTORED_IDLE_FIELD_NUMBER: _ClassVar[int]
    PRESERVED_FOREIGN_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FOREIGN_FIELD_NUMBER: _ClassVar[int]
    REMOVED_ORPHAN_GIS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_RECORDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    adopted_active: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    restored_idle: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    preserved_foreign: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    adopted_foreign: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    removed_orphan_gis: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    dropped_stale_records: _containers.RepeatedScalarFieldContainer[str]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adopted_active: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., restored_idle: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., preserved_foreign: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., adopted_foreign: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., removed_orphan_gis: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., dropped_stale_records: _Optional[_Iterable[str]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("api_version", "sidecar_version", "backend", "boot_id", "recovered", "cdi_enabled", "adopt_existing", "generation", "started_at", "revision")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    CDI_ENABLED_FIELD_NUMBER: _ClassVar[int]
    ADOPT_EXISTING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    api_version: str
    sidecar_version: str
    backend: str
    boot_id: str
    recovered: bool
    cdi_enabled: bool
    adopt_existing: bool
    generation: int
    started_at: _timestamp_pb2.Timestamp
    revision: int
    def __init__(self, api_version: _Optional[str] = ..., sidecar_version: _Optional[str] = ..., backend: _Optional[str] = ..., boot_id: _Optional[str] = ..., recovered: _Optional[bool] = ..., cdi_enabled: _Optional[bool] = ..., adopt_existing: _Optional[bool] = ..., generation: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class MigMode(_message.Message):
    __slots__ = ("current", "pending")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    current: bool
    pending: bool
    def __init__(self, current: _Optional[bool] = ..., pending: _Optional[bool] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "minor", "model", "memory_mb", "mig_mode", "busy")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    MIG_MODE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    minor: int
    model: str
    memory_mb: int
    mig_mode: MigMode
    busy: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., minor: _Optional[int] = ..., model: _Optional[str] = ..., memory_mb: _Optional[int] = ..., mig_mode: _Optional[_Union[MigMode, _Mapping]] = ..., busy: _Optional[bool] = ...) -> None: ...

class ListGpusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGpusResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class DiscoverProfilesRequest(_message.Message):
    __slots__ = ("gpu_uuid", "allowed_profiles")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_PROFILES_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    allowed_profiles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpu_uuid: _Optional[str] = ..., allowed_profiles: _Optional[_Iterable[str]] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("name", "gi_profile_id", "ci_profile_id", "slice_count", "memory_mb", "core_percent", "instance_count", "placements")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GI_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    CI_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    SLICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CORE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    gi_profile_id: int
    ci_profile_id: int
    slice_count: int
    memory_mb: int
    core_percent: int
    instance_count: int
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, name: _Optional[str] = ..., gi_profile_id: _Optional[int] = ..., ci_profile_id: _Optional[int] = ..., slice_count: _Optional[int] = ..., memory_mb: _Optional[int] = ..., core_percent: _Optional[int] = ..., instance_count: _Optional[int] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class DiscoverProfilesResponse(_message.Message):
    __slots__ = ("profiles",)
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[Profile]
    def __init__(self, profiles: _Optional[_Iterable[_Union[Profile, _Mapping]]] = ...) -> None: ...

class Owner(_message.Message):
    __slots__ = ("pod", "container_name", "container_index", "device_index", "kind", "claim", "request")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    container_name: str
    container_index: int
    device_index: int
    kind: OwnerKind
    claim: ClaimRef
    request: str
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., container_name: _Optional[str] = ..., container_index: _Optional[int] = ..., device_index: _Optional[int] = ..., kind: _Optional[_Union[OwnerKind, str]] = ..., claim: _Optional[_Union[ClaimRef, _Mapping]] = ..., request: _Optional[str] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("gpu_uuid", "profile", "placement", "mig_uuid", "gpu_instance_id", "compute_instance_id", "state", "owner", "cdi_device", "last_error", "since", "taken_over_from", "health", "xid", "xid64")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CDI_DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    TAKEN_OVER_FROM_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    XID64_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    profile: str
    placement: Placement
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    state: InstanceState
    owner: Owner
    cdi_device: str
    last_error: str
    since: _timestamp_pb2.Timestamp
    taken_over_from: str
    health: InstanceHealth
    xid: int
    xid64: int
    def __init__(self, gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., mig_uuid: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ..., state: _Optional[_Union[InstanceState, str]] = ..., owner: _Optional[_Union[Owner, _Mapping]] = ..., cdi_device: _Optional[str] = ..., last_error: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., taken_over_from: _Optional[str] = ..., health: _Optional[_Union[InstanceHealth, str]] = ..., xid: _Optional[int] = ..., xid64: _Optional[int] = ...) -> None: ...

class ForeignInstance(_message.Message):
    __slots__ = ("profile", "placement", "gpu_instance_id", "has_compute_instance", "compute_instance_id", "mig_uuid", "recorded_as")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_COMPUTE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AS_FIELD_NUMBER: _ClassVar[int]
    profile: str
    placement: Placement
    gpu_instance_id: int
    has_compute_instance: bool
    compute_instance_id: int
    mig_uuid: str
    recorded_as: str
    def __init__(self, profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., gpu_instance_id: _Optional[int] = ..., has_compute_instance: _Optional[bool] = ..., compute_instance_id: _Optional[int] = ..., mig_uuid: _Optional[str] = ..., recorded_as: _Optional[str] = ...) -> None: ...

class GpuState(_message.Message):
    __slots__ = ("gpu", "instances", "foreign", "unreadable")
    GPU_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    gpu: Gpu
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    foreign: _containers.RepeatedCompositeFieldContainer[ForeignInstance]
    unreadable: str
    def __init__(self, gpu: _Optional[_Union[Gpu, _Mapping]] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., foreign: _Optional[_Iterable[_Union[ForeignInstance, _Mapping]]] = ..., unreadable: _Optional[str] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("generation", "gpus", "pending_cdi_removals")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CDI_REMOVALS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuState]
    pending_cdi_removals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuState, _Mapping]]] = ..., pending_cdi_removals: _Optional[_Iterable[str]] = ...) -> None: ...

class SetMigModeRequest(_message.Message):
    __slots__ = ("gpu_uuid", "enabled", "reclaim_idle", "force")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_IDLE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    enabled: bool
    reclaim_idle: bool
    force: bool
    def __init__(self, gpu_uuid: _Optional[str] = ..., enabled: _Optional[bool] = ..., reclaim_idle: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class SetMigModeResponse(_message.Message):
    __slots__ = ("mig_mode", "needs_reset")
    MIG_MODE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_RESET_FIELD_NUMBER: _ClassVar[int]
    mig_mode: MigMode
    needs_reset: bool
    def __init__(self, mig_mode: _Optional[_Union[MigMode, _Mapping]] = ..., needs_reset: _Optional[bool] = ...) -> None: ...

class UndoAllocateRequest(_message.Message):
    __slots__ = ("pod_uid", "container_index")
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_INDEX_FIELD_NUMBER: _ClassVar[int]
    pod_uid: str
    container_index: int
    def __init__(self, pod_uid: _Optional[str] = ..., container_index: _Optional[int] = ...) -> None: ...

class UndoAllocateResponse(_message.Message):
    __slots__ = ("destroyed", "idled")
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    IDLED_FIELD_NUMBER: _ClassVar[int]
    destroyed: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    idled: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    def __init__(self, destroyed: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., idled: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ...) -> None: ...

class ReclaimIdleRequest(_message.Message):
    __slots__ = ("gpu_uuid", "mig_uuids", "force")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    MIG_UUIDS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    mig_uuids: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    def __init__(self, gpu_uuid: _Optional[str] = ..., mig_uuids: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ...) -> None: ...

class ReclaimIdleResponse(_message.Message):
    __slots__ = ("reclaimed", "kept")
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    reclaimed: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    kept: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    def __init__(self, reclaimed: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., kept: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ...) -> None: ...

class RankPlacementsRequest(_message.Message):
    __slots__ = ("gpu_uuid", "profile")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    profile: str
    def __init__(self, gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ...) -> None: ...

class RankedPlacement(_message.Message):
    __slots__ = ("placement", "cost", "idle_mig_uuid", "reclaim", "free_slices_after", "blocker")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    IDLE_MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    FREE_SLICES_AFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCKER_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    cost: PlacementCost
    idle_mig_uuid: str
    reclaim: _containers.RepeatedCompositeFieldContainer[InstanceRef]
    free_slices_after: int
    blocker: str
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., cost: _Optional[_Union[PlacementCost, str]] = ..., idle_mig_uuid: _Optional[str] = ..., reclaim: _Optional[_Iterable[_Union[InstanceRef, _Mapping]]] = ..., free_slices_after: _Optional[int] = ..., blocker: _Optional[str] = ...) -> None: ...

class RankPlacementsResponse(_message.Message):
    __slots__ = ("placements",)
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[RankedPlacement]
    def __init__(self, placements: _Optional[_Iterable[_Union[RankedPlacement, _Mapping]]] = ...) -> None: ...

class UndoDeviceRequest(_message.Message):
    __slots__ = ("mig_uuid", "pod_uid", "container_index", "device_index")
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    mig_uuid: str
    pod_uid: str
    container_index: int
    device_index: int
    def __init__(self, mig_uuid: _Optional[str] = ..., pod_uid: _Optional[str] = ..., container_index: _Optional[int] = ..., device_index: _Optional[int] = ...) -> None: ...

class UndoDeviceResponse(_message.Message):
    __slots__ = ("destroyed", "idled", "skipped", "detail", "generation")
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    IDLED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    destroyed: InstanceRef
    idled: InstanceRef
    skipped: UndoSkip
    detail: str
    generation: int
    def __init__(self, destroyed: _Optional[_Union[InstanceRef, _Mapping]] = ..., idled: _Optional[_Union[InstanceRef, _Mapping]] = ..., skipped: _Optional[_Union[UndoSkip, str]] = ..., detail: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class WatchHealthRequest(_message.Message):
    __slots__ = ("follow",)
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    follow: bool
    def __init__(self, follow: _Optional[bool] = ...) -> None: ...

class InstanceHealthUpdate(_message.Message):
    __slots__ = ("gpu_uuid", "profile", "placement", "mig_uuid", "gpu_instance_id", "compute_instance_id", "health", "xid", "current", "xid64")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MIG_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    XID64_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    profile: str
    placement: Placement
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    health: InstanceHealth
    xid: int
    current: bool
    xid64: int
    def __init__(self, gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., mig_uuid: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ..., health: _Optional[_Union[InstanceHealth, str]] = ..., xid: _Optional[int] = ..., current: _Optional[bool] = ..., xid64: _Optional[int] = ...) -> None: ...

class KeepFreeRequest(_message.Message):
    __slots__ = ("next", "gpu_uuids")
    NEXT_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    next: _containers.RepeatedCompositeFieldContainer[NextPlacement]
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, next: _Optional[_Iterable[_Union[NextPlacement, _Mapping]]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class NextPlacement(_message.Message):
    __slots__ = ("gpu_uuid", "profile", "placement")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    profile: str
    placement: Placement
    def __init__(self, gpu_uuid: _Optional[str] = ..., profile: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class KeepFreeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
