"""Every call ends (issue 15): with its result or an error, never silence; a user callback that
raises fails only the call it served, with a clear error, and never reaches the loop.

Calls use timeout_ms=-1 (where the deadline is not what is tested) under asyncio.wait_for(.., 5):
a call that would never end fails the test in seconds. Scaffolding from test_call_rules.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from tests.client.test_call_rules import Cluster, Req, fails

HANG = 5  # seconds: a call still running by then would never have ended


@pytest_asyncio.fixture
async def cluster():
    c = Cluster()
    yield c
    await c.close()


def ends(coro):
    return asyncio.wait_for(coro, HANG)


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG
    while not predicate():
        assert loop.time() < deadline, f"waited {HANG}s for {what}"
        await asyncio.sleep(0.002)


def hold_until(event: asyncio.Event, message: str = "slow"):
    async def script(srv, request, cntl, n):
        if request.message == message:
            await event.wait()
    return script


# -- the credential goes with the first request that is sent -------------------------------------
class Verifier:
    def __init__(self) -> None:
        self.credentials: list[bytes] = []

    def verify_credential(self, credential, peer):
        self.credentials.append(credential)
        return credential == b"secret"


class Secret:
    def generate_credential(self):
        return b"secret"


async def test_a_request_that_fails_to_pack_does_not_use_up_the_credential(cluster):
    verifier = Verifier()
    srv = await cluster.start(auth=verifier)
    channel, stub = cluster.channel([srv], timeout_ms=-1, auth=Secret())
    bad = aiobrpc.Controller()
    bad.request_attachment = np.arange(64, dtype=np.uint8)[::2]  # not contiguous: never packed
    err = await ends(fails(stub.Echo(Req(message="bad"), bad)))
    assert err.code == errors.EREQUEST
    # Sent without the credential, it would fail with ERPCAUTH (and lose the connection).
    assert (await ends(stub.Echo(Req(message="good")))).message.endswith("|good")
    assert verifier.credentials == [b"secret"] and srv.count() == 1


