"""The generation ceiling moves ahead of need, outside the lock that hands out generations."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.model.errors import StateWriteFailed
from sidecar.store.generation import GENERATION_BLOCK, Generations
from sidecar.store.records import RecordStore, read_generation


class GatedStore(RecordStore):
    """A real store whose ceiling writes can be held at a gate, or made to fail."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = False

    def raise_generation_ceiling(self, ceiling: int) -> int:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise StateWriteFailed("disk full")
        return super().raise_generation_ceiling(ceiling)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GatedStore]:
    s = GatedStore(tmp_path / "state")
    s.open()
    yield s
    s.close()


def durable(store: RecordStore) -> int:
    ceiling = read_generation(store.directory)
    assert ceiling is not None
    return ceiling


def test_no_generation_is_ever_handed_out_above_the_durable_ceiling(store: GatedStore) -> None:
    generations = Generations(store)
    for _ in range(3 * GENERATION_BLOCK):
        value = generations.next()
        assert value <= durable(store)
    # The ceiling moved ahead of need: half a block before the end, not at it.
    assert durable(store) - generations.current >= GENERATION_BLOCK // 2


def test_generations_are_handed_out_while_the_ceiling_is_being_written(store: GatedStore) -> None:
    generations = Generations(store)
    generations.next()  # the first write, ungated
    while durable(store) - (generations.current + 1) >= GENERATION_BLOCK // 2:
        generations.next()  # none of these writes: more than half a block is left after each
    store.gate, store.entered = threading.Event(), threading.Event()
    before = durable(store)
    refill = threading.Thread(target=generations.next)
    refill.start()  # its next() notices half a block left and writes the ceiling: held at the gate
    assert store.entered.wait(30)
    taken = [generations.next() for _ in range(10)]  # would deadlock if the write held the lock
    assert refill.is_alive()
    assert durable(store) == before
    assert taken == sorted(set(taken))
    assert max(taken) <= before
    store.gate.set()
    refill.join(30)
    assert not refill.is_alive()
    assert durable(store) == before + GENERATION_BLOCK


def test_a_failed_write_ahead_of_need_fails_no_change_but_a_reached_ceiling_does(store: GatedStore) -> None:
    generations = Generations(store)
    first = generations.next()
    ceiling = durable(store)
    store.fail = True
    values = [generations.next() for _ in range(ceiling - first)]  # the numbers below the ceiling
    assert values[-1] == ceiling
    with pytest.raises(StateWriteFailed):
        generations.next()  # nothing is left below the durable ceiling
    assert generations.current == ceiling
    store.fail = False
    assert generations.next() == ceiling + 1
    assert durable(store) > ceiling + 1
