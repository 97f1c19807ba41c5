"""The ``hami-mig-sidecar`` console script.

Subcommands:

* ``serve`` — run the sidecar (flags and their ``HAMI_MIG_SIDECAR_*`` variables: ``sidecar.config``);
* ``status [--json]`` — ask a running sidecar (GetInfo + GetState) and print GPUs, owned instances and
  foreign instances as a table, or the responses as JSON for machines;
* ``reclaim --gpu N [--mig-uuid U ...]`` — ask a running sidecar to destroy IDLE instances of a GPU
  (ReclaimIdle): the named ones, or every IDLE one; exits 1 on a refusal, naming its reason;
* ``call METHOD [JSON]`` — send one request of the contract as JSON, print the response as JSON;
  ``health [--service NAME]`` — exit 0 only when the health service answers SERVING (``sidecar.edge.call``);
* ``records verify --state-dir DIR`` — offline report of valid, corrupt and stale ownership records,
  and of HAMi's record files left there; exits 1 when any record is corrupt, so it can gate a
  maintenance script;
* ``probe [--json] [--sim-state FILE]`` — read-only: print the GPUs' MIG tables and instances and diff
  them against the model of each GPU (``sidecar.nvml.probe``);
* ``sim ...`` — operate the simulated hardware (registered by ``sidecar.nvml.sim.cli``).

Exit codes: 0 success, 1 failure (startup failed, sidecar unreachable, corrupt records), 2 bad usage
or configuration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sidecar import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

Handler = Callable[[argparse.Namespace], int]

_STATE_NAMES = {1: "CREATING", 2: "ACTIVE", 3: "IDLE", 4: "DELETING", 5: "ERROR"}


def _env_default(flag: str, fallback: str) -> str:
    from sidecar.config import env_name  # noqa: PLC0415 - keep `--help` of unrelated commands light

    return os.environ.get(env_name(flag), fallback)


# -- serve ------------------------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    from sidecar import app, config  # noqa: PLC0415 - gRPC and NVML load only when serving
    from sidecar.lifecycle import logs  # noqa: PLC0415 - gRPC and NVML load only when serving

    try:
        settings = config.load(args, os.environ)
    except config.ConfigError as exc:
        print(f"hami-mig-sidecar serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level)
    return app.serve(settings)


# -- status -----------------------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the header row first."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


def _placement(message: Any) -> str:
    return f"{message.start}:{message.size}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _owner(owner: Any) -> str:
    """A pod's container and device as ``ns/name[container/device]``, a claim's request as
    ``claim ns/name[request/device]`` (the uid where the name is not told)."""
    from hami.migsidecar.v1 import migsidecar_pb2 as pb  # noqa: PLC0415

    if owner.kind == pb.OWNER_KIND_CLAIM:
        claim = owner.claim
        who = f"{claim.namespace}/{claim.name}" if claim.name else claim.uid
        return f"claim {who}[{owner.request}/{owner.device_index}]" if claim.uid else ""
    pod = owner.pod
    who = f"{pod.namespace}/{pod.name}" if pod.name else pod.uid
    return f"{who}[{owner.container_index}/{owner.device_index}]" if pod.uid else ""


def format_status(info: Any, state: Any) -> str:
    """The human view of GetInfo + GetState: a header line and three tables."""
    started = (
        info.started_at.ToDatetime(tzinfo=dt.UTC).isoformat(timespec="seconds") if info.started_at else ""
    )
    out = [
        f"hami-mig-sidecar {info.sidecar_version} (api {info.api_version}), backend {info.backend}, "
        f"recovered {_yes(info.recovered)}, generation {state.generation}, "
        f"cdi {'on' if info.cdi_enabled else 'off'}, adopt-existing {_yes(info.adopt_existing)}",
        f"boot {info.boot_id}, started {started}",
        "",
        "GPUS",
    ]
    gpu_rows = [
        [
            str(g.gpu.index),
            g.gpu.uuid,
            g.gpu.model,
            f"{g.gpu.memory_mb}MiB",
            ("on" if g.gpu.mig_mode.current else "off")
            + ("" if g.gpu.mig_mode.pending == g.gpu.mig_mode.current else " (pending change)"),
            _yes(g.gpu.busy),
        ]
        for g in state.gpus
    ]
    out.append(_table(["INDEX", "UUID", "MODEL", "MEMORY", "MIG", "BUSY"], gpu_rows))
    instance_rows = []
    foreign_rows = []
    unverified_rows = []
    for g in state.gpus:
        for i in g.instances:
            owner = _owner(i.owner) if i.HasField("owner") else ""
            instance_rows.append(
                [
                    str(g.gpu.index),
                    _STATE_NAMES.get(i.state, str(i.state)),
                    i.profile,
                    _placement(i.placement),
                    str(i.gpu_instance_id),
                    str(i.compute_instance_id),
                    i.mig_uuid or "-",
                    owner or "-",
                    i.taken_over_from,
                    i.last_error or "",
                ]
            )
        for f in g.foreign:
            row = [
                str(g.gpu.index),
                f.profile,
                _placement(f.placement),
                str(f.gpu_instance_id),
                str(f.compute_instance_id) if f.has_compute_instance else "-",
                f.mig_uuid or "-",
            ]
            # Before Recover the sidecar's own instances are known only from their records on disk.
            if f.recorded_as:
                unverified_rows.append([*row, f.recorded_as])
            else:
                foreign_rows.append(row)
    out += ["", "INSTANCES"]
    headers = [
        "GPU",
        "STATE",
        "PROFILE",
        "PLACEMENT",
        "GI",
        "CI",
        "MIG UUID",
        "OWNER",
        "TAKEN OVER FROM",
        "ERROR",
    ]
    out.append(_table(headers, instance_rows) if instance_rows else "(none)")
    foreign_headers = ["GPU", "PROFILE", "PLACEMENT", "GI", "CI", "MIG UUID"]
    if unverified_rows:
        out += ["", "OWNED, NOT YET VERIFIED (a record on disk names it; the plugin's Recover checks it)"]
        out.append(_table([*foreign_headers, "RECORD"], unverified_rows))
    out += ["", "FOREIGN (not owned; never touched)"]
    out.append(_table(foreign_headers, foreign_rows) if foreign_rows else "(none)")
    if state.pending_cdi_removals:
        out += ["", "PENDING CDI REMOVALS", *state.pending_cdi_removals]
    return "\n".join(out) + "\n"


def socket_trouble(socket: Path) -> str:
    """Why nothing can be asked on ``socket``, as one line; "" when something answers there."""
    from sidecar.edge.unixsocket import Probe, probe  # noqa: PLC0415

    try:
        found = probe(socket)
    except OSError as exc:
        return f"cannot connect to {socket}: {exc.strerror or exc}"
    if found is Probe.MISSING:
        return f"no sidecar socket at {socket} (is the sidecar running?)"
    if found is Probe.REFUSED:
        return f"nothing answers on {socket}: connection refused (a stale socket; is the sidecar running?)"
    if found is Probe.NOT_A_SOCKET:
        return f"{socket} is not a socket (is --socket right?)"
    return ""


def _cmd_status(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from google.protobuf import json_format  # noqa: PLC0415
    from hami.migsidecar.v1 import migsidecar_pb2 as pb  # noqa: PLC0415
    from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc  # noqa: PLC0415

    from sidecar.edge import call  # noqa: PLC0415

    socket = call.resolve_socket("status", args.socket, socket_trouble)
    if socket is None:
        return EXIT_FAILED
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.MigSidecarStub(channel)
        try:
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=args.timeout)
            state = stub.GetState(pb.GetStateRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            return call.print_failure(f"status: {socket}", exc)
    if args.json:
        document = {
            "info": json_format.MessageToDict(
                info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            ),
            "state": json_format.MessageToDict(
                state, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            ),
        }
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(format_status(info, state))
    return EXIT_OK


# -- reclaim ----------------------------------------------------------------------------------------------


def _cmd_reclaim(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from google.protobuf import json_format  # noqa: PLC0415
    from hami.migsidecar.v1 import migsidecar_pb2 as pb  # noqa: PLC0415
    from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc  # noqa: PLC0415

    from sidecar.edge import call  # noqa: PLC0415

    socket = call.resolve_socket("reclaim", args.socket, socket_trouble)
    if socket is None:
        return EXIT_FAILED
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.MigSidecarStub(channel)
        try:
            gpus = stub.ListGpus(pb.ListGpusRequest(), timeout=args.timeout).gpus
            gpu = next((g for g in gpus if g.index == args.gpu), None)
            if gpu is None:
                print(
                    f"hami-mig-sidecar reclaim: the sidecar has no GPU with index {args.gpu}", file=sys.stderr
                )
                return EXIT_FAILED
            request = pb.ReclaimIdleRequest(
                gpu_uuid=gpu.uuid, mig_uuids=args.mig_uuid or [], force=args.force
            )
            response = stub.ReclaimIdle(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            from sidecar.edge.call import print_failure  # noqa: PLC0415

            return print_failure(f"reclaim: {socket}", exc)
    if args.json:
        document = json_format.MessageToDict(
            response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
        return EXIT_OK
    if not response.reclaimed:
        sys.stdout.write(f"GPU {gpu.index} ({gpu.uuid}): no IDLE instance to reclaim\n")
    for ref in response.reclaimed:
        sys.stdout.write(
            f"reclaimed {ref.mig_uuid} {ref.profile}@{_placement(ref.placement)} on GPU {gpu.index}\n"
        )
    for ref in response.kept:
        sys.stdout.write(
            f"kept {ref.mig_uuid} {ref.profile}@{_placement(ref.placement)} on GPU {gpu.index}:"
            " a pending reservation keeps it (--force overrides)\n"
        )
    return EXIT_OK


# -- records ----------------------------------------------------------------------------------------------


def _current_boot_id() -> str | None:
    from sidecar.store.records import BOOT_ID_PATH  # noqa: PLC0415

    try:
        return (Path("/proc") / BOOT_ID_PATH).read_text().strip()
    except OSError:
        return None


def _cmd_records_verify(args: argparse.Namespace) -> int:
    from sidecar.store import record_verify  # noqa: PLC0415

    boot_id = args.boot_id if args.boot_id is not None else _current_boot_id()
    try:
        report = record_verify.verify(Path(args.state_dir), boot_id or None)
    except OSError as exc:
        print(
            f"hami-mig-sidecar records verify: cannot read {args.state_dir}: {exc.strerror}", file=sys.stderr
        )
        return EXIT_FAILED
    sys.stdout.write(record_verify.format_report(report))
    return EXIT_FAILED if report.corrupt else EXIT_OK


# -- parser -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from sidecar import config  # noqa: PLC0415
    from sidecar.edge import call  # noqa: PLC0415
    from sidecar.nvml.sim import cli as simcli  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="hami-mig-sidecar",
        description="Owns the lifecycle of NVIDIA MIG instances on a GPU node for HAMi's device plugin, "
        "over a Unix-socket gRPC API. Every flag can also be set with HAMI_MIG_SIDECAR_<FLAG>.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the sidecar on its Unix socket",
        description="Run the sidecar: take the state directory lock, open the backend, serve gRPC on the "
        "socket until SIGTERM. Each flag also reads the environment variable named in its help.",
    )
    config.add_serve_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    status = commands.add_parser(
        "status",
        help="print what a running sidecar owns",
        description="Connect to a running sidecar and print GPUs, owned instances and foreign instances.",
    )
    status.add_argument(
        "--socket",
        default=_env_default("--socket", str(config.DEFAULT_SOCKET)),
        metavar="PATH",
        help=f"the sidecar's socket [env {config.env_name('--socket')}; default: {config.DEFAULT_SOCKET}]",
    )
    status.add_argument("--json", action="store_true", help="print GetInfo and GetState as one JSON document")
    status.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per-call deadline")
    status.set_defaults(func=_cmd_status)

    reclaim = commands.add_parser(
        "reclaim",
        help="destroy IDLE instances of a GPU on a running sidecar",
        description="Ask a running sidecar to destroy IDLE instances of one GPU (ReclaimIdle): the ones "
        "named with --mig-uuid, or every IDLE one. ACTIVE, ERROR and foreign instances are never destroyed; "
        "a named one that is not IDLE, an unknown MIG UUID or a running process refuses the whole call "
        "and nothing is destroyed (exit 1, the reason printed). An IDLE instance a pending reservation "
        "keeps is left (listed as kept), or refuses the call when named (RESERVED), unless --force.",
    )
    reclaim.add_argument(
        "--socket",
        default=_env_default("--socket", str(config.DEFAULT_SOCKET)),
        metavar="PATH",
        help=f"the sidecar's socket [env {config.env_name('--socket')}; default: {config.DEFAULT_SOCKET}]",
    )
    reclaim.add_argument("--gpu", type=int, required=True, metavar="N", help="the GPU's NVML index")
    reclaim.add_argument(
        "--mig-uuid",
        action="append",
        metavar="MIG-UUID",
        help="an IDLE instance to destroy (repeatable; default: every IDLE instance of the GPU)",
    )
    reclaim.add_argument("--json", action="store_true", help="print the ReclaimIdle response as JSON")
    reclaim.add_argument(
        "--force",
        action="store_true",
        help="destroy IDLE instances a pending reservation keeps, too (the scheduler's pod will fail)",
    )
    reclaim.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="per-call deadline (destroys on real hardware take a while)",
    )
    reclaim.set_defaults(func=_cmd_reclaim)

    call.register(
        commands,
        {
            "default": _env_default("--socket", str(config.DEFAULT_SOCKET)),
            "metavar": "PATH",
            "help": f"the sidecar's socket [env {config.env_name('--socket')}; "
            f"default: {config.DEFAULT_SOCKET}]",
        },
        socket_trouble,
    )

    records_parser = commands.add_parser("records", help="inspect ownership records offline")
    records_commands = records_parser.add_subparsers(dest="records_command", metavar="ACTION", required=True)
    verify = records_commands.add_parser(
        "verify",
        help="report valid, corrupt and stale records (exit 1 if any is corrupt)",
        description="Read every ownership record of a state directory without locking or changing it and "
        "report which are valid, corrupt (never deleted automatically) and stale (from another boot).",
    )
    verify.add_argument(
        "--state-dir",
        default=_env_default("--state-dir", str(config.DEFAULT_STATE_DIR)),
        metavar="DIR",
        help=f"the state directory [env {config.env_name('--state-dir')}; "
        f"default: {config.DEFAULT_STATE_DIR}]",
    )
    verify.add_argument(
        "--boot-id",
        default=None,
        metavar="ID",
        help="boot id that counts as current (default: this machine's /proc/sys/kernel/random/boot_id)",
    )
    verify.set_defaults(func=_cmd_records_verify)

    probe = commands.add_parser(
        "probe",
        help="read-only: print the GPUs' MIG tables and diff them against the model of each GPU",
        description="Read the real GPUs' GI and CI profile tables, placements and instances (MIG UUID "
        "derived both ways) and diff them against the model of each GPU name. Never creates, destroys or "
        "changes a mode.",
    )
    probe.add_argument("--json", action="store_true", help="print one JSON document")
    probe.add_argument("--sim-state", default=None, metavar="FILE", help="probe this simulated node instead")
    probe.set_defaults(func=_cmd_probe)

    simcli.register(commands)
    return parser


def _cmd_probe(args: argparse.Namespace) -> int:
    from sidecar import nvml  # noqa: PLC0415
    from sidecar.nvml import probe  # noqa: PLC0415

    kind, state = ("simulated", Path(args.sim_state)) if args.sim_state else ("nvml", None)
    try:
        backend = nvml.open_backend(kind, state, retry_wait=False)  # nvmlInit through the adapter
    except nvml.BackendUnavailableError as exc:
        print(f"hami-mig-sidecar probe: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        roots = (str(backend.driver_root),) if backend.driver_root is not None else probe.DRIVER_ROOTS
        return probe.run(args.json, driver_roots=roots)
    finally:
        backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.func
    return handler(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
