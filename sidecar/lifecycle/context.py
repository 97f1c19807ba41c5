"""The parts every lifecycle transaction shares: one value, built once by the wiring.

Each transaction and step takes this one value instead of reaching into a large class: what it may
touch is visible in what it reads from here. The facade (``Lifecycle``), the Recover transaction
and the idle trimmer are each given it once; nothing outside ``sidecar.lifecycle`` reads its parts.
The gate (``require_recovered``) and what opens it (``install``, under ``exclusive``) live here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from sidecar.lifecycle.inventory import Inventory, LayoutRecordingPort
from sidecar.lifecycle.locks import Locks
from sidecar.model.domain import ActiveAllocation, Owner, State
from sidecar.model.errors import NotRecovered
from sidecar.model.idle_policy import Choices, KeepFree
from sidecar.model.ownership import Origin, OwnershipRecord
from sidecar.model.pending import PendingSet
from sidecar.model.states import now_rfc3339, transition
from sidecar.store.cdi import CdiSpecs
from sidecar.store.generation import Generations
from sidecar.store.records import RecordStore
from sidecar.store.table import RecordTable


@dataclass
class LifecycleContext:
    # The port as the composition root stacked it; its top, the listing tap, keeps the inventory's
    # layout view, so every GI listing the lifecycle makes also refreshes the advice.
    port: LayoutRecordingPort
    records: RecordStore
    cdi: CdiSpecs
    boot_id: str
    locks: Locks = field(default_factory=Locks)
    recovered: bool = False
    pending: PendingSet = field(default_factory=PendingSet)  # pending reservations (``pending``)
    # GI profile name -> when a valid Allocate last asked for it (``time.time``): the demand an idle
    # reserve of the recently asked profiles follows (``IdleSettings.reserved``). Not durable.
    last_asked: dict[str, float] = field(default_factory=dict)
    # Where the scheduler placed the devices it asked for (``idle_policy.Choices``). Not durable.
    choices: Choices = field(default_factory=Choices)
    # The placements a client's scheduler takes next, which the idle trim keeps free (``KeepFree``),
    # replaced whole by each call. Not durable.
    keep_free: KeepFree = field(default_factory=KeepFree)
    table: RecordTable = field(init=False)
    generations: Generations = field(init=False)
    inventory: Inventory = field(init=False)

    def __post_init__(self) -> None:
        self.table = RecordTable(self.records)
        self.generations = Generations(self.records)
        self.inventory = Inventory(self.port)

    @contextlib.contextmanager
    def exclusive(self, gpu_uuids: Iterable[str] = ()) -> Iterator[None]:
        """Hold the lock of every known GPU and of ``gpu_uuids``: no transaction runs meanwhile.

        Recoverer holds this from gather to install, so a Recover repeated while the sidecar serves
        never plans over a half-finished Allocate (its CREATING record would look like a crash)."""
        with self.locks.every_gpu(gpu_uuids):
            yield

    def install(
        self,
        records: Sequence[OwnershipRecord],
        generation: int,
        *,
        referenced_mig_uuids: Iterable[str] = (),
        pending: Iterable[ActiveAllocation] = (),
    ) -> None:
        """Replace the table with recovered records (under every GPU lock) and open the gate.

        ``referenced_mig_uuids`` (the MIG UUIDs the recovery's active allocations name) stand in for
        the last SyncActive until the first one arrives: without them the reconciler would destroy an
        ERROR instance that a live pod holds. ``pending`` (its entries without runtime identity)
        becomes the pending set (``sidecar.model.pending``) the same way. The generation becomes the
        largest of the given one, the current one and every record's generations, so it never goes
        backwards across restarts."""
        with self.exclusive(r.gpu_uuid for r in records):
            self.table.replace(records, referenced_mig_uuids)
            self.inventory.forget_foreign()
            self.pending.replace(pending)
            self.generations.install(
                [
                    generation,
                    *(r.activated_generation for r in records),
                    *(r.idled_generation for r in records),
                ]
            )
            self.recovered = True

    def require_recovered(self) -> None:
        """The gate of every transaction: nothing changes before startup recovery succeeded."""
        if not self.recovered:
            raise NotRecovered("startup recovery has not succeeded yet; call Recover first")

    def activate(
        self, record: OwnershipRecord, owner: Owner, origin: Origin = Origin.REUSED
    ) -> OwnershipRecord:
        """``record`` ACTIVE for ``owner``, stamped with a fresh generation (StateWriteFailed as for
        ``Generations.next``). ``origin``: whether this activation created it (``UndoAllocate``)."""
        generation = self.generations.next()
        return transition(
            record,
            State.ACTIVE,
            since=now_rfc3339(),
            owner=owner,
            activated_generation=generation,
            last_error="",
            origin=origin,
        )

    def idle(self, record: OwnershipRecord) -> OwnershipRecord:
        """``record`` IDLE, stamped with a fresh generation: SyncActive reactivates it only for a pod
        list taken after that generation was handed out (an older list still names the pod that is
        gone). StateWriteFailed as for ``Generations.next``."""
        return transition(
            record, State.IDLE, since=now_rfc3339(), owner=None, idled_generation=self.generations.next()
        )
