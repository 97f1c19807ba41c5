"""The parts every lifecycle transaction shares, built once by ``Lifecycle``.

Each transaction module (``allocate``, ``create``, ``release``, ``teardown``, ``migmode``) takes
this one value instead of reaching into a large class: what a transaction may touch is visible in
what it reads from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.lifecycle.inventory import Inventory
from sidecar.lifecycle.locks import Locks
from sidecar.model.domain import Owner, State
from sidecar.model.errors import NotRecovered
from sidecar.model.ownership import Origin, OwnershipRecord
from sidecar.model.pending import PendingSet
from sidecar.model.states import now_rfc3339, transition
from sidecar.nvml.port import NvmlPort
from sidecar.store.cdi import CdiSpecs
from sidecar.store.generation import Generations
from sidecar.store.records import RecordStore
from sidecar.store.table import Table


@dataclass
class Context:
    port: NvmlPort
    records: RecordStore
    cdi: CdiSpecs
    boot_id: str
    locks: Locks = field(default_factory=Locks)
    recovered: bool = False
    pending: PendingSet = field(default_factory=PendingSet)  # pending reservations (``pending``)
    table: Table = field(init=False)
    generations: Generations = field(init=False)
    inventory: Inventory = field(init=False)

    def __post_init__(self) -> None:
        self.table = Table(self.records)
        self.generations = Generations(self.records)
        self.inventory = Inventory(self.port)

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
