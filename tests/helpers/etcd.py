"""A real etcd server for the tests of `etcd://` and EtcdRegistration.

`etcd_server` (session scope) starts the `etcd` binary (PATH, or /usr/bin/etcd) on 127.0.0.1
with ephemeral ports and a temporary data directory, once per test process, and stops it at the
end. Without the binary the tests using it skip, saying what to install; with
AIOBRPC_REQUIRE_TOOLS=1 (set by .ci/run, which installs it) they fail instead. `etcd` (function
scope) makes sure it runs (a test may have killed it) and gives each test a key prefix of its
own. A test module enables them with `from tests.helpers.etcd import etcd, etcd_server`.

`ListFeed` reads the lists a naming service publishes, with timeouts (every naming test uses it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


class ListFeed:
    """The lists `service.watch()` yields. `next()` waits (bounded) for the next one; `none()`
    asserts none comes for a while; `close()` ends the watch and closes the service."""

    def __init__(self, service) -> None:
        self.service = service
        self.lists = service.watch()
        self._pending: asyncio.Future | None = None  # a __anext__ outliving a timed-out wait

    async def next(self, timeout: float = 3.0):
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.lists.__anext__())
        result = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        self._pending = None
        return result

    async def none(self, for_s: float = 0.3) -> None:
        try:
            got = await self.next(for_s)
        except asyncio.TimeoutError:
            return
        raise AssertionError(f"a list came: {got}")

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
        await self.lists.aclose()
        await self.service.close()

    async def __aenter__(self) -> ListFeed:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def etcd_binary() -> str | None:
    found = shutil.which("etcd")
    if found is None and os.access("/usr/bin/etcd", os.X_OK):
        found = "/usr/bin/etcd"
    return found


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdProcess:
    """One single-member etcd on 127.0.0.1: `start()`, `kill()` (SIGKILL, as a crash), `stop()`;
    a start after a kill reuses its ports and data directory."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_ports(2)
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"test={peer_url}",
             # One member: a short election timeout makes it leader at once; it also lets
             # leases be as short as 1 s (etcd's minimum TTL follows the election timeout).
             "--heartbeat-interval", "20", "--election-timeout", "100",
             "--logger", "zap", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not start on {self.endpoint}; its log:\n"
                           f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class EtcdForTest:
    """The running etcd and a key prefix no other test uses."""

    server: EtcdProcess
    prefix: str  # "/aiobrpc-test/<random>/"

    def url(self, prefix: str | None = None) -> str:
        return f"etcd://{self.server.endpoint}{prefix or self.prefix}"

    def client(self):
        import aetcd

        return aetcd.Client("127.0.0.1", self.server.client_port, timeout=5)


# Each test module importing the fixture has a session fixture of its own: they share this one.
_started: EtcdProcess | None = None


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    binary = etcd_binary()
    if binary is None:
        if os.environ.get("AIOBRPC_REQUIRE_TOOLS") == "1":
            pytest.fail("etcd is not installed (apt-get install etcd-server)")
        pytest.skip("needs the etcd binary on PATH or at /usr/bin/etcd (apt-get install etcd-server)")
    try:
        import aetcd  # noqa: F401
    except ImportError:
        if os.environ.get("AIOBRPC_REQUIRE_TOOLS") == "1":
            pytest.fail("the aetcd package is not installed (pip install -e '.[test]')")
        pytest.skip("needs the aetcd package (pip install -e '.[test]')")
    global _started
    if _started is None:
        _started = EtcdProcess(binary, tmp_path_factory.mktemp("etcd") / "data")
        _started.start()
    yield _started
    if _started is not None:
        _started.stop()
        _started = None


@pytest.fixture
def etcd(etcd_server):
    if not etcd_server.running:  # a test killed it and failed before starting it again
        etcd_server.start()
    return EtcdForTest(etcd_server, f"/aiobrpc-test/{uuid.uuid4().hex[:12]}/")
