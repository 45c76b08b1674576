"""Asking the server's authenticator (ServerOptions.auth) about a credential, and what a refused
peer is told: shared by baidu_std, HTTP/1.1 and gRPC.

An authenticator has `verify_credential(credential: bytes, peer) -> bool`, which may return an
awaitable, and may have `unauthorized_error_text() -> str` (brpc's GetUnauthorizedErrorText),
appended to "Fail to authenticate" in what a refused peer receives.
"""

from __future__ import annotations

import asyncio
import inspect

REFUSED = "Fail to authenticate"


def unauthorized_error_text(auth) -> str:
    """The authenticator's own text for a refused peer, "" if it has none."""
    text_of = getattr(auth, "unauthorized_error_text", None)
    if text_of is None:
        return ""
    try:
        return str(text_of())[:1024]
    except Exception:  # noqa: BLE001 - the refusal goes out without it
        return ""


def refusal_text(auth) -> str:
    """brpc's "Fail to authenticate", with the authenticator's own text after ": " if it has one."""
    extra = unauthorized_error_text(auth)
    return f"{REFUSED}: {extra}" if extra else REFUSED


async def verify(auth, credential: bytes, peer) -> tuple[bool, str]:
    """(whether `credential` is let in, why not). An authenticator that raises, or whose
    awaitable is cancelled while the server is not stopping, refuses."""
    try:
        ok = auth.verify_credential(credential, peer)
        if inspect.isawaitable(ok):
            ok = await ok
        return bool(ok), ""
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # 3.11+; on 3.10 a refusal either way
        if cancelling is not None and cancelling():
            raise  # our own task is cancelled (the server stops): not the authenticator's verdict
        return False, f"authenticator raised {e!r}"
    except Exception as e:  # noqa: BLE001 - the authenticator's failure refuses the peer
        return False, f"authenticator raised {e!r}"
