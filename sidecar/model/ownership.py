"""The ownership record and its name: what the sidecar knows about one owned instance (pure).

No I/O here: ``records`` stores these values, the planners (``decision``, ``recovery``) decide over
them. Field names of ``OwnershipRecord`` are the on-disk format (version 1): new fields always get
defaults and existing field types never change.

The record name ``mig-<gpu uuid>-<start>-<size>`` is derived from validated values only. Two live
instances on one GPU never overlap, so (GPU, placement) names one instance at a time. This module
is the one codec for it: ``record_name`` encodes, ``parse_record_name`` decodes, ``is_record_name``
says whether a name is exactly what ``record_name`` produces.
"""

from __future__ import annotations

import enum
import re

import msgspec

from sidecar.model.domain import GPU_UUID_RE, Identity, InstanceRef, Owner, Reservation, State
from sidecar.nvml.port import ComputeInstanceInfo, GpuInstanceInfo, Placement

# Digits are matched leniently (leading zeros accepted) so that a file whose name was hand-edited
# still says which placement it points at; ``is_record_name`` demands the canonical form.
_NAME_RE = re.compile(
    r"mig-(GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})-([0-9]+)-([0-9]+)"
)


class Origin(enum.StrEnum):
    """How the holder's Allocate got an ACTIVE instance: made for it, or an IDLE one handed over.

    ``UndoAllocate`` destroys what was CREATED and gives back what was REUSED. Where the sidecar
    cannot know (records written before the field existed, recovery adopting an ACTIVE instance from
    the pod list, SyncActive reactivating an IDLE one) it is REUSED: an undo then keeps the instance
    IDLE, still reclaimable, instead of destroying what it cannot prove its Allocate made."""

    CREATED = "CREATED"
    REUSED = "REUSED"


def hardware_fields(record: OwnershipRecord) -> dict[str, str]:
    """What an operator needs to find an instance in ``nvidia-smi mig -lgi`` and ``kubectl``: the GPU,
    profile, placement, MIG UUID and holder. The fields of every log line about a hardware change."""
    holder = record.owner.describe() if record.owner is not None else "-"
    return {
        "gpu": record.gpu_uuid,
        "profile": record.profile,
        "placement": str(record.placement),
        "mig_uuid": record.mig_uuid or "",
        "owner": holder,
        "record": record.name,
    }


class OwnershipRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the sidecar knows about one owned instance. Field names are the on-disk format."""

    gpu_uuid: str
    profile: str  # full profile name, "1g.10gb+me"
    gi_profile_id: int
    ci_profile_id: int
    placement: Placement
    state: State
    gpu_instance_id: int | None = None  # set once the GI exists
    compute_instance_id: int | None = None  # set once the CI exists
    mig_uuid: str | None = None  # set once the CI exists
    # The holder while ACTIVE (and the creator while CREATING): a pod's container or a claim's request.
    owner: Owner | None = None
    activated_generation: int = 0  # the generation at which it last became ACTIVE
    idled_generation: int = 0  # the generation at which it last became IDLE (0: before the field existed)
    cdi_device: str = ""  # qualified CDI name, "" with CDI disabled or before the file exists
    last_error: str = ""
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id when the instance was created
    since: str = ""  # RFC 3339 UTC time of the last state change (``states.now_rfc3339``)
    # Set in the record written just before the CI create is issued; cleared once the CI is recorded
    # or the GI has been seen without one. See ``may_own_unrecorded_ci``.
    ci_create_issued: bool = False
    # How the current holder got it (``Origin``); meaningful while ACTIVE, kept as it was otherwise.
    origin: Origin = Origin.REUSED
    # "hami" when recovery took the instance over from HAMi's in-process lifecycle: its HAMi CDI spec
    # may still be in use and goes with the instance (teardown removes it after the destroy).
    taken_over_from: str = ""
    # The first critical Xid NVML reported on this instance (or its whole GPU); 0: none. A faulted
    # instance is never handed out again: ACTIVE, it is destroyed at its release; IDLE, it goes
    # ERROR and the reconciler destroys it (``sidecar.lifecycle.faults``). Kept across restarts.
    xid: int = 0

    @property
    def name(self) -> str:
        return record_name(self.gpu_uuid, self.placement)

    @property
    def reservation(self) -> Reservation:
        return Reservation(self.gpu_uuid, self.profile, self.placement)

    @property
    def may_own_unrecorded_ci(self) -> bool:
        """Whether a CI in this record's GI without a recorded CI ID is its own.

        Only a create issues a CI create: a CREATING record, or one whose create issued it and whose
        undo failed (ERROR with ``ci_create_issued``), may have stopped between making the CI and
        recording it. Any other record without a CI ID stands for a bare GI, and a CI there was made
        by someone else (``teardown.ci_targets`` and recovery's ``record_mismatch`` apply this)."""
        return self.state is State.CREATING or self.ci_create_issued

    @property
    def identity(self) -> Identity | None:
        """The live identity, or None while the instance is not complete."""
        if self.gpu_instance_id is None or self.compute_instance_id is None or self.mig_uuid is None:
            return None
        return Identity(self.gpu_instance_id, self.compute_instance_id, self.mig_uuid)


def live_record(
    profile: str,
    gi: GpuInstanceInfo,
    ci: ComputeInstanceInfo | None,
    *,
    state: State,
    boot_id: str,
    since: str,
    ci_profile_id: int | None = None,
    owner: Owner | None = None,
    activated_generation: int = 0,
    idled_generation: int = 0,
    cdi_device: str = "",
    origin: Origin = Origin.REUSED,
    taken_over_from: str = "",
    xid: int = 0,
) -> OwnershipRecord:
    """The record of a live GI and its CI (None: a bare GI), the one place the live values are copied.

    GPU, GI ID, GI profile and placement come from ``gi``; CI ID, CI profile and MIG UUID from ``ci``.
    ``ci_profile_id`` is the CI profile a bare GI's record names (the full-size one of its profile);
    given with a CI, it wins over the CI's own (the caller verified they agree)."""
    if ci_profile_id is None:
        assert ci is not None, "the record of a bare GI names the CI profile it would have"
        ci_profile_id = ci.profile_id
    return OwnershipRecord(
        gpu_uuid=gi.gpu_uuid,
        profile=profile,
        gi_profile_id=gi.profile_id,
        ci_profile_id=ci_profile_id,
        placement=gi.placement,
        state=state,
        gpu_instance_id=gi.id,
        compute_instance_id=ci.id if ci is not None else None,
        mig_uuid=ci.mig_uuid if ci is not None else None,
        owner=owner,
        activated_generation=activated_generation,
        idled_generation=idled_generation,
        cdi_device=cdi_device,
        boot_id=boot_id,
        since=since,
        origin=origin,
        taken_over_from=taken_over_from,
        xid=xid,
    )


_NAMES: dict[tuple[str, int, int], str] = {}  # names already checked (a node has a few hundred)
_NAMES_KEPT = 4096


def record_name(gpu_uuid: str, placement: Placement) -> str:
    """The record's file stem, ``mig-<gpu uuid>-<start>-<size>``, from validated values only.

    Raises ``ValueError`` for a GPU UUID that is not ``GPU-<uuid>`` or a negative/zero-size placement.
    A name once checked is remembered: an Allocate asks for the same one several times. Only exact
    ``str``/``int`` arguments are looked up, so ``True`` never finds the name checked for ``1``.
    """
    start, size = placement.start, placement.size
    exact = type(gpu_uuid) is str and type(start) is int and type(size) is int
    if exact:
        known = _NAMES.get((gpu_uuid, start, size))
        if known is not None:
            return known
    if not isinstance(gpu_uuid, str) or not GPU_UUID_RE.fullmatch(gpu_uuid):
        raise ValueError(f"not a GPU UUID: {gpu_uuid!r}")
    # bool is an int subclass; True/False as a slice number is a bug upstream, not a placement.
    if type(start) is not int or type(size) is not int or start < 0 or size <= 0:
        raise ValueError(f"not a placement: start={start!r} size={size!r}")
    name = f"mig-{gpu_uuid}-{start}-{size}"
    if exact and len(_NAMES) < _NAMES_KEPT:
        _NAMES[(gpu_uuid, start, size)] = name
    return name


def parse_record_name(name: str) -> tuple[str, Placement] | None:
    """(GPU UUID, placement) a record file name points at, or None if it names no placement.

    Used for files whose content cannot be trusted (corrupt, or left for the operator): their name
    was derived from validated values when written, so it still says which placement they had."""
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return None
    start, size = int(match.group(2)), int(match.group(3))
    if size <= 0:
        return None
    return match.group(1), Placement(start, size)


def is_record_name(name: str) -> bool:
    """True exactly for the names ``record_name`` produces (so no name can escape the directory)."""
    parsed = parse_record_name(name)
    return parsed is not None and record_name(*parsed) == name


def instance_ref(record: OwnershipRecord) -> InstanceRef:
    """The contract's InstanceRef for an owned instance (identity None while incomplete)."""
    return InstanceRef(record.reservation, record.identity)
