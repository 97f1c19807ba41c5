"""How a servicer goes on the wire: every RPC of the contract it implements, with a request
deserializer that never raises (an unparsable body becomes ``Undecodable``, which the servicer refuses
INVALID_REQUEST, where grpcio would answer a raising deserializer with a bare INTERNAL).

It knows the servicer only as ``Servicer`` (its methods found by the RPCs' names, and how it
refuses an undecodable body), so it imports nothing of ``sidecar.edge.server``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message
from hami.migsidecar.v1 import migsidecar_pb2 as pb

Context = grpc.aio.ServicerContext[Any, Any]


class Undecodable:
    """What a request body that does not parse as its message turns into; the handler refuses it."""

    def __init__(self, why: str) -> None:
        self.why = why


class Servicer(Protocol):
    """What ``register`` needs besides the RPC methods themselves."""

    async def refuse_undecodable(self, method: str, why: str, context: Context) -> NoReturn: ...


def _tolerant(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer that hands an unparsable body on as ``Undecodable``: grpcio answers a
    raising deserializer with a bare INTERNAL, and the contract says INVALID_REQUEST."""

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return parse


def _unary(
    servicer: Servicer, method: str, behaviour: Callable[[Message, Context], Awaitable[Message]]
) -> Callable[[Message | Undecodable, Context], Awaitable[Message]]:
    async def call(request: Message | Undecodable, context: Context) -> Message:
        if isinstance(request, Undecodable):
            await servicer.refuse_undecodable(method, request.why, context)
        return await behaviour(request, context)

    return call


def _streaming(
    servicer: Servicer, method: str, behaviour: Callable[[Message, Context], AsyncIterator[Message]]
) -> Callable[[Message | Undecodable, Context], AsyncIterator[Message]]:
    async def call(request: Message | Undecodable, context: Context) -> AsyncIterator[Message]:
        if isinstance(request, Undecodable):
            await servicer.refuse_undecodable(method, request.why, context)
        async for message in behaviour(request, context):
            yield message

    return call


def register(servicer: Servicer, server: grpc.aio.Server) -> None:
    """Serve every RPC of the contract that ``servicer`` implements, with tolerant deserializers.

    Built from the service descriptor instead of the generated ``add_..._to_server``, which demands a
    method for every RPC of the proto: one the servicer does not implement yet is left out, and
    gRPC answers it UNIMPLEMENTED."""
    service = pb.DESCRIPTOR.services_by_name["MigSidecar"]
    handlers: dict[str, grpc.RpcMethodHandler[Message | Undecodable, Message]] = {}
    for method in service.methods:
        if not hasattr(servicer, method.name):
            continue
        # Found by the RPC's name, so mypy cannot tell which message it takes: typed as taking any
        # Message, which holds as its deserializer below comes from the same method descriptor.
        behaviour = getattr(servicer, method.name)
        response_class = message_factory.GetMessageClass(method.output_type)
        deserializer = _tolerant(message_factory.GetMessageClass(method.input_type))
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(servicer, method.name, behaviour),
                request_deserializer=deserializer,
                response_serializer=response_class.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(servicer, method.name, behaviour),
                request_deserializer=deserializer,
                response_serializer=response_class.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    # grpcio's own registered-method fast path (what the generated code calls).
    server.add_registered_method_handlers(service.full_name, handlers)
