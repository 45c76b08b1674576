"""A method's handler behind the server's interceptors (aiobrpc/interceptors.py)."""

from __future__ import annotations

import inspect
import logging

from ..errors import EINTERNAL, RpcError
from ..interceptors import chain
from .dispatch import MethodEntry, exception_text

log = logging.getLogger(__name__)


def intercept(entry: MethodEntry, interceptors: tuple, run_in_pool) -> None:
    """Make `entry.handler` an async handler that runs `interceptors` around the method's own
    (a plain def one through `run_in_pool(handler, request, cntl)`, as the server runs it)."""
    handler, is_async = entry.handler, entry.is_async

    async def handle(request, cntl):
        try:
            response = await handler(request, cntl) if is_async else await run_in_pool(handler, request, cntl)
            while inspect.isawaitable(response):
                response = await response
        except RpcError:
            raise
        except Exception as e:  # the handler's bug, told as the server tells it without interceptors
            log.error("handler %s failed", entry.full_name, exc_info=e)
            raise RpcError(EINTERNAL, exception_text(e)) from e
        return response

    outermost = chain(interceptors, handle)
    entry.handler = outermost
    entry.is_async = True
