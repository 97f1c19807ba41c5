"""Recover's imperative shell: gather reads everything, apply runs the plan of ``model.recovery_plan``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sidecar.lifecycle import teardown
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.crashpoints import crashpoint
from sidecar.lifecycle.logs import event, hardware_change
from sidecar.model import errors
from sidecar.model.domain import MIG_UUID_RE, ActiveAllocation, State
from sidecar.model.errors import ComputeInstanceNotOurs, nvml_errors
from sidecar.model.hami_takeover import read_record_file
from sidecar.model.recovery_plan.actions import (
    Action,
    DeleteRecord,
    DestroyOwned,
    EnsureCdi,
    Plan,
    PutRecord,
    RecoveryReport,
    RemoveCdi,
    RemoveHamiRecord,
    RemoveHamiSpec,
    Step,
    settle_report,
)
from sidecar.model.recovery_plan.inputs import CorruptFile, Inputs, LiveGpu, LiveGpuInstance
from sidecar.model.recovery_plan.plan import plan
from sidecar.model.states import now_rfc3339, transition
from sidecar.nvml.port import GpuInfo, NvmlError
from sidecar.store import hami_records
from sidecar.store.cdi import ForeignSpecFile
from sidecar.store.record_format import RecordError

log = logging.getLogger(__name__)

# The report lists whose instances recovery takes over (a pod's live instance, a foreign one under
# adopt_existing): each gets a hardware-change line once its step succeeded.
_ADOPTIONS = frozenset({"adopted_active", "adopted_foreign"})
_GATHER_FAILED = "startup recovery could not read the MIG layout; nothing was modified"
# GPUs read at once in the gather: NVML is thread-safe, and each GPU's reads are driver round trips.
_GATHER_THREADS = 8


# -- the imperative shell ---------------------------------------------------------------------------


def _refuse_legacy_mig_uuids(gpus: Sequence[LiveGpu]) -> None:
    """UnverifiableState for the first CI whose MIG UUID is not ``MIG-<uuid>``.

    R450/R460 drivers name MIG devices ``MIG-GPU-<gpu uuid>/<gi>/<ci>``. That name is built from IDs
    the driver reuses, so a re-created instance gets the same one: it cannot prove "same instance",
    which every ownership decision rests on (and it is no valid CDI device or file name either).
    Recoverer refuses rather than guess, in legacy (non-CDI) mode too."""
    for gpu in gpus:
        for gi in gpu.gpu_instances:
            for ci in gi.compute_instances:
                if not MIG_UUID_RE.fullmatch(ci.mig_uuid):
                    raise errors.UnverifiableState(
                        f"compute instance {ci.id} of GPU instance {gi.info.id} at {gi.info.placement} "
                        f"on {gpu.info.uuid} has the MIG UUID {ci.mig_uuid!r}, not of the form MIG-<uuid> "
                        "(a driver older than R470?); instances cannot be verified; nothing was modified",
                        {
                            "gpu_uuid": gpu.info.uuid,
                            "gpu_instance_id": str(gi.info.id),
                            "compute_instance_id": str(ci.id),
                            "mig_uuid": ci.mig_uuid,
                        },
                    )


class _GpuBusyError(Exception):
    """``DestroyOwned.require_idle_gpu`` found the GPU busy: the step stops and its instance stays foreign."""


class Recoverer:
    """The Recover transaction over the lifecycle's one context (the server's ``Recover``)."""

    def __init__(self, ctx: LifecycleContext, *, adopt_existing: bool, hami_takeover: bool = True) -> None:
        self.ctx = ctx
        self.adopt_existing = adopt_existing
        self.hami_takeover = hami_takeover
        # One recovery at a time: a second Recover RPC waits and then sees the first one's result.
        self._lock = threading.Lock()

    def recover(self, active: Sequence[ActiveAllocation]) -> RecoveryReport:
        """Idempotent. Raises errors.UnverifiableState / errors.NvmlFailure and then modifies nothing."""
        with self._lock:
            with nvml_errors(_GATHER_FAILED):
                gpu_uuids = [gpu.uuid for gpu in self.ctx.port.gpus()]
            with self.ctx.exclusive(gpu_uuids):
                inputs = self.gather(active)
                decided = plan(inputs)
                report = self.apply(decided)
            event(
                log,
                logging.INFO,
                "recovered",
                adopted_active=len(report.adopted_active),
                restored_idle=len(report.restored_idle),
                preserved_foreign=len(report.preserved_foreign),
                adopted_foreign=len(report.adopted_foreign),
                removed_orphan_gis=len(report.removed_orphan_gis),
                dropped_stale_records=len(report.dropped_stale_records),
                errors=list(report.errors),
            )
            return report

    # -- gather ------------------------------------------------------------------------------------
    def gather(self, active: Sequence[ActiveAllocation]) -> Inputs:
        """Read records, the live layout of every GPU and the CDI files. Modifies nothing."""
        valid, corrupt = self.ctx.records.load_all()
        try:
            ceiling = self.ctx.records.load_generation_ceiling() or 0
        except RecordError as exc:
            raise errors.UnverifiableState(
                "startup recovery cannot trust the generation file, so it cannot know which "
                f"generations were handed out before; nothing was modified: {exc}",
                {"file": str(getattr(exc, "path", ""))},
            ) from exc
        with nvml_errors(_GATHER_FAILED):
            gpus = self._read_gpus(self.ctx.port.gpus())
        mig_uuids = [ci.mig_uuid for gpu in gpus for gi in gpu.gpu_instances for ci in gi.compute_instances]
        _refuse_legacy_mig_uuids(gpus)
        cdi = self.ctx.cdi
        cdi_found = cdi.list_mig_uuids()
        return Inputs(
            active=tuple(active),
            records=tuple(valid.values()),
            corrupt=tuple(CorruptFile(name, c.why) for name, c in corrupt.items()),
            gpus=gpus,
            cdi_files=tuple(sorted(cdi_found)),
            cdi_paths={uuid: str(path) for uuid, path in cdi_found.items()},
            cdi_devices={uuid: cdi.device_name(uuid) for uuid in mig_uuids} if cdi.enabled else {},
            boot_id=self.ctx.boot_id,
            hami_records=tuple(
                read_record_file(n, d) for n, d in hami_records.record_files(self.ctx.records.directory)
            ),
            hami_specs=tuple(self.ctx.cdi.hami_specs()),
            hami_takeover=self.hami_takeover,
            adopt_existing=self.adopt_existing,
            recovered=self.ctx.recovered,
            generation=max(self.ctx.generations.current, ceiling),
            generation_ceiling=ceiling,
            now=now_rfc3339(),
        )

    def _read_gpus(self, infos: Sequence[GpuInfo]) -> tuple[LiveGpu, ...]:
        """Every GPU's live layout, read in parallel, in ``infos`` order. Raises the first NvmlError.

        The pool is left only once every read has ended, so a failed gather has nothing still reading
        when the RPC fails (and nothing is modified: the gather only reads)."""
        if len(infos) <= 1:
            return tuple(self._read_gpu(info) for info in infos)
        with ThreadPoolExecutor(max_workers=min(_GATHER_THREADS, len(infos))) as pool:
            futures = [pool.submit(self._read_gpu, info) for info in infos]
            return tuple(future.result() for future in futures)

    def _read_gpu(self, info: GpuInfo) -> LiveGpu:
        profiles = self.ctx.inventory.profiles_at_mode(info)
        processes = self.ctx.port.gpu_processes(info.uuid)
        if not info.mig_current:
            # MIG-disabled GPUs have no GIs; listing them answers NOT_SUPPORTED.
            return LiveGpu(info=info, profiles=profiles, processes=processes)
        port = self.ctx.port
        gis = tuple(
            LiveGpuInstance(info=gi, compute_instances=tuple(port.compute_instances(info.uuid, gi.id)))
            for gi in port.gpu_instances(info.uuid)
        )
        return LiveGpu(info=info, profiles=profiles, gpu_instances=gis, processes=processes)

    # -- apply -------------------------------------------------------------------------------------
    def apply(self, decided: Plan) -> RecoveryReport:
        """Run the steps in order; a failing step puts its instance in ERROR; then install the table."""
        # Activations and idles of this plan use generations up to ``decided.generation``: durable first.
        self.ctx.generations.reserve(decided.generation, decided.generation_ceiling)
        table = {record.name: record for record in decided.table}
        failures: list[str] = []
        done: list[Step] = []
        left_foreign: list[Step] = []
        now = now_rfc3339()

        def leave_foreign(step: Step) -> None:
            left_foreign.append(step)
            if step.record_name is not None:
                table.pop(step.record_name, None)

        for step in decided.steps:
            try:
                for action in step.actions:
                    warning = self._run(action)
                    if warning:
                        failures.append(f"{step.subject}: {warning}")
                done.append(step)
                adopted = step.reported is not None and step.reported.into in _ADOPTIONS
                if adopted and step.record_name in table:
                    hardware_change("adopted", table[step.record_name], step=step.subject)
            except _GpuBusyError as exc:
                event(log, logging.INFO, "recovery step skipped", step=step.subject, reason=str(exc))
                leave_foreign(step)
            except (NvmlError, errors.SidecarError, RecordError, OSError) as exc:
                message = f"{step.subject} failed: {exc}"
                event(log, logging.WARNING, "recovery step failed", step=step.subject, error=str(exc))
                if isinstance(exc, ComputeInstanceNotOurs) or step.on_failure is None:
                    # Not ours after all, or nothing to fall back to: the instance is foreign, not
                    # ERROR, and no record is written for it here.
                    failures.append(message)
                    leave_foreign(step)
                    continue
                failed = transition(step.on_failure, State.ERROR, since=now, last_error=message)
                failures.append(f"{message}; {failed.name} is kept in ERROR and never reused")
                try:
                    self.ctx.records.put(failed)
                except (errors.SidecarError, RecordError, OSError) as write_exc:
                    failures.append(f"recording {failed.name} as ERROR failed: {write_exc}")
                table[failed.name] = failed
        self.ctx.install(
            sorted(table.values(), key=lambda r: r.name),
            decided.generation,
            referenced_mig_uuids=decided.referenced_mig_uuids,
            pending=decided.pending,
        )
        # Only what happened: failed and foreign steps add nothing to the lists of what was done.
        return settle_report(decided.report, done=done, left_foreign=left_foreign, failures=failures)

    def _run(self, action: Action) -> str | None:
        """Execute one action; a returned string is a problem that does not fail the step.

        A CDI removal that fails is queued by ``CdiSpecs`` for the
        reconciler and does not keep the record: the hardware is gone, so the instance is too. A CDI
        spec that cannot be written leaves the recorded instance as recorded (``EnsureCdi``)."""
        match action:
            case PutRecord(record=record):
                self.ctx.records.put(record)
            case DeleteRecord(name=name):
                self.ctx.records.delete(name)
            case DestroyOwned(record=record, require_idle_gpu=require_idle_gpu):
                if require_idle_gpu:
                    self._require_idle_gpu(record.gpu_uuid)
                teardown.destroy_owned(self.ctx, record, mark_deleting=True)
            case EnsureCdi(gpu_minor=minor, identity=identity):
                try:
                    self.ctx.cdi.ensure(minor, identity)
                except errors.SidecarError as exc:
                    return f"writing the CDI spec of {identity.mig_uuid} failed: {exc}"
            case RemoveCdi(mig_uuid=mig_uuid, path=path):
                try:
                    if not self.ctx.cdi.remove(mig_uuid, Path(path) if path else None):
                        return f"removing the CDI spec of {mig_uuid} failed; it is queued for the reconciler"
                except ForeignSpecFile as exc:
                    return f"the CDI spec of {mig_uuid} was not removed: {exc}"
            case RemoveHamiRecord(filename=filename, record_name=name, mig_uuid=mig_uuid):
                crashpoint("after-takeover-record")
                hami_records.remove_taken_over(self.ctx.records, filename, name, mig_uuid)
                crashpoint("after-remove-hami-record")
            case RemoveHamiSpec(mig_uuid=mig_uuid):
                if not self.ctx.cdi.remove_hami_spec(mig_uuid):
                    return f"removing HAMi's CDI spec of {mig_uuid} failed; it is queued for the reconciler"
        return None

    def _require_idle_gpu(self, gpu_uuid: str) -> None:
        """_GpuBusyError when a process runs on the GPU now, or when NVML cannot say."""
        try:
            running = self.ctx.port.gpu_processes(gpu_uuid)
        except NvmlError as exc:
            raise _GpuBusyError(f"counting processes on {gpu_uuid} failed: {exc}") from exc
        if running > 0:
            raise _GpuBusyError(f"{running} processes run on {gpu_uuid} now")
