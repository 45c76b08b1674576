"""brpc's trace ids across calls: `trace_id`, `span_id`, `parent_span_id` of RpcRequestMeta.

A call made while a span is current carries its trace id, the current span as its parent, and
a span id of its own; a server handling such a request makes that span current while the
handler runs, so the calls the handler makes continue the trace, as brpc's rpcz does. Start a
trace with `with aiobrpc.tracing.trace():` (or set `cntl.trace_id` on one call). The ids are
64-bit, as brpc's; `cntl.trace_id`, `cntl.span_id` and `cntl.parent_span_id` show them on both
sides.

When the `opentelemetry-api` package is installed, each traced call opens OpenTelemetry spans
named "<Service>/<Method>" whose trace id is brpc's trace id: on the client a CLIENT span for
the whole call (its attempts, retries and backups included), whose span id becomes the call's
brpc span id and whose parent is the span current where the call was made; on the server a
SERVER span whose parent is that client span (the request's span_id). So traces recorded by an
OpenTelemetry SDK line up with brpc's, and a C++ brpc peer's ids fit in. The root span of
`trace()` (or the implied root of a call that sets `cntl.trace_id` alone) is not recorded:
it is the parent the first calls name. Only brpc-traced calls open spans; an untraced call costs
nothing here.
"""

from __future__ import annotations

import contextlib
import logging
import random
from contextvars import ContextVar
from typing import Iterator

_current: ContextVar[Span | None] = ContextVar("aiobrpc_span", default=None)
current = _current.get  # the span current here, or None
_rng = random.SystemRandom()
logger = logging.getLogger("aiobrpc.tracing")


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


def start_client_span(name: str, cntl) -> object | None:
    """Open the OpenTelemetry CLIENT span of a traced call and, where a tracer records it, make
    its span id the call's (cntl.span_id). None where opentelemetry fails here: tracing never
    fails a call."""
    otel = OTEL
    try:
        parent = otel.NonRecordingSpan(otel.SpanContext(
            trace_id=cntl.trace_id, span_id=cntl.parent_span_id or new_id(), is_remote=False,
            trace_flags=otel.TraceFlags(otel.TraceFlags.SAMPLED)))
        span = otel.get_tracer("aiobrpc").start_span(
            name, context=otel.set_span_in_context(parent), kind=otel.SpanKind.CLIENT,
            attributes={"rpc.system": "brpc", "rpc.method": name, "brpc.trace_id": cntl.trace_id})
        if span.is_recording():
            cntl.span_id = span.get_span_context().span_id
            span.set_attribute("brpc.span_id", cntl.span_id)
        return span
    except Exception:
        logger.exception("an OpenTelemetry client span could not be opened for %s", name)
        return None


def end_client_span(span, cntl) -> None:
    """Close a call's CLIENT span with where it went and how it ended."""
    try:
        if cntl.remote_side:
            span.set_attribute("net.peer.name", cntl.remote_side)
        if cntl.retried_count:
            span.set_attribute("rpc.brpc.retried_count", cntl.retried_count)
        if cntl.error_code:
            span.set_attribute("rpc.brpc.error_code", cntl.error_code)
            span.set_status(OTEL.Status(OTEL.StatusCode.ERROR, f"E{cntl.error_code}: {cntl.error_text}"))
        span.end()
    except Exception:
        logger.exception("an OpenTelemetry client span could not be closed")


def start_server_span(name: str, span: Span, peer: str):
    """Open (and make current) the OpenTelemetry SERVER span of a traced request: its trace id
    brpc's, its parent the caller's span (the request's span_id). None where opentelemetry fails
    here: tracing never fails a request."""
    try:
        cm = _server_span(name, span, peer)
        cm.__enter__()
        return cm
    except Exception:
        logger.exception("an OpenTelemetry server span could not be opened for %s", name)
        return None


def end_server_span(cm, error_code: int) -> None:
    """Close a span of `start_server_span`, marked as an error when the request failed."""
    try:
        if error_code:
            span = OTEL.get_current_span()
            span.set_attribute("rpc.brpc.error_code", error_code)
            span.set_status(OTEL.Status(OTEL.StatusCode.ERROR, f"E{error_code}"))
        cm.__exit__(None, None, None)
    except Exception:
        logger.exception("an OpenTelemetry server span could not be closed")


@contextlib.contextmanager
def _server_span(name: str, span: Span, peer: str) -> Iterator[object]:
    otel = OTEL
    parent = otel.NonRecordingSpan(otel.SpanContext(
        trace_id=span.trace_id, span_id=span.span_id or new_id(), is_remote=True,
        trace_flags=otel.TraceFlags(otel.TraceFlags.SAMPLED)))
    tracer = otel.get_tracer("aiobrpc")
    attributes = {"rpc.system": "brpc", "rpc.method": name, "net.peer.name": peer,
                  "brpc.trace_id": span.trace_id, "brpc.span_id": span.span_id}
    with tracer.start_as_current_span(name, context=otel.set_span_in_context(parent),
                                      kind=otel.SpanKind.SERVER, attributes=attributes) as s:
        yield s
