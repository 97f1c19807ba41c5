"""``hami-mig-sidecar call`` and ``hami-mig-sidecar health``: the API from a shell, nothing to install.

``call METHOD [JSON]`` sends one request of the contract, written as JSON with the proto field names
(``{"pod_uid": "pod-1"}``; the lowerCamel JSON names are accepted too), and prints the response as
JSON with the proto field names, every field included. METHOD is a MigSidecar method (``Allocate``) or
``SERVICE/METHOD`` (``grpc.health.v1.Health/Check``). ``--field PATH`` prints one value of the
response instead (``gpus.0.uuid``: keys and list indexes separated by dots; a string unquoted), for a
shell variable. A refusal prints ``CODE REASON: message (key=value, ...)``, the ErrorInfo reason and
metadata, on stderr and exits 1. Every error is one line on stderr (line breaks in a message become
spaces), so a script or a log collector reads one record per failure. ``--timeout`` is the deadline
of the call, a stream's (``WatchHealth``) too: a following stream ends there, with
``DEADLINE_EXCEEDED``; without it a unary call has 60 s and a stream none (``follow`` runs until
Ctrl-C).

``health [--service NAME]`` asks ``grpc.health.v1.Health/Check`` and prints the status; exit 0 only
for SERVING. The probes of ``deploy/daemonset.yaml`` run it: service ``""`` (the process: NOT_SERVING
while an NVML call or reconciler round is stuck) for liveness, ``hami.migsidecar.v1.MigSidecar``
(SERVING once recovered) for readiness. It asks on the health listener beside ``--socket`` (beside
the socket a symlink leads to; ``unixsocket.health_socket``), where a flood of connections on the
socket itself cannot starve it.

Exit codes: 0 answered (SERVING for ``health``), 1 refused, unreachable or not SERVING, 2 bad usage
(unknown method, a request that does not parse, a ``--field`` the response does not have).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.edge.unixsocket import health_socket

if TYPE_CHECKING:
    from google.protobuf.message import Message

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# The longest request text ``call`` reads: the JSON of the largest request the sidecar accepts
# (edge.limits, about 0.7 MB in protobuf) is well under it; anything longer is refused before parsing.
MAX_REQUEST_TEXT = 8 * 1024 * 1024

HEALTH_CHECK = "grpc.health.v1.Health/Check"
UNARY_TIMEOUT_S = 60.0  # ``call``'s deadline of a unary call without --timeout


def _seconds(text: str) -> float:
    """A ``--timeout``: a finite number of seconds > 0 (a deadline of 0 or NaN ends every call)."""
    value = float(text)  # ValueError: argparse's "invalid _seconds value"
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds > 0")
    return value


def _methods() -> dict[str, tuple[str, type[Message], type[Message], bool]]:
    """Name -> (gRPC path, request class, response class, server-streaming) for every method
    ``call`` knows: the unary ones and those that stream answers (``WatchHealth``)."""
    from google.protobuf import message_factory  # noqa: PLC0415
    from grpc_health.v1 import health_pb2  # noqa: PLC0415
    from hami.migsidecar.v1 import migsidecar_pb2 as pb  # noqa: PLC0415

    found: dict[str, tuple[str, type[Message], type[Message], bool]] = {}
    # Any: the health stubs type DESCRIPTOR as the upb or the Python descriptor, GetMessageClass takes one.
    services: tuple[tuple[Any, bool], ...] = (
        (pb.DESCRIPTOR.services_by_name["MigSidecar"], True),
        (health_pb2.DESCRIPTOR.services_by_name["Health"], False),
    )
    for service, short in services:
        for method in service.methods:
            if method.client_streaming or (method.server_streaming and not short):
                continue  # the health service's Watch: ``health`` is the probe's command
            entry = (
                f"/{service.full_name}/{method.name}",
                message_factory.GetMessageClass(method.input_type),
                message_factory.GetMessageClass(method.output_type),
                bool(method.server_streaming),
            )
            found[f"{service.full_name}/{method.name}"] = entry
            if short:
                found[method.name] = entry
    return found


def _field(document: object, path: str) -> object:
    """The value at ``path`` (``gpus.0.uuid``) of a decoded JSON document; KeyError if absent."""
    value: object = document
    for part in path.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(part)
    return value


def one_line(text: str) -> str:
    """``text`` with every line break and run of white space as one space."""
    return " ".join(text.split())


def print_failure(command: str, exc: Any) -> int:
    """``CODE REASON: message (key=value, ...)`` with the ErrorInfo metadata, one line on stderr."""
    from google.rpc import error_details_pb2  # noqa: PLC0415
    from grpc_status import rpc_status  # noqa: PLC0415

    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    reason, metadata = "", {}
    status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            reason, metadata = f" {info.reason}", dict(info.metadata)
    line = f"hami-mig-sidecar {command}: {code}{reason}: {details}"
    if metadata:
        line += " (" + ", ".join(f"{key}={value}" for key, value in sorted(metadata.items())) + ")"
    sys.stderr.write(one_line(line) + "\n")
    return EXIT_FAILED


def resolve_socket(command: str, raw: str, trouble: Callable[[Path], str]) -> Path | None:
    """The socket every command talks to: ``raw`` made absolute against the working directory (gRPC
    takes only an absolute path after unix://; a relative one means what it means to a shell), or
    None after printing in one line why nothing answers there. The one resolution of all commands."""
    socket = Path(raw).absolute()
    why = trouble(socket)
    if why:
        print(f"hami-mig-sidecar {command}: {why}", file=sys.stderr)
        return None
    return socket


def _connect(command: str, args: argparse.Namespace) -> str | None:
    """The gRPC target of ``args.socket``, or None after printing why nothing answers there."""
    socket = resolve_socket(command, args.socket, args.socket_trouble)
    return None if socket is None else f"unix://{socket}"


def _read_request(args: argparse.Namespace) -> str:
    """The request text, at most ``MAX_REQUEST_TEXT`` + 1 characters of it (stdin is not read further)."""
    if args.request == "-":
        return sys.stdin.read(MAX_REQUEST_TEXT + 1)
    return str(args.request)


def cmd_call(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from google.protobuf import json_format  # noqa: PLC0415

    methods = _methods()
    if args.method not in methods:
        names = ", ".join(sorted(m for m in methods if "/" not in m))
        print(
            f"hami-mig-sidecar call: no method {args.method!r}; MigSidecar has {names}, and {HEALTH_CHECK}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    path, request_class, response_class, streaming = methods[args.method]
    text = _read_request(args)
    try:
        if len(text) > MAX_REQUEST_TEXT:
            raise ValueError(
                f"it is over {MAX_REQUEST_TEXT} characters, more than any request the sidecar accepts"
            )
        document = json.loads(text)
        if not isinstance(document, dict):
            raise json_format.ParseError(f"want a JSON object, got {type(document).__name__}")
        request = json_format.ParseDict(document, request_class())
    except RecursionError:
        print(
            f"hami-mig-sidecar call {args.method}: the request does not parse: nested too deeply",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except (ValueError, json_format.ParseError) as exc:  # json.JSONDecodeError is a ValueError
        print(
            f"hami-mig-sidecar call {args.method}: the request does not parse: {one_line(str(exc))}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    target = _connect("call", args)
    if target is None:
        return EXIT_FAILED
    with grpc.insecure_channel(target) as channel:
        if streaming:  # one JSON object a line, as each answer comes; a following one until Ctrl-C
            stream = channel.unary_stream(
                path,
                request_serializer=request_class.SerializeToString,
                response_deserializer=response_class.FromString,
            )
            try:
                for response in stream(request, timeout=args.timeout):
                    code = _print(args, response, indent=None)
                    if code != EXIT_OK:
                        return code
                    sys.stdout.flush()
            except grpc.RpcError as exc:
                return print_failure(f"call {args.method}", exc)
            return EXIT_OK
        stub = channel.unary_unary(
            path,
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        try:
            response = stub(request, timeout=UNARY_TIMEOUT_S if args.timeout is None else args.timeout)
        except grpc.RpcError as exc:
            return print_failure(f"call {args.method}", exc)
    return _print(args, response, indent=2)


def _print(args: argparse.Namespace, response: Message, indent: int | None) -> int:
    """One answer as JSON (proto field names), or its ``--field``."""
    from google.protobuf import json_format  # noqa: PLC0415

    answer = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if args.field is None:
        sys.stdout.write(json.dumps(answer, indent=indent) + "\n")
        return EXIT_OK
    try:
        value = _field(answer, args.field)
    except KeyError as exc:
        print(
            f"hami-mig-sidecar call {args.method}: the response has no {args.field} ({exc})", file=sys.stderr
        )
        return EXIT_USAGE
    sys.stdout.write((value if isinstance(value, str) else json.dumps(value)) + "\n")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    given = Path(args.socket)
    with contextlib.suppress(OSError):  # the listener is beside the socket a symlink leads to
        given = given.resolve(strict=True)
    socket = resolve_socket("health", str(health_socket(given)), args.socket_trouble)
    if socket is None:
        return EXIT_FAILED
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            # Any: the typed stubs of grpcio-health-checking declare HealthStub without its methods.
            stub: Any = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            return print_failure("health", exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(f"{args.service or '(process)'}: {status}")
    return EXIT_OK if answer.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED


def register(commands: Any, socket_flag: dict[str, Any], socket_trouble: Callable[[Path], str]) -> None:
    """Add ``call`` and ``health`` to the console script's subcommands; ``socket_flag`` are the
    keyword arguments of the ``--socket`` option every client command shares, ``socket_trouble``
    says in one line why nothing answers on a socket ("" when something does)."""
    call = commands.add_parser(
        "call",
        help="send one request to a running sidecar, JSON in and out",
        description="Send one request of the contract, written as JSON with the proto field names, and "
        "print the response as JSON. METHOD is a MigSidecar method (Allocate, ListGpus, ...) or "
        f"SERVICE/METHOD ({HEALTH_CHECK}). A refusal prints its code, ErrorInfo reason and metadata on "
        "stderr and exits 1.",
    )
    call.add_argument("method", metavar="METHOD", help="e.g. Allocate, GetState, " + HEALTH_CHECK)
    call.add_argument(
        "request", metavar="JSON", nargs="?", default="{}", help="the request ('-': stdin; default {})"
    )
    call.add_argument("--socket", **socket_flag)
    call.add_argument(
        "--field",
        metavar="PATH",
        help="print only this value of the response, e.g. gpus.0.uuid (strings unquoted)",
    )
    call.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"deadline of the call, a stream's too (default: {UNARY_TIMEOUT_S:g} s for a unary call, "
        "as a create takes seconds on a node; none for a stream)",
    )
    call.set_defaults(func=cmd_call, socket_trouble=socket_trouble)

    health = commands.add_parser(
        "health",
        help="exit 0 if the sidecar's health service answers SERVING (the probes' command)",
        description="Ask grpc.health.v1.Health/Check and print the status; exit 0 for SERVING, 1 otherwise. "
        "Service '' (the default) is the process: NOT_SERVING while an NVML call or a reconciler round has "
        "run past --stuck-threshold. hami.migsidecar.v1.MigSidecar is SERVING once a Recover succeeded. "
        "It asks on the health listener the sidecar serves beside --socket, PATH.health.",
    )
    health.add_argument("--socket", **socket_flag)
    health.add_argument(
        "--service", default="", metavar="NAME", help="the service to ask about (default: '')"
    )
    health.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS", help="deadline")
    health.set_defaults(func=cmd_health, socket_trouble=socket_trouble)
