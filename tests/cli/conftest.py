"""CLI fixtures: the `aiobrpc` command as users run it, `python -m aiobrpc ...` in a subprocess
on the twin under test (the pure one with AIOBRPC_NO_EXTENSIONS=1), and servers started the
same way on ephemeral ports. A test fails on any exception that reaches the loop's handler."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import select
import subprocess
import sys

import pytest

from aiobrpc import _fast
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICERS = pathlib.Path(__file__).with_name("servicers.py")


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if _fast.IMPLEMENTATION == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    else:
        env.pop("AIOBRPC_NO_EXTENSIONS", None)
    return env


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiobrpc", *args], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def assert_usage_error(done: subprocess.CompletedProcess, command: str, message: str) -> None:
    """`done` exited 2 with one line on stderr, `aiobrpc <command>: error: ...<message>...`."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"aiobrpc {command}: error: "), done.stderr
    assert message in done.stderr, done.stderr


@contextlib.contextmanager
def served(*args: str):
    """`aiobrpc <args> --port 0` running, with the (process, "host:port", label) it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "aiobrpc", *args, "--port", "0"], env=cli_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        line = proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"(.+) listening on (127\.0\.0\.1:\d+)\n", line)
        assert m, f"{args[0]} printed {line!r}, stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield proc, m.group(2), m.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def echo_address():
    """The address of one `serve-echo` process shared by the tests of a module."""
    with served("serve-echo") as (_, address, _):
        yield address


@pytest.fixture(scope="module")
def flaky_address():
    """The address of one `serve tests/cli/servicers.py` process (FlakyEchoService)."""
    with served("serve", str(SERVICERS)) as (_, address, _):
        yield address
