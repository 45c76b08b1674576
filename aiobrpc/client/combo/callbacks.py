"""User callbacks (policies, load balancers) asked by combo channels: one that raises ends
the call it served with EINTERNAL, logged once, as a Channel does."""

from __future__ import annotations

import logging

from ...errors import EINTERNAL, RpcError

log = logging.getLogger(__name__)


class CallbackError(Exception):
    """`what` raised: `error` (EINTERNAL) ends the call."""

    def __init__(self, what: str, exc: Exception) -> None:
        super().__init__(what)
        log.error("%s raised %r; the call fails with EINTERNAL", what, exc, exc_info=exc)
        self.error = RpcError(EINTERNAL, f"{what} raised {exc!r}")


def ask(what: str, callback, *args):
    """`callback(*args)`; what it raises becomes CallbackError."""
    try:
        return callback(*args)
    except Exception as e:
        raise CallbackError(what, e) from None
