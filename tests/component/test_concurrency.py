"""Concurrent Allocate/Release over two GPUs never hand one instance to two allocation keys."""

from __future__ import annotations

import random
import threading

from lifecycle_world import World

from sidecar import errors
from sidecar.domain import State

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
