"""The `aiobrpc` command as users run it: `python -m aiobrpc ...` in a subprocess.

The subprocesses use the twin under test: the pure one runs with AIOBRPC_NO_EXTENSIONS=1.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ECHO_PROTO = ["--proto", str(ROOT / "proto" / "echo.proto"), "-I", str(ROOT / "proto")]
ECHO = "example.EchoService/Echo"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="signals and select() on pipes")


@pytest.fixture
def env(twin):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if twin == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    else:
        env.pop("AIOBRPC_NO_EXTENSIONS", None)
    return env


def run_cli(env, *args: str, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiobrpc", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def echo_server(env):
    """A `serve-echo --port 0` process and the address it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "aiobrpc", "serve-echo", "--port", "0"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        line = proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"EchoService listening on (127\.0\.0\.1:\d+)\n", line)
        assert m, f"serve-echo printed {line!r}, stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield proc, m.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_prints_a_summary(env, twin):
    start = time.monotonic()
    done = run_cli(env, "demo", "--seconds", "1", "--concurrency", "8", "--size", "64")
    assert time.monotonic() - start < 1 + 4
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for word in ("QPS", "p50", "p99", "max", "MB/s"):
        assert word in out
    assert re.search(r"errors\W+0\W", out), out
    assert re.search(rf"_fast\W+{twin}\W", out), out
    assert "Traceback" not in done.stderr


def test_call_prints_the_response_as_json(env, echo_server, tmp_path):
    _, address = echo_server
    sent = tmp_path / "request.bin"
    sent.write_bytes(bytes(range(256)) * 3)
    received = tmp_path / "response.bin"
    done = run_cli(env, "call", address, ECHO, *ECHO_PROTO, "-d", '{"message": "hi", "sleep_ms": 1}',
                   "--log-id", "7", "--timeout-ms", "2000", "--attachment-file", str(sent),
                   "--response-attachment-file", str(received))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"message": "hi"}
    assert received.read_bytes() == sent.read_bytes()


def test_call_timeout_exits_1_with_brpc_code(env, echo_server):
    _, address = echo_server
    done = run_cli(env, "call", address, ECHO, *ECHO_PROTO, "-d", '{"message": "hi", "sleep_ms": 500}',
                   "--timeout-ms", "50")
    assert done.returncode == 1
    assert done.stdout == ""
    assert re.fullmatch(r"\[E1008\]Reached timeout=50ms @127\.0\.0\.1:\d+\n", done.stderr), done.stderr


def test_call_closed_port_exits_1(env):
    done = run_cli(env, "call", f"127.0.0.1:{closed_port()}", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}')
    assert done.returncode == 1
    # The refused connect marks the server failed (one warning), so the retries brpc makes
    # by default find it down: EHOSTDOWN with every attempt's error, as a C++ client reports.
    warning, error = done.stderr.splitlines()
    assert re.fullmatch(r"WARNING aiobrpc\.client\.pool: server 127\.0\.0\.1:\d+ is marked failed .*", warning)
    assert re.fullmatch(r"\[E112\]\[E111\]Fail to connect 127\.0\.0\.1:\d+: Connection refused "
                        r"\[R1\]\[E112\]Not connected to .* \[R3\]\[E112\].*", error), error


@pytest.mark.parametrize("args, message", [
    (["call", "localhost", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}'], "host:port"),
    (["call", "127.0.0.1:8000", ECHO, "--proto", "missing.proto"], "proto file not found: missing.proto"),
    (["call", "127.0.0.1:8000", ECHO, *ECHO_PROTO, "-d", '{"message": '], "bad request JSON"),
    (["call", "127.0.0.1:8000", ECHO, *ECHO_PROTO, "-d", '{"mesage": "hi"}'], 'no field named "mesage"'),
    (["call", "127.0.0.1:8000", ECHO, *ECHO_PROTO, "-d", "{}"], "lacks required fields: message"),
    (["call", "127.0.0.1:8000", "example.EchoService/Ping", *ECHO_PROTO], "no method 'Ping'"),
    (["demo", "--seconds", "0"], "--seconds: must be > 0"),
], ids=["address", "proto", "json", "field", "required", "method", "seconds"])
def test_user_errors_exit_2_in_one_line(env, args, message):
    done = run_cli(env, *args)
    assert done.returncode == 2
    assert done.stdout == ""
    last = done.stderr.splitlines()[-1]
    assert message in last, done.stderr
    assert "Traceback" not in done.stderr
    if args[0] == "call":
        assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_echo_stops_gracefully_on_signal(env, echo_server, signum):
    proc, address = echo_server
    done = run_cli(env, "call", address, ECHO, *ECHO_PROTO, "-d", '{"message": "before"}')
    assert done.returncode == 0, done.stderr
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"got {signum.name}, stopping" in err
    assert "Traceback" not in err
