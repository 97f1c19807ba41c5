"""``Liveness``: what counts as stuck, with the clock moved by the test instead of waited for."""

from __future__ import annotations

import pytest

from sidecar.lifecycle.liveness import Liveness


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
