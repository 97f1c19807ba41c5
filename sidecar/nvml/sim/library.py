"""The simulated ``libnvidia-ml``: an object installed as ``pynvml.nvmlLib`` whose attributes are the C
symbols pynvml fetches.

Its attributes emulate the C functions: they take what pynvml's wrappers pass (ctypes handles,
``byref`` out-parameters, caller-allocated arrays), write results through them and return
``nvmlReturn_t`` codes. The real pynvml wrappers, ctypes structs and ``NVMLError`` classes therefore run
in every test, and the adapter cannot tell this library from the real one. Every call is one
access to the state store: it is counted, may be faulted or delayed (the operator's knobs), then
runs its implementation from ``devices`` or ``instances``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pynvml

from sidecar.nvml.sim import devices, events, instances  # noqa: F401 - importing them registers their C functions
from sidecar.nvml.sim.cabi import ERROR_STRINGS, FUNCTIONS, QUERIES, UNFAULTABLE, op_matches
from sidecar.nvml.sim.state import SimError, SimState
from sidecar.nvml.sim.store import StateStore

if TYPE_CHECKING:
    from sidecar.nvml.sim.hardware import SimulatedHardware

LATENCY_POLL_S = 0.1


class _CFunction:
    """One emulated C symbol. A plain object, not a bound method, because pynvml assigns attributes
    (``restype``) to the function pointers it fetches."""

    def __init__(self, library: SimulatedLibrary, name: str, impl: Callable[..., Any]) -> None:
        self.__name__ = name
        self.restype: Any = None
        self.argtypes: Any = None
        self._impl = impl
        if name in UNFAULTABLE:
            self._call = library.call_unfaultable
        elif name in QUERIES:
            self._call = library.call_query
        else:
            self._call = library.call

    def __call__(self, *args: Any) -> Any:
        return self._call(self.__name__, self._impl, args)


class _WaitFunction:
    """``nvmlEventSetWait_v2`` (``events.wait``), with the attributes pynvml assigns."""

    def __init__(self, store: StateStore) -> None:
        self.__name__ = events.WAIT_SYMBOL
        self.restype: Any = None
        self.argtypes: Any = None
        self._store = store

    def __call__(self, *args: Any) -> Any:
        return events.wait(self._store, *args)


class SimulatedLibrary:
    """The emulated C API over a state store; attribute names are the C symbols pynvml fetches.

    A call of a query (``cabi.query``) runs on the store's frozen view and so costs the store no
    look for a change; every other call runs in a transaction on the mutable state."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        for symbol, impl in FUNCTIONS.items():
            setattr(self, symbol, _CFunction(self, symbol, impl))
        # Waits for events outside the store's lock, polling: not one access like the others.
        setattr(self, events.WAIT_SYMBOL, _WaitFunction(store))

    def call(self, name: str, impl: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        started = time.perf_counter_ns()
        with self.store.transaction(call=name) as state:
            delay = _delay(state.latency, name) if state.latency else 0.0
            code = _consume_fault(state, name) if state.faults else None
            if code is None:
                code = _answer(impl, state, args)
            # The driver's own time (the lock, the state, the call), not the modelled latency below.
            self.store.add_driver_ns(time.perf_counter_ns() - started)
        if delay > 0:
            self._wait(
                name, started, delay
            )  # outside the lock: a slow call does not stall every other caller
        return code

    def call_query(self, name: str, impl: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``call`` for a query: the same counting, faults, latency and driver time."""
        started = time.perf_counter_ns()
        with self.store.query(call=name) as q:
            view = q.view
            delay = _delay(view.latency, name) if view.latency else 0.0
            code = None
            if view.faults and any(op_matches(f.op, name) for f in view.faults):
                code = _consume_fault(q.state(), name)  # a fault's countdown is a change to write
            if code is None:
                code = _answer(impl, view, args)
            self.store.add_driver_ns(time.perf_counter_ns() - started)
        if delay > 0:
            self._wait(name, started, delay)
        return code

    def _wait(self, name: str, started_ns: int, delay: float) -> None:
        """Sleep out the modelled latency of a call that started at ``started_ns``, reading the latency
        again every ``LATENCY_POLL_S``: an operator who lowers or removes it (``sim latency OP 0``, the
        driver recovering) ends the wait of a call already in it, as a hung driver call that finally
        returns would."""
        while True:
            left = started_ns / 1e9 + delay - time.perf_counter_ns() / 1e9
            if left <= 0:
                return
            time.sleep(min(left, LATENCY_POLL_S))
            with self.store.query() as q:  # not counted: the driver's own bookkeeping, no C call
                latency = q.view.latency
            delay = _delay(latency, name) if latency else 0.0

    def call_unfaultable(self, name: str, impl: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Counted like every other call, but never faulted or delayed."""
        with self.store.query(call=name):
            pass
        return impl(None, *args)


def _answer(impl: Callable[..., Any], on: Any, args: tuple[Any, ...]) -> Any:
    """The C function's return code: what ``impl`` returns, or the code of the SimError it raises."""
    try:
        return impl(on, *args)
    except SimError as exc:
        return exc.code


def _delay(latency: Mapping[str, float], name: str) -> float:
    return sum(s for op, s in latency.items() if op_matches(op, name))


def _consume_fault(state: SimState, name: str) -> int | None:
    for fault in state.faults:
        if not op_matches(fault.op, name):
            continue
        if fault.after > 0:
            fault.after -= 1
            continue
        fault.times -= 1
        if fault.times <= 0:
            state.faults.remove(fault)
        return fault.code
    return None


# -- installing into pynvml ---------------------------------------------------------------------------


def install(hardware: SimulatedHardware) -> SimulatedLibrary:
    """Make pynvml talk to ``hardware``: set ``pynvml.nvmlLib`` and forget cached function pointers."""
    library = SimulatedLibrary(hardware.store)
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
    for code, text in ERROR_STRINGS.items():
        pynvml.NVMLError._errcode_to_string.setdefault(code, text)
    return library


def uninstall() -> None:
    """Undo ``install`` (tests): pynvml is back to "no library loaded"."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
