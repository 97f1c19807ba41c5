"""``Liveness``: what counts as stuck, with the clock moved by the test instead of waited for."""

from __future__ import annotations

import threading

import pytest

from sidecar.lifecycle.liveness import Liveness
from sidecar.lifecycle.locks import Locks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_nothing_running_is_never_stuck() -> None:
    clock = Clock()
    live = Liveness(300, clock)
    clock.now += 10_000
    assert live.stuck() is None
    assert live.oldest() == {"nvml": 0.0, "reconciler": 0.0}


def test_a_call_past_the_threshold_is_stuck_until_it_returns() -> None:
    clock = Clock()
    live = Liveness(300, clock)
    with live.running("nvml"):
        clock.now += 300
        assert live.stuck() is None  # at the threshold, not past it
        clock.now += 1
        assert live.stuck() == ("nvml", 301)
    assert live.stuck() is None


def test_the_oldest_call_of_each_part_counts() -> None:
    clock = Clock()
    live = Liveness(60, clock)
    with live.running("reconciler"):
        clock.now += 50
        with live.running("nvml"):
            clock.now += 20
            assert live.oldest() == {"nvml": 20, "reconciler": 70}
            assert live.stuck() == ("reconciler", 70)


def test_a_call_that_raises_is_unregistered() -> None:
    clock = Clock()
    live = Liveness(1, clock)
    with pytest.raises(RuntimeError), live.running("nvml"):
        raise RuntimeError
    clock.now += 10
    assert live.stuck() is None


def test_a_wait_for_a_lock_is_not_in_the_age_of_the_waiting_call() -> None:
    clock = Clock()
    live = Liveness(5, clock)
    with live.running("reconciler"):
        clock.now += 2
        with live.waiting():
            clock.now += 100  # queued behind healthy calls
            assert live.oldest()["reconciler"] == 2
            assert live.stuck() is None
        clock.now += 3
        assert live.oldest()["reconciler"] == 5
        clock.now += 1
        assert live.stuck() == ("reconciler", 6)  # its own work past the threshold still counts


def test_a_wait_pauses_only_the_waiting_threads_calls() -> None:
    clock = Clock()
    live = Liveness(5, clock)
    entered, leave = threading.Event(), threading.Event()

    def worker() -> None:  # another thread's NVML call, not waiting for anything
        with live.running("nvml"):
            entered.set()
            leave.wait()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait()
    try:
        with live.running("reconciler"), live.waiting():
            clock.now += 6
            assert live.oldest() == {"nvml": 6, "reconciler": 0}
            assert live.stuck() == ("nvml", 6)  # the call the lock waits for is hung: that shows
    finally:
        leave.set()
        thread.join()


def test_nested_waits_count_once_and_a_wait_outside_any_call_changes_nothing() -> None:
    clock = Clock()
    live = Liveness(5, clock)
    with live.waiting():
        clock.now += 50
    with live.running("reconciler"):
        with live.waiting(), live.waiting():
            clock.now += 50
        clock.now += 1
        assert live.oldest()["reconciler"] == 1


def test_a_round_blocked_on_a_gpu_lock_is_waiting_not_stuck() -> None:
    """The GPU lock blocks inside ``waiting``: a round queued behind a long, healthy create (here a
    thread holding the lock, its NVML call not registered) is not stuck however long it waits."""
    clock = Clock()
    live = Liveness(5, clock)
    locks = Locks(live.waiting)
    held, release, blocked = threading.Event(), threading.Event(), threading.Event()
    ages: list[dict[str, float]] = []

    def holder() -> None:
        with locks.gpu("GPU-a"):
            held.set()
            release.wait()

    def round_() -> None:
        with live.running("reconciler"):
            blocked.set()
            with locks.gpu("GPU-a"):
                ages.append(live.oldest())

    first = threading.Thread(target=holder, daemon=True)
    first.start()
    held.wait()
    second = threading.Thread(target=round_, daemon=True)
    second.start()
    try:
        blocked.wait()
        for _ in range(3000):  # until the round reaches the blocking acquire (a bound, not a timing)
            if live.waiting_count():
                break
            threading.Event().wait(0.01)
        assert live.waiting_count() == 1
        clock.now += 100
        assert live.stuck() is None
    finally:
        release.set()
        first.join()
        second.join()
    assert ages == [{"nvml": 0.0, "reconciler": 0.0}]


def test_a_gpu_lock_is_reentrant_and_uncontended_takes_no_wait() -> None:
    clock = Clock()
    live = Liveness(5, clock)
    locks = Locks(live.waiting)
    with live.running("reconciler"), locks.gpu("GPU-a"), locks.gpu("GPU-a"), locks.gpus(["GPU-a", "GPU-b"]):
        clock.now += 6
        assert live.stuck() == ("reconciler", 6)
