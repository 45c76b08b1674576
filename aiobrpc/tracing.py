"""brpc's trace ids across calls: `trace_id`, `span_id`, `parent_span_id` of RpcRequestMeta.

A call made while a span is current carries its trace id, the current span as its parent, and
a span id of its own; a server handling such a request makes that span current while the
handler runs, so the calls the handler makes continue the trace, as brpc's rpcz does. Start a
trace with `with aiobrpc.tracing.trace():` (or set `cntl.trace_id` on one call). The ids are
64-bit, as brpc's; `cntl.trace_id`, `cntl.span_id` and `cntl.parent_span_id` show them on both
sides.

When the `opentelemetry-api` package is installed, a server also opens an OpenTelemetry span
for each traced request ("<Service>/<Method>", kind SERVER), whose trace id is brpc's trace id
and whose parent is the caller's span of the call (the request's span_id): traces recorded by an OpenTelemetry SDK line up with
brpc's.
"""

from __future__ import annotations

import contextlib
import random
from contextvars import ContextVar
from typing import Iterator

_current: ContextVar[Span | None] = ContextVar("aiobrpc_span", default=None)
current = _current.get  # the span current here, or None
_rng = random.SystemRandom()


class Span:
    """One span of a trace: the ids brpc puts in a request's meta."""

    __slots__ = ("trace_id", "span_id", "parent_span_id")

    def __init__(self, trace_id: int, span_id: int, parent_span_id: int | None = None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id

    def __repr__(self) -> str:
        return f"Span(trace_id={self.trace_id:#x}, span_id={self.span_id:#x}, parent_span_id=" \
               f"{'None' if self.parent_span_id is None else hex(self.parent_span_id)})"


def new_id() -> int:
    """A random non-zero 63-bit id (brpc's ids are int64 on the wire, 0 meaning none)."""
    return _rng.getrandbits(63) or 1


@contextlib.contextmanager
def trace(trace_id: int | None = None) -> Iterator[Span]:
    """Make the calls inside one trace: a root span (a new trace id unless one is given)."""
    if trace_id is not None and (not isinstance(trace_id, int) or not 0 < trace_id < 1 << 64):
        raise ValueError(f"trace_id must be an int in 1..2^64-1, got {trace_id!r}")
    span = Span(trace_id or new_id(), new_id())
    token = _current.set(span)
    try:
        yield span
    finally:
        _current.reset(token)


def enter(span: Span) -> None:
    """Make `span` current in this context (a server, for the request it runs)."""
    _current.set(span)


def _otel():
    try:
        from opentelemetry import trace as otel
    except ImportError:
        return None
    return otel


OTEL = _otel()  # the opentelemetry.trace module, or None where it is not installed


def end_server_span(cm, error_code: int) -> None:
    """Close a span of `server_span`, marked as an error when the call failed."""
    if error_code:
        span = OTEL.get_current_span()
        span.set_attribute("rpc.brpc.error_code", error_code)
        span.set_status(OTEL.Status(OTEL.StatusCode.ERROR, f"E{error_code}"))
    cm.__exit__(None, None, None)


@contextlib.contextmanager
def server_span(name: str, span: Span, peer: str) -> Iterator[object]:
    """An OpenTelemetry SERVER span for a traced request (opentelemetry must be installed)."""
    otel = OTEL
    parent = otel.NonRecordingSpan(otel.SpanContext(
        trace_id=span.trace_id, span_id=span.span_id, is_remote=True,
        trace_flags=otel.TraceFlags(otel.TraceFlags.SAMPLED)))
    tracer = otel.get_tracer("aiobrpc")
    attributes = {"rpc.system": "brpc", "rpc.method": name, "net.peer.name": peer,
                  "brpc.trace_id": span.trace_id, "brpc.span_id": span.span_id}
    with tracer.start_as_current_span(name, context=otel.set_span_in_context(parent),
                                      kind=otel.SpanKind.SERVER, attributes=attributes) as s:
        yield s
