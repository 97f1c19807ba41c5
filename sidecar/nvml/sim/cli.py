"""``sim`` commands: operate the simulated hardware the way ``nvidia-smi mig`` operates a real GPU.

They work on the same state file a running sidecar uses (``--sim-state``, or the environment variable
``HAMI_MIG_SIDECAR_SIM_STATE``) and take the same lock, so the sidecar sees a change at its next NVML
call: an instance no sidecar owns, a process on a MIG device, a fault in the next calls of an
operation, a GPU falling off the bus, a reboot. ``sim stats`` shows how many NVML calls of each C
function every process made against this hardware, the noise-free cost of what the sidecar did.

Every command prints one line on success and exits 0; a refusal by the simulated driver (an
overlapping placement, a GI in use …) prints the reason on stderr and exits 1, bad usage exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sidecar.nvml import profiles
from sidecar.nvml.sim import OP_ALIASES, SimError, SimulatedHardware, events, parse_code

ENV_SIM_STATE = "HAMI_MIG_SIDECAR_SIM_STATE"
EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2

Handler = Callable[[argparse.Namespace], int]


def _hardware(args: argparse.Namespace) -> SimulatedHardware:
    return SimulatedHardware.open(_state_file(args))


def _state_file(args: argparse.Namespace) -> Path:
    value = args.sim_state or os.environ.get(ENV_SIM_STATE)
    if not value:
        raise _UsageError(f"--sim-state FILE is required (or set {ENV_SIM_STATE})")
    return Path(value)


class _UsageError(Exception):
    pass


def _placement(text: str) -> tuple[int, int]:
    start, sep, size = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"placement {text!r} is not START:SIZE") from None


def _guarded(fn: Handler) -> Handler:
    """Turn the simulator's refusals and missing files into a message and an exit code."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except _UsageError as exc:
            sys.stderr.write(f"sim: {exc}\n")
            return EXIT_USAGE
        except (SimError, ValueError, KeyError, OSError) as exc:
            sys.stderr.write(f"sim {args.sim_command}: {exc}\n")
            return EXIT_REFUSED

    return run


def _init(args: argparse.Namespace) -> int:
    path = _state_file(args)
    try:
        gpus = profiles.parse_gpus(args.gpus)
    except ValueError as exc:
        raise _UsageError(f"--gpus: {exc}") from exc  # a bad value of a flag, as serve's --sim-gpus
    hw = SimulatedHardware.init_file(path, gpus, mig_enabled=not args.mig_disabled, overwrite=args.force)
    n = len(hw.layouts())
    sys.stdout.write(f"initialised {n} simulated GPU(s) in {path} (boot id {hw.boot_id})\n")
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    hw = _hardware(args)
    layouts = hw.layouts()
    state = hw.state()
    if args.json:
        doc: dict[str, Any] = {
            "boot_id": state.boot_id,
            "gpus": msgspec.to_builtins(layouts),
            "faults": msgspec.to_builtins(state.faults),
            "latency": state.latency,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return EXIT_OK
    out = [f"boot id {state.boot_id}"]
    for g in layouts:
        mig = "on" if g.mig_current else "off"
        if g.mig_pending != g.mig_current:
            mig += f" (pending {'on' if g.mig_pending else 'off'})"
        flags = " LOST" if g.lost else ""
        flags += " BUSY" if g.busy else ""
        out.append(f"GPU {g.index} {g.uuid} {g.name} minor {g.minor} MIG {mig}{flags}")
        for gi in g.gis:
            if not gi.cis:
                out.append(f"  GI {gi.id:>2} {gi.profile:<12} {gi.placement}  (no compute instance)")
            for ci in gi.cis:
                busy = "  busy" if ci.busy else ""
                out.append(
                    f"  GI {gi.id:>2} {gi.profile:<12} {gi.placement}  CI {ci.id} profile {ci.profile_id} "
                    f"{ci.mig_uuid}{busy}"
                )
    for f in state.faults:
        out.append(f"fault: {f.op} -> code {f.code}, after {f.after} call(s), {f.times} time(s)")
    for op, seconds in sorted(state.latency.items()):
        out.append(f"latency: {op} {seconds}s")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


def _create(args: argparse.Namespace) -> int:
    start, size = args.placement
    gi = _hardware(args).create_instance(args.gpu, args.profile, start, size, with_ci=not args.no_ci)
    ci = f" CI {gi.cis[0].id} {gi.cis[0].mig_uuid}" if gi.cis else " (no compute instance)"
    sys.stdout.write(f"created GI {gi.id} {gi.profile} at {gi.placement} on GPU {args.gpu}{ci}\n")
    return EXIT_OK


def _destroy(args: argparse.Namespace) -> int:
    _hardware(args).destroy_instance(args.gpu, args.gi)
    sys.stdout.write(f"destroyed GI {args.gi} on GPU {args.gpu}\n")
    return EXIT_OK


def _busy(args: argparse.Namespace) -> int:
    _hardware(args).set_busy(args.mig_uuid, args.state == "on")
    sys.stdout.write(f"{args.mig_uuid} busy {args.state}\n")
    return EXIT_OK


def _fault(args: argparse.Namespace) -> int:
    code = parse_code(args.code)
    _hardware(args).inject_fault(args.op, code, after=args.after, times=args.times)
    sys.stdout.write(f"{args.op}: after {args.after} call(s), the next {args.times} fail with code {code}\n")
    return EXIT_OK


def _faults(args: argparse.Namespace) -> int:
    hw = _hardware(args)
    if args.clear:
        hw.clear_faults()
        sys.stdout.write("faults cleared\n")
        return EXIT_OK
    for f in hw.faults():
        sys.stdout.write(f"{f.op} -> code {f.code}, after {f.after} call(s), {f.times} time(s)\n")
    return EXIT_OK


def _stats(args: argparse.Namespace) -> int:
    """NVML calls per C function, most called first, and the time spent inside them; ``--reset``
    prints them, then starts from zero."""
    hw = _hardware(args)
    counts, driver_ms = hw.call_counts(), hw.store.driver_ns() / 1e6
    if args.reset:
        hw.reset_call_counts()
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    if args.json:
        doc = {
            "total": sum(counts.values()),
            "calls": dict(ordered),
            "driver_ms": round(driver_ms, 3),
            "reset": bool(args.reset),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return EXIT_OK
    width = max((len(name) for name in counts), default=0)
    out = [f"{name:<{width}}  {n:>8}" for name, n in ordered]
    out.append(f"{'total':<{width}}  {sum(counts.values()):>8}")
    out.append(f"time inside the simulated driver: {driver_ms:.3f} ms")
    if args.reset:
        out.append("counts reset")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


def _lose(args: argparse.Namespace) -> int:
    _hardware(args).lose_gpu(args.gpu)
    sys.stdout.write(f"GPU {args.gpu} is lost until `sim reboot`\n")
    return EXIT_OK


def _xid(args: argparse.Namespace) -> int:
    serial = events.raise_xid(_hardware(args).store, args.gpu, args.code, args.gi, args.ci)
    where = (
        "the whole GPU"
        if args.gi is None
        else f"GI {args.gi}" + ("" if args.ci is None else f" CI {args.ci}")
    )
    sys.stdout.write(f"Xid {args.code} raised on GPU {args.gpu}, {where} (event {serial})\n")
    return EXIT_OK


def _latency(args: argparse.Namespace) -> int:
    _hardware(args).set_latency(args.op, args.seconds)
    sys.stdout.write(f"latency of {args.op}: {args.seconds}s\n")
    return EXIT_OK


def _reset(args: argparse.Namespace) -> int:
    _hardware(args).reset_gpu(args.gpu)
    sys.stdout.write(f"GPU {args.gpu} reset: its instances are gone, pending MIG mode applied\n")
    return EXIT_OK


def _reboot(args: argparse.Namespace) -> int:
    hw = _hardware(args)
    hw.reboot()
    sys.stdout.write(f"rebooted: all instances gone, new boot id {hw.boot_id}\n")
    return EXIT_OK


def register(subparsers: Any) -> None:
    """Add the ``sim`` command and its subcommands; each sets ``func`` to a ``(args) -> int`` handler."""
    sim = subparsers.add_parser(
        "sim",
        help="operate the simulated hardware (for demos and tests)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    sim.add_argument(
        "--sim-state",
        metavar="FILE",
        default=None,
        help=f"the simulated hardware's state file [env {ENV_SIM_STATE}]",
    )
    cmds = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = cmds.add_parser(name, help=help_text, description=help_text)
        parser.set_defaults(func=_guarded(handler))
        return parser

    p = add("init", _init, "create the state file with the given GPUs (MIG enabled unless --mig-disabled)")
    p.add_argument(
        "--gpus", required=True, metavar="MODEL[:COUNT],...", help=f"models: {', '.join(profiles.MODELS)}"
    )
    p.add_argument("--mig-disabled", action="store_true", help="start with MIG mode off on every GPU")
    p.add_argument("--force", action="store_true", help="replace an existing state file")

    p = add("list", _list, "show GPUs, GPU/compute instances, MIG UUIDs, busy markers, faults")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add("create", _create, "create an instance no sidecar owns (GI plus its full-size CI)")
    p.add_argument("--gpu", type=int, required=True, metavar="INDEX")
    p.add_argument("--profile", required=True, metavar="NAME", help="e.g. 1g.10gb, 3g.40gb")
    p.add_argument("--placement", type=_placement, required=True, metavar="START:SIZE")
    p.add_argument("--no-ci", action="store_true", help="leave the GI without a compute instance")

    p = add("destroy", _destroy, "destroy a GI's compute instances, then the GI")
    p.add_argument("--gpu", type=int, required=True, metavar="INDEX")
    p.add_argument("--gi", type=int, required=True, metavar="ID")

    p = add("busy", _busy, "mark a MIG device (or a GPU, by GPU UUID) as running a process, or not")
    p.add_argument("--mig-uuid", required=True, metavar="UUID")
    p.add_argument("state", choices=("on", "off"))

    p = add("fault", _fault, "make the next calls of an NVML operation fail with a code")
    p.add_argument("op", metavar="OP", help=f"C function name, 'any', or one of: {', '.join(OP_ALIASES)}")
    p.add_argument("code", metavar="CODE", help="nvmlReturn_t by number or name, e.g. 19 or IN_USE")
    p.add_argument("--after", type=int, default=0, metavar="N", help="let N matching calls succeed first")
    p.add_argument("--times", type=int, default=1, metavar="K", help="fail K calls (default 1)")

    p = add("faults", _faults, "list pending faults, or clear them")
    p.add_argument("--clear", action="store_true")

    p = add("stats", _stats, "NVML calls per C function since init or the last --reset (all processes)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--reset", action="store_true", help="print the counts, then start again from zero")

    p = add("lose", _lose, "the GPU falls off the bus: every call on it fails with GPU_IS_LOST")
    p.add_argument("--gpu", type=int, required=True, metavar="INDEX")

    p = add("xid", _xid, "raise a critical Xid event on a GPU (the whole GPU unless --gi names an instance)")
    p.add_argument("--gpu", type=int, required=True, metavar="INDEX")
    p.add_argument("--gi", type=int, default=None, metavar="ID", help="the GPU instance it names")
    p.add_argument("--ci", type=int, default=None, metavar="ID", help="the compute instance in that GI")
    p.add_argument("code", type=int, metavar="CODE", help="the Xid, e.g. 79 (fallen off the bus) or 13")

    p = add("latency", _latency, "make an operation take SECONDS (0 removes it)")
    p.add_argument("op", metavar="OP")
    p.add_argument("seconds", type=float, metavar="SECONDS")

    p = add("reset", _reset, "reset one GPU: its instances vanish, its pending MIG mode applies")
    p.add_argument("--gpu", type=int, required=True, metavar="INDEX")

    add("reboot", _reboot, "reboot the node: instances and busy markers vanish, pending MIG modes apply")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sim")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    handler: Handler = args.func
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
