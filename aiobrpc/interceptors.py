"""Interceptors: the user's code around every call of a channel, or every request of a server.

An interceptor is an async callable `interceptor(request, cntl, proceed)` that returns the
response. `await proceed(request, cntl)` runs the rest of the chain: the next interceptor, and
after the last one the call itself (client) or the method's handler (server). Code before it
runs before the request is sent (or handled), code after it once the reply is there, and an
`except aiobrpc.RpcError` around it sees the call's error. An interceptor may change the
request, call `proceed` again (a retry of its own), or not call it at all and answer itself
(a cache, a refusal).

>>> async def log_calls(request, cntl, proceed):  # doctest: +SKIP
...     try:
...         return await proceed(request, cntl)
...     finally:
...         print(cntl.service_name, cntl.method_name, cntl.error_code, cntl.latency_us)
>>> aiobrpc.ChannelOptions(interceptors=[log_calls])  # doctest: +SKIP

Rules, on both sides:
* Order: the first interceptor of the list is the outermost: it sees the request first and
  the reply last.
* `cntl.service_name` and `cntl.method_name` name the method before the first interceptor runs.
* An `RpcError` raised by an interceptor fails the call (the request) with its code and text,
  like one raised by the handler or by the call.
* Any other exception an interceptor raises is a bug of that interceptor: it is logged and the
  call fails with EINTERNAL ("interceptor <name> raised ..."); so is a response that is not of
  the method's response type on the client (on the server: ERESPONSE, as for a handler).
  Cancellation passes through untouched.
* Client: each `proceed` is one whole call (its deadline, retries, backup request) and is
  counted in `channel.status()`; the controller tells the result the caller gets (an
  interceptor that answers after a failed `proceed` leaves it successful).
* Server: the handler's own rules hold inside `proceed` (a plain `def` handler runs in the
  thread pool); `cntl.set_failed` from an interceptor fails the request as from the handler.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .errors import EINTERNAL, RpcError

log = logging.getLogger(__name__)

Proceed = Callable[[Any, Any], Awaitable[Any]]
Interceptor = Callable[[Any, Any, Proceed], Awaitable[Any]]


def checked_interceptors(name: str, interceptors) -> tuple:
    """`interceptors` as a tuple of callables, or TypeError naming what is wrong."""
    if interceptors is None:
        return ()
    if isinstance(interceptors, (str, bytes)) or not isinstance(interceptors, Sequence):
        raise TypeError(f"{name} must be a list of async callables (request, cntl, proceed), "
                        f"got {type(interceptors).__name__}")
    for i in interceptors:
        if not callable(i):
            raise TypeError(f"{name} must hold async callables (request, cntl, proceed), got {i!r}")
    return tuple(interceptors)


def describe(interceptor) -> str:
    return getattr(interceptor, "__qualname__", None) or type(interceptor).__qualname__


def chain(interceptors: tuple, innermost: Proceed, response_class=None) -> Proceed:
    """`proceed` of the outermost interceptor: each layer runs the next, the last `innermost`,
    which raises nothing but RpcError (so what else a layer sees is its interceptor's own).
    With `response_class`, a layer's response must be one."""
    proceed = innermost
    for interceptor in reversed(interceptors):
        proceed = _layer(interceptor, proceed, response_class)
    return proceed


def _layer(interceptor, inner: Proceed, response_class) -> Proceed:
    async def layer(request, cntl):
        try:
            response = await interceptor(request, cntl, inner)
        except RpcError:
            raise
        except Exception as e:
            raise failed(interceptor, e) from e
        if response_class is not None and type(response) is not response_class \
                and not isinstance(response, response_class):
            raise RpcError(EINTERNAL, f"interceptor {describe(interceptor)} returned "
                                      f"{type(response).__name__}, not {response_class.__name__}")
        return response
    return layer


def failed(interceptor, e: Exception) -> RpcError:
    log.error("interceptor %s raised %r; the call fails with EINTERNAL", describe(interceptor), e, exc_info=e)
    return RpcError(EINTERNAL, f"interceptor {describe(interceptor)} raised {e!r}")
