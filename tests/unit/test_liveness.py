"""``Liveness``: what counts as stuck, with the clock moved by the test instead of waited for."""

from __future__ import annotations

import threading

import pytest

from sidecar.lifecycle.liveness import Liveness
from sidecar.lifecycle.locks import LockOrderError, Locks
from sidecar.model.domain import AllocationKey


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


class _Blocked:
    """A thread holding GPU-a (its NVML calls driven by the test) and a round blocked on it."""

    def __init__(self, live: Liveness, locks: Locks) -> None:
        self.live, self.locks = live, locks
        self.held, self.release, self.blocked = threading.Event(), threading.Event(), threading.Event()
        self.calls: list[threading.Event] = []  # each set: the holder makes one registered call
        self.called = threading.Semaphore(0)
        self.ages: list[dict[str, float]] = []
        self.threads = [threading.Thread(target=self._holder, daemon=True)]

    def _holder(self) -> None:
        with self.locks.gpu("GPU-a"):
            self.held.set()
            while not self.release.is_set():
                if self.calls:
                    self.calls.pop()
                    with self.live.running("nvml"):
                        pass
                    self.called.release()
                threading.Event().wait(0.001)

    def _round(self) -> None:
        with self.live.running("reconciler"):
            self.blocked.set()
            with self.locks.gpu("GPU-a"):
                self.ages.append(self.live.oldest())

    def __enter__(self) -> _Blocked:
        self.threads[0].start()
        self.held.wait()
        self.threads.append(threading.Thread(target=self._round, daemon=True))
        self.threads[1].start()
        self.blocked.wait()
        for _ in range(3000):  # until the round reaches the blocking acquire (a bound, not a timing)
            if self.live.waiting_count():
                break
            threading.Event().wait(0.01)
        assert self.live.waiting_count() == 1
        return self

    def holder_calls(self) -> None:
        self.calls.append(threading.Event())
        self.called.acquire()

    def __exit__(self, *_: object) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join()


def test_a_round_blocked_behind_a_holder_that_makes_progress_is_waiting_not_stuck() -> None:
    """The GPU lock blocks inside ``waiting``: a round queued behind a long, healthy holder (one that
    keeps making NVML calls) is not stuck however long it waits."""
    clock = Clock()
    live = Liveness(5, clock)
    locks = Locks(live.waiting, clock)
    with _Blocked(live, locks) as blocked:
        for _ in range(20):
            clock.now += 4
            blocked.holder_calls()
            assert live.stuck() is None
    assert blocked.ages == [{"nvml": 0.0, "reconciler": 0.0}]


def test_a_wait_whose_holder_makes_no_progress_is_stuck_past_the_threshold() -> None:
    """No NVML call runs, so no call's age grows: the wait itself is what is stuck, once neither the
    lock nor its holder has moved for the threshold."""
    clock = Clock()
    live = Liveness(5, clock)
    locks = Locks(live.waiting, clock)
    with _Blocked(live, locks) as blocked:
        clock.now += 5
        assert live.stuck() is None
        clock.now += 1
        assert live.stuck() == ("lock-wait", 6)
        blocked.holder_calls()  # the holder moves: the wait is healthy again for a threshold
        assert live.stuck() is None
        clock.now += 6
        assert live.stuck() == ("lock-wait", 6)  # what counts is how long nothing has moved
    assert live.stuck() is None


class _Lock:
    def __init__(self, owner: int | None, changed: float) -> None:
        self.owner, self.changed = owner, changed


def test_a_circle_of_waits_is_stuck_past_the_threshold() -> None:
    """Two threads, each waiting for the lock the other holds (what ``locks`` refuses to let happen,
    built here from the locks' two fields): nothing along either chain moves."""
    clock = Clock()
    live = Liveness(5, clock)
    ident: dict[int, int] = {}
    started, waiting, done = threading.Barrier(3), threading.Barrier(3), threading.Event()
    lock_of: dict[int, _Lock] = {}

    def waiter(index: int) -> None:
        ident[index] = threading.get_ident()
        started.wait()
        started.wait()  # the test has built the two locks
        with live.waiting(lock_of[index]):
            waiting.wait()
            done.wait()

    threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait()
    lock_of[0] = _Lock(owner=ident[1], changed=clock.now)  # thread 0 waits for what thread 1 holds
    lock_of[1] = _Lock(owner=ident[0], changed=clock.now)
    started.wait()
    waiting.wait()
    try:
        clock.now += 5
        assert live.stuck() is None
        clock.now += 1
        assert live.stuck() == ("lock-wait", 6)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert live.stuck() is None


def test_a_gpu_lock_is_reentrant_and_uncontended_takes_no_wait() -> None:
    clock = Clock()
    live = Liveness(5, clock)
    locks = Locks(live.waiting, clock)
    with live.running("reconciler"), locks.gpu("GPU-a"), locks.gpu("GPU-a"), locks.gpus(["GPU-a", "GPU-b"]):
        clock.now += 6
        assert live.stuck() == ("reconciler", 6)


class TestTheLockOrderIsChecked:
    """Every acquire checks the one order: a lock taken out of it raises before it blocks, so a
    path that would deadlock against another fails in any test that takes it."""

    def test_a_gpu_lock_that_sorts_before_a_held_one_is_refused(self) -> None:
        locks = Locks()
        with locks.gpu("GPU-b"), pytest.raises(LockOrderError, match="GPU-a"):
            locks.gpu("GPU-a").__enter__()
        assert locks.held() == []
        with locks.gpu("GPU-a"), locks.gpu("GPU-b"):  # the order itself is fine
            assert locks.held() == ["GPU-a", "GPU-b"]

    def test_several_gpus_taken_together_while_holding_a_later_one_are_refused(self) -> None:
        locks = Locks()
        with locks.gpu("GPU-b"), pytest.raises(LockOrderError), locks.gpus(["GPU-a", "GPU-b"]):
            pass
        assert locks.held() == []

    def test_re_entering_a_held_lock_is_not_out_of_order(self) -> None:
        locks = Locks()
        with locks.gpus(["GPU-a", "GPU-b"]), locks.gpu("GPU-a"), locks.gpu("GPU-b"):
            assert locks.held() == ["GPU-a", "GPU-b", "GPU-a", "GPU-b"]
        assert locks.held() == []

    def test_claiming_keys_while_holding_a_gpu_lock_is_refused(self) -> None:
        locks = Locks()
        key = AllocationKey("pod-uid", 0, 0)
        with locks.gpu("GPU-a"), pytest.raises(LockOrderError, match="claimed"), locks.claim([key]):
            pass
        with locks.claim([key]), locks.gpu("GPU-a"):  # keys first, then GPUs
            pass

    def test_each_thread_has_its_own_order(self) -> None:
        locks = Locks()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                with locks.gpu("GPU-a"):
                    pass
            except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
                errors.append(exc)

        with locks.gpu("GPU-b"):
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        assert errors == []
