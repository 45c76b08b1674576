"""Stub and Servicer: typed access to a protobuf service, built from its ServiceDescriptor.

Any generated `_pb2` module works; no code generation is needed.

>>> stub = Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])  # doctest: +SKIP
>>> resp = await stub.Echo(echo_pb2.EchoRequest(message="hi"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from .errors import RpcError

if TYPE_CHECKING:
    from .controller import Controller


def message_class(descriptor):
    return message_factory.GetMessageClass(descriptor)


class RpcChannel(Protocol):
    """What a stub calls: `aiobrpc.Channel`, the combo channels (ParallelChannel,
    SelectiveChannel, PartitionChannel, DynamicPartitionChannel) and any object of yours with
    this `call_method`; the type of generated stubs' `channel`."""

    def call_method(self, service_name: str, method_name: str, request: Any, response_class: Any,
                    cntl: Controller | None = None, /) -> Awaitable[Any]:
        """Call `service_name`/`method_name` with `request`; the response, a `response_class`."""
        ...


class _Method:
    __slots__ = ("_channel", "service_name", "method_name", "request_class", "response_class")

    def __init__(self, channel, method_descriptor) -> None:
        self._channel = channel
        self.service_name = method_descriptor.containing_service.full_name
        self.method_name = method_descriptor.name
        self.request_class = message_class(method_descriptor.input_type)
        self.response_class = message_class(method_descriptor.output_type)

    def __call__(self, request, cntl=None):
        # Returns the channel's coroutine itself: one coroutine frame less per call. The test
        # is check_request's, inline: one Python call less per call.
        if type(request) is not self.request_class and not isinstance(request, self.request_class):
            raise wrong_request(self.service_name, self.method_name, self.request_class, request)
        return self._channel.call_method(self.service_name, self.method_name, request,
                                         self.response_class, cntl)

    def __repr__(self) -> str:
        return f"<method {self.service_name}.{self.method_name}>"


class _StreamingMethod(_Method):
    """A streaming rpc, called over gRPC (client/grpc_stream.py): `rpc M(A) returns (stream B)`
    and `rpc M(stream A) returns (stream B)` return a ResponseStream at once; `rpc M(stream A)
    returns (B)` is awaited for its response."""

    __slots__ = ("client_streaming", "server_streaming")

    def __init__(self, channel, method_descriptor) -> None:
        super().__init__(channel, method_descriptor)
        self.client_streaming = method_descriptor.client_streaming
        self.server_streaming = method_descriptor.server_streaming

    def __call__(self, request, cntl=None):
        return call_streaming(self._channel, self.service_name, self.method_name, request, self.request_class,
                              self.response_class, self.client_streaming, self.server_streaming, cntl)


def call_streaming(channel, service_name: str, method_name: str, request, request_class, response_class,
                   client_streaming: bool, server_streaming: bool, cntl=None) -> Any:
    """Call the streaming rpc `service_name.method_name` over `channel`, an aiobrpc.Channel with
    ChannelOptions(protocol="grpc") (what Stub and the generated typed stubs do): `request` is one
    message, or for a client-streaming rpc an iterable or async iterable of them. A server-
    streaming or bidirectional rpc returns an `aiobrpc.ResponseStream` at once; a client-
    streaming one an awaitable of its response. Over another channel RpcError(EREQUEST) (in
    `cntl` too), and for a request of another type TypeError, before anything is sent."""
    from .client import grpc_stream
    try:
        grpc_stream.refuse_unless_grpc(channel, method_name)
    except RpcError as e:
        if cntl is not None:
            cntl.error_code, cntl.error_text = e.code, e.text
        raise
    if client_streaming:
        grpc_stream.check_requests(f"{service_name}.{method_name}", request, request_class)
    else:
        check_request(service_name, method_name, request, request_class)
    call = grpc_stream.StreamingCall(channel, service_name, method_name, request_class, response_class,
                                     not server_streaming, cntl)
    if client_streaming:
        call.start(None, request)
    else:
        call.start(request, None)
    return grpc_stream.ResponseStream(call) if server_streaming else call.result()


def check_request(service_name: str, method_name: str, request, request_class: type = Message) -> None:
    """Raise TypeError unless `request` is a `request_class` (by default any protobuf message):
    the check of Stub's methods and of `Channel.call_method`, before anything is sent."""
    if type(request) is not request_class and not isinstance(request, request_class):
        raise wrong_request(service_name, method_name, request_class, request)


def wrong_request(service_name: str, method_name: str, request_class: type, request) -> TypeError:
    descriptor = getattr(request_class, "DESCRIPTOR", None)  # None on protobuf's Message itself
    expected = f"a request of type {descriptor.full_name}" if descriptor is not None else "a protobuf message"
    return TypeError(f"{service_name}.{method_name} takes {expected}, got {type(request).__name__}")


class Stub:
    """Client side of `service`: one awaitable attribute per method.

    `await stub.Method(request, cntl=None)` returns the response or raises RpcError; a request
    of another message type raises TypeError. The call names the service by its full name
    (`package.Service`, e.g. "example.EchoService") and the method by its name ("Echo"), as a
    C++ brpc client does: it is `channel.call_method(service.full_name, "Echo", request,
    EchoResponse, cntl)`.

    Streaming rpcs are called over gRPC (`ChannelOptions(protocol="grpc")`; over baidu_std they
    raise RpcError(EREQUEST) before anything is sent): `rpc M(A) returns (stream B)` is
    `async for b in stub.M(a, cntl)`; `rpc M(stream A) returns (B)` is `await stub.M(requests,
    cntl)` with an iterable or async iterable of A; `rpc M(stream A) returns (stream B)` is
    `async for b in stub.M(requests, cntl)`, the requests sent as they come (docs/grpc.md,
    "Streaming calls").
    """

    def __init__(self, channel, service: ServiceDescriptor) -> None:
        if not isinstance(service, ServiceDescriptor):
            raise TypeError(f"service must be a protobuf ServiceDescriptor, got {type(service).__name__}")
        self.channel = channel
        self.service = service
        for m in service.methods:
            streaming = m.client_streaming or m.server_streaming
            setattr(self, m.name, (_StreamingMethod if streaming else _Method)(channel, m))

    if TYPE_CHECKING:
        # The methods are set from the descriptor at run time: to a type checker each is a
        # callable of Any (a unary method returns an awaitable, a streaming one may return a
        # ResponseStream, aiobrpc.sync.Stub's return the response), so `await stub.Echo(...)`
        # and `stub.Echo(...).message` check. Typed stubs: docs/typed_stubs.md.
        def __getattr__(self, name: str) -> Callable[..., Any]: ...


class Servicer:
    """Base of a server-side service implementation.

    Set SERVICE to the ServiceDescriptor and define one method per rpc, named as in the
    .proto: `async def Echo(self, request, cntl)` (or a plain `def`, which runs in the
    server's thread pool). Return the response message, or raise RpcError(code, text):
    `errors.EREQUEST` for a request the handler cannot accept. The handler reads the request's
    attachment, user fields and deadline from `cntl` and may set the response's.

    >>> class Echo(Servicer):  # doctest: +SKIP
    ...     SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]
    ...     async def Echo(self, request, cntl):
    ...         return echo_pb2.EchoResponse(message=request.message)

    Streaming rpcs, served to gRPC clients (docs/grpc.md), take the shape of their rpc:
    `rpc M(A) returns (stream B)` is an async generator `async def M(self, request, cntl)`
    that yields each response; `rpc M(stream A) returns (B)` is `async def M(self, requests,
    cntl)` returning the response, where `requests` is an async iterator of the request
    messages (`async for`, or `await requests.read()`, None after the last); and
    `rpc M(stream A) returns (stream B)` an async generator taking `requests`.

    >>> class Chat(Servicer):  # doctest: +SKIP
    ...     async def Talk(self, requests, cntl):
    ...         async for line in requests:
    ...             yield chat_pb2.Line(text=line.text.upper())
    """

    SERVICE: ServiceDescriptor
    """The protobuf ServiceDescriptor served, e.g. `echo_pb2.DESCRIPTOR.services_by_name["EchoService"]`."""

    def receive_attachment_into(self, method: str, request, attachment_size: int):
        """Where the attachment of a request to `method` is to be received; None (this
        default) for a buffer of the server's own.

        Asked once a large request's head (its meta and `request`, the parsed message) has
        arrived and before its attachment has, for attachments that do not arrive with the
        head (over 64 KiB): return a writable C-contiguous buffer of exactly
        `attachment_size` bytes (a slice of a numpy array, a CPU tensor's memory) and the
        kernel writes the attachment there, with no copy in between; the handler's
        `cntl.request_attachment` is then a view of it. Anything else (None, another size, an
        exception: logged) receives the request as usual. Runs on the event loop; requests of
        a connection not yet authenticated, and compressed or checksummed ones, are never
        offered. Keep it short, and leave the buffer alone until the handler runs; if the
        connection is lost before the whole attachment came, the handler never runs and the
        buffer holds what had arrived."""
        return None
