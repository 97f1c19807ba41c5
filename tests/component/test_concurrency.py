"""Concurrent Allocate/Release over two GPUs never hand one instance to two allocation keys."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from lifecycle_world import World, active_of

from sidecar.lifecycle.allocate import Allocator
from sidecar.model import errors
from sidecar.model.domain import Outcome, State

THREADS = 32
ROUNDS = 4


def test_concurrent_allocations_and_releases_never_share_an_instance(world: World) -> None:
    holders: dict[str, str] = {}  # MIG UUID -> pod that holds it right now, as the callers saw it
    holders_lock = threading.Lock()
    violations: list[str] = []
    crashes: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(n: int) -> None:
        rng = random.Random(n)  # noqa: S311 - a reproducible mix of requests, not security
        try:
            start.wait()
            for round_ in range(ROUNDS):
                pod = f"pod-{n}-{round_}"
                gpu = n % 2
                profile, slots = rng.choice(
                    [("1g.10gb", [(i, 1) for i in range(7)]), ("2g.20gb", [(0, 2), (2, 2), (4, 2)])]
                )
                start_slot, size = rng.choice(slots)
                try:
                    result = world.allocate(pod, (gpu, profile, start_slot, size))
                except (errors.PlacementBusy, errors.InstanceInUse):
                    continue
                mig = result.devices[0].identity.mig_uuid
                with holders_lock:
                    if mig in holders:
                        violations.append(f"{mig} given to {pod} while {holders[mig]} holds it")
                    holders[mig] = pod
                again = world.allocate(pod, (gpu, profile, start_slot, size)).devices[0]
                if again.identity != result.devices[0].identity:
                    violations.append(
                        f"{pod} got {again.identity} on retry, not {result.devices[0].identity}"
                    )
                with holders_lock:
                    holders.pop(mig, None)
                world.lifecycle.release(pod)
        except BaseException as exc:  # noqa: BLE001 - any surprise in a worker fails the test below
            crashes.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert crashes == []
    assert violations == []
    world.assert_consistent()
    records = world.record_files().values()
    assert {r.state for r in records} <= {State.IDLE}
    assert len({r.mig_uuid for r in records}) == len(records)


class TestAReactivationWaitsForAnAllocateOfItsKey:
    """SyncActive gives a key an instance, as Allocate does, so it claims the key as Allocate does: an
    Allocate of the same key on another GPU is never overtaken half-way past its key check, which
    would leave the key holding two instances (or answer the Allocate with the other reservation)."""

    def test_a_reactivation_racing_an_allocate_of_the_same_key_on_another_gpu_gives_the_key_one_instance(
        self, world: World, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        old = world.allocate("pod-a", (1, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        generation = world.lifecycle.generation
        listed = active_of("pod-a", old)  # a pod list still naming the old instance
        # The Allocate pauses where it judges the placement, past its key check, holding the key.
        judging, resume = threading.Event(), threading.Event()
        in_the_way_of = Allocator.in_the_way_of

        def paused_in_the_way_of(self: Allocator, v: Any) -> Any:
            judging.set()
            assert resume.wait(60), "the test never resumed the Allocate"
            return in_the_way_of(self, v)

        monkeypatch.setattr(Allocator, "in_the_way_of", paused_in_the_way_of)
        claim_waits = threading.Event()
        keys = world.ctx.locks.keys
        wait = keys.wait

        def noticed_wait(timeout: float | None = None) -> bool:
            claim_waits.set()
            return wait(timeout)

        monkeypatch.setattr(keys, "wait", noticed_wait)
        results: dict[str, Any] = {}

        def run(name: str, call: Any) -> None:
            try:
                results[name] = call()
            except Exception as exc:  # noqa: BLE001 - handed to the test thread
                results[name] = exc

        allocating = threading.Thread(
            target=run, args=("allocate", lambda: world.allocate("pod-a", (0, "1g.10gb", 0, 1)))
        )
        allocating.start()
        assert judging.wait(60)
        syncing = threading.Thread(
            target=run, args=("sync", lambda: world.lifecycle.sync_active(generation, listed))
        )
        syncing.start()
        reached_the_claim = claim_waits.wait(10)
        resume.set()
        allocating.join()
        syncing.join()

        assert reached_the_claim, "SyncActive did not wait for the key the Allocate holds"
        [created] = results["allocate"].devices
        assert created.outcome is Outcome.CREATED
        assert created.reservation.gpu_uuid == world.uuid(0)
        assert results["sync"] == ([], [])  # the key holds the new instance: the old one stays IDLE
        held = [r for r in world.record_files().values() if r.state is State.ACTIVE]
        assert [r.mig_uuid for r in held] == [created.identity.mig_uuid]
        world.assert_consistent()
