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
import threading

import pytest

import aiobrpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
ECHO_PROTO = ["--proto", str(ROOT / "proto" / "echo.proto"), "-I", str(ROOT / "proto")]
ECHO = "example.EchoService/Echo"
HTTP_400 = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
NESTED_PROTO = """
syntax = "proto3";
package t;
enum Color { RED = 0; GREEN = 1; }
message Inner { int32 sleep_ms = 1; Color color = 2; }
message Req { Inner inner = 1; repeated Inner items = 2; }
service S { rpc M(Req) returns (Req); }
"""

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


@pytest.fixture
def http_peer():
    """A server that answers every connection with an HTTP 400, as a web server would."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    conn.settimeout(5)
                    if conn.recv(1):
                        conn.sendall(HTTP_400)
                        conn.shutdown(socket.SHUT_WR)
                        while conn.recv(4096):
                            pass
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def attempt_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("attempt ")]


def test_version_names_the_implementation(env, twin):
    done = run_cli(env, "--version")
    assert done.returncode == 0, done.stderr
    expected = "compiled: cython" if twin == "cython" else "pure python"
    assert done.stdout == f"aiobrpc {aiobrpc.__version__} ({expected})\n"
    assert aiobrpc.implementation() == twin


# The README's demo command installs aiobrpc alone: the demo runs with only the modules of
# aiobrpc's dependencies (and theirs) importable, those of every extra blocked.
DEMO_WITH_THE_BASE_INSTALL_ONLY = '''
import importlib.abc
import importlib.metadata as md
import re
import sys


def normalized(requirement):
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


base, todo = set(), ["aiobrpc"]
while todo:
    dist = todo.pop()
    if dist in base:
        continue
    base.add(dist)
    try:
        todo += [normalized(r) for r in md.requires(dist) or [] if "extra ==" not in r]
    except md.PackageNotFoundError:
        pass


def top_level_modules(dist):
    # Python 3.10's packages_distributions() reads only top_level.txt, which wheels built by
    # meson-python (numpy's) do not carry: the names are taken from the installed files then.
    names = set((dist.read_text("top_level.txt") or "").split())
    for file in dist.files or []:
        first = file.parts[0] if file.parts else ""
        if first in ("..", "__pycache__") or first.endswith((".dist-info", ".egg-info", ".data", ".pth")):
            continue
        names.add(first[:-3] if first.endswith(".py") else first.partition(".")[0])
    return names - {""}


owners = {}
for dist in md.distributions():
    for module in top_level_modules(dist):
        owners.setdefault(module, set()).add(normalized(dist.metadata["Name"] or ""))
blocked = {m for m, dists in owners.items() if not dists & base}
assert {"pytest", "numpy"} <= blocked, "the test extra is installed here: its modules are blocked"


class BeyondTheBaseInstall(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r} (outside aiobrpc's base install)", name=fullname)
        return None


sys.meta_path.insert(0, BeyondTheBaseInstall())
try:
    import numpy  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("numpy, of the test extra, was importable")
from aiobrpc.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''


def test_the_demo_needs_only_the_base_install(env, twin):
    done = subprocess.run([sys.executable, "-c", DEMO_WITH_THE_BASE_INSTALL_ONLY, "demo", "--seconds", "0.5",
                           "--concurrency", "4"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"errors\W+0\W", done.stdout), done.stdout
    assert re.search(rf"_fast\W+{twin}\W", done.stdout), done.stdout


def test_demo_prints_a_summary(env, twin):
    done = run_cli(env, "demo", "--seconds", "1", "--concurrency", "8", "--size", "64")
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
    assert re.fullmatch(r"call failed: \[E1008\]Reached timeout=50ms @127\.0\.0\.1:\d+\n", done.stderr), done.stderr


def test_call_closed_port_exits_1_in_one_line(env):
    done = run_cli(env, "call", f"127.0.0.1:{closed_port()}", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}')
    assert done.returncode == 1
    # The refused connect marks the server failed, so the retries brpc makes by default find
    # it down: EHOSTDOWN, the first error, then the three retries that failed alike, told once.
    assert re.fullmatch(r"call failed: \[E112\]\[E111\]Fail to connect 127\.0\.0\.1:\d+: Connection refused "
                        r"\[R1-R3\]\[E112\]Not connected to 127\.0\.0\.1:\d+ yet: the server is down, "
                        r"health check running\n", done.stderr), done.stderr


def test_call_list_url_of_a_dead_server_tells_each_failure_once(env):
    done = run_cli(env, "call", f"list://127.0.0.1:{closed_port()}", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}')
    assert done.returncode == 1
    assert re.fullmatch(r"call failed: \[E112\]\[E111\]Fail to connect 127\.0\.0\.1:\d+: Connection refused "
                        r"\[R1-R3\]\[E112\]Fail to select server: none of the 1 servers of rr is available\n",
                        done.stderr), done.stderr


def test_call_verbose_lists_the_attempts_and_the_log(env):
    done = run_cli(env, "call", f"127.0.0.1:{closed_port()}", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}', "-v")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert re.fullmatch(r"WARNING aiobrpc\.client\.pool: server 127\.0\.0\.1:\d+ is marked failed .*", lines[0])
    assert re.fullmatch(r"attempt 1: server=127\.0\.0\.1:\d+ correlation_id=- result=E111 \(Connection refused\)",
                        lines[1])
    assert lines[2:5] == [f"attempt {n}: server=- correlation_id=- result=E112 (Host is down)" for n in (2, 3, 4)]
    assert lines[5].startswith("call failed: [E112][E111]")
    assert len(lines) == 6


def test_call_list_url_skips_a_dead_server(env, echo_server):
    _, address = echo_server
    url = f"list://127.0.0.1:{closed_port()},{address}"
    done = run_cli(env, "call", url, ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}', "--timeout-ms", "5000")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"message": "hi"}
    assert done.stderr == ""  # the dead server's warning is the library's log: only with -v
    done = run_cli(env, "call", url, ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}', "--timeout-ms", "5000",
                   "--lb", "rr", "-v")
    assert done.returncode == 0, done.stderr
    attempts = attempt_lines(done.stderr)
    assert 1 <= len(attempts) <= 2, done.stderr
    assert re.fullmatch(rf"attempt {len(attempts)}: server={address} correlation_id=1 result=ok", attempts[-1])
    if len(attempts) == 2:  # rr started at the dead server: refused, retried on the other
        assert attempts[0].endswith("result=E111 (Connection refused)")


def test_call_accepts_an_ipv6_address(env):
    port = closed_port()
    done = run_cli(env, "call", f"[::1]:{port}", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}')
    assert done.returncode == 1  # refused, or no IPv6 here: either way the address was taken
    assert re.match(rf"call failed: \[E\d+\](\[E\d+\])?Fail to connect \[::1\]:{port}: ", done.stderr), done.stderr


@pytest.mark.parametrize("host, why", [("nonexistent.invalid", "[A-Z][a-z]+ .*"),  # the resolver's words
                                       ("127.0.0..1", "not a valid host name")], ids=["unknown", "malformed"])
def test_call_unresolvable_host_exits_1_without_retry(env, host, why):
    done = run_cli(env, "call", f"{host}:8000", ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}', "-v",
                   "--timeout-ms", "-1")
    assert done.returncode == 1
    assert re.fullmatch(f"call failed: \\[E113\\]Fail to connect {re.escape(host)}:8000: "
                        f"cannot resolve host '{re.escape(host)}': {why}", done.stderr.splitlines()[-1]), done.stderr
    assert "Unknown error" not in done.stderr
    assert attempt_lines(done.stderr) == [f"attempt 1: server={host}:8000 correlation_id=- "
                                          f"result=E113 (No route to host)"]


def test_call_non_brpc_peer_shows_its_first_bytes_once(env, http_peer):
    done = run_cli(env, "call", http_peer, ECHO, *ECHO_PROTO, "-d", '{"message": "hi"}')
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"call failed: [E112][E1009]Broken connection to {http_peer}: unknown protocol "
                                  '(not a brpc server?): first bytes "HTTP/1.1 400 Bad Request\\r\\n')
    assert done.stderr.count("first bytes") == 1


def call_args(address: str = "127.0.0.1:8000", data: str = '{"message": "hi"}', *more: str) -> list[str]:
    return ["call", address, ECHO, *ECHO_PROTO, "-d", data, *more]


@pytest.mark.parametrize("args, message", [
    (call_args("localhost"), "address must look like 'host:port'"),
    (call_args("list://127.0.0.1:1,127.0.0..1:2"), "bad server entry '127.0.0..1:2'"),
    (call_args("list://127.0.0.1:1,[::1]2"), "bad server entry '[::1]2'"),
    (call_args("nope://example.invalid"), "unknown naming service nope://"),
    (call_args("list://127.0.0.1:1", "{}", "--lb", "nope"),
     "argument --lb: invalid choice: 'nope' (choose from c_ketama, c_md5, c_murmurhash, la, p2c, random, rr, wr, wrr)"),
    (call_args("127.0.0.1:1", "{}", "--lb", "rr"), "--lb needs a naming service ADDR"),
    (call_args("list://127.0.0.1:1", "{}", "--lb", "rr:hold_seconds=5"), "give both min_working_instances"),
    (["call", "127.0.0.1:8000", ECHO, "--proto", "missing.proto"], "proto file not found: missing.proto"),
    (call_args(data='{"message": '), "-d: invalid JSON at line 1, column 13: Expecting value"),
    (call_args(data='{"message": "hi",\n "sleep_ms": }'), "-d: invalid JSON at line 2, column 14"),
    (call_args(data='{"message": "a", "message": "b"}'), '-d: duplicate key "message"'),
    (call_args(data='{"mesage": "hi"}'), '-d: example.EchoRequest has no field named "mesage" '
                                         "(fields: message, sleep_ms)"),
    (call_args(data='{"message": "hi", "sleep_ms": "abc"}'), '-d: field "sleep_ms": expected an integer, got "abc"'),
    (call_args(data='{"message": "hi", "sleepMs": 1.5}'), '-d: field "sleepMs": expected an integer, got 1.5'),
    (call_args(data='{"message": "hi", "sleep_ms": 3000000000}'),
     '-d: field "sleep_ms": expected an integer in -2147483648..2147483647, got 3000000000'),
    (call_args(data='{"message": 7}'), '-d: field "message": expected a string, got 7'),
    (call_args(data="[1]"), "-d: expected an object (example.EchoRequest), got [1]"),
    (call_args(data="{}"), "-d: example.EchoRequest lacks required fields: message"),
    (["call", "127.0.0.1:8000", "example.EchoService/Ping", *ECHO_PROTO], "no method 'Ping'"),
    (["call", "127.0.0.1:8000"], "the following arguments are required: METHOD, --proto"),
    (["demo", "--seconds", "0"], "--seconds: must be > 0"),
    (call_args("list://", '{"message": "hi"}'), "'list://' lists no server: give one or more"),
    (call_args("list:// , #none", '{"message": "hi"}'), "'list:// , #none' lists no server"),
], ids=["address", "list-entry", "list-ipv6", "scheme", "lb", "lb-plain", "lb-params", "proto", "json", "json-line",
        "duplicate", "field", "int", "int-json-name", "int-range", "string", "not-object", "required", "method",
        "missing-args", "seconds", "list-empty", "list-only-blanks"])
def test_user_errors_exit_2_in_one_line(env, args, message):
    done = run_cli(env, *args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"aiobrpc {args[0]}: error: "), done.stderr
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize("data, message", [
    ('{"inner": {"sleep_ms": "abc"}}', 'field "inner.sleep_ms": expected an integer, got "abc"'),
    ('{"items": [{}, {"color": "BLUE"}]}', 'field "items[1].color": expected one of RED, GREEN (t.Color), got "BLUE"'),
    ('{"items": {}}', 'field "items": expected a list of t.Inner objects, got {}'),
    ('{"inner": {"nope": 1}}', 'field "inner": t.Inner has no field named "nope" (fields: sleep_ms, color)'),
    ('{"inner": 3}', 'field "inner": expected an object (t.Inner), got 3'),
], ids=["nested", "enum", "list", "nested-name", "object"])
def test_json_errors_name_the_nested_field(env, tmp_path, data, message):
    proto = tmp_path / "nested.proto"
    proto.write_text(NESTED_PROTO)
    done = run_cli(env, "call", "127.0.0.1:8000", "t.S/M", "--proto", str(proto), "-d", data)
    assert done.returncode == 2
    assert done.stderr == f"aiobrpc call: error: -d: {message}\n"


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
