"""aiobrpc logs, and leaves where the log goes to the application: a program that set no
logging up prints nothing of it (a NullHandler on the "aiobrpc" logger keeps Python's
last-resort handler away), one that did gets the records as usual.

Each program runs in a subprocess (logging is process-wide) on the twin under test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60

PROGRAM = """
import asyncio
import logging
import sys

import aiobrpc
from aiobrpc._proto import echo_pb2

if sys.argv[2] == "configured":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")


async def main(address):
    lb = "rr" if address.startswith("list://") else None
    async with aiobrpc.Channel(address, load_balancer=lb) as channel:
        try:
            await channel.call_method("example.EchoService", "Echo", echo_pb2.EchoRequest(message="x"),
                                      echo_pb2.EchoResponse)
        except aiobrpc.RpcError as e:
            print(e.code)


asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture
def env(twin):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if twin == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    return env


@pytest.fixture
def refusing_address():
    """An address that refuses connections: a port bound, not listening, for the test's time."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def run(env, address: str, logging_setup: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, address, logging_setup], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("target", ["refused", "empty list"])
def test_a_failed_call_prints_nothing_where_logging_is_not_set_up(env, refusing_address, target):
    address = refusing_address if target == "refused" else "list://"
    done = run(env, address, "none")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("112", "61"), done.stdout  # EHOSTDOWN after the refusal, ENODATA
    assert done.stderr == ""


def test_the_application_that_sets_logging_up_gets_the_warnings(env, refusing_address):
    done = run(env, refusing_address, "configured")
    assert done.returncode == 0, done.stderr
    assert f"WARNING aiobrpc.client.pool: server {refusing_address} is marked failed" in done.stderr
