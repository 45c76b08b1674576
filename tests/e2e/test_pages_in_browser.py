"""The builtin pages in a real browser (headless Chromium, Debian's `chromium`, which .ci/run
installs): loaded from a server under load, no console error on any, every link of / opens,
the plots are drawn. Screenshots are kept in build/page_screenshots/ (AIOBRPC_ARTIFACTS to
put them elsewhere)."""

from __future__ import annotations

import asyncio
import os
import urllib.parse

import pytest

import aiobrpc
from aiobrpc._proto import interop_pb2
from aiobrpc.server import builtin
from tests.helpers.browser import Browser, chromium
from tests.helpers.interop_server import SERVICE, InteropEcho

pytestmark = pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs Debian's)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOTS = os.path.join(os.environ.get("AIOBRPC_ARTIFACTS", os.path.join(ROOT, "build")), "page_screenshots")


async def _load(srv, stop: asyncio.Event, done: list) -> None:
    # A deadline no busy machine reaches (the browser and a CPU hog beside the loop made the
    # default one fail a few calls once): what is tested is that the pages do not break calls.
    async with aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(max_retry=0, timeout_ms=120_000)) as ch:
        stub = aiobrpc.Stub(ch, SERVICE)
        while not stop.is_set():
            try:
                await stub.Echo(interop_pb2.EchoRequest(message="m", sleep_ms=1))
                done[0] += 1
            except aiobrpc.RpcError as e:
                done[1] += 1
                done.append(f"[E{e.code}] {e.text}")


def test_the_control_page_shows_the_browser_sees_console_errors():
    with Browser() as b:
        page = b.open("data:text/html,<script>console.error('seen')</script><p>x</p>")
    assert page.errors == ["console: seen"]  # so an empty list below means no error, not deafness


async def test_every_page_loads_clean_in_a_browser_under_load():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(rpcz=True))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    stop, done = asyncio.Event(), [0, 0]
    callers = [asyncio.create_task(_load(srv, stop, done)) for _ in range(4)]
    try:
        while done[0] < 50:
            await asyncio.sleep(0.05)
        for _ in range(3):  # a few samples for the plots, as the housekeeper takes each second
            srv.series.sample(builtin.variables(srv))
        base = f"http://127.0.0.1:{srv.port}"
        var = f"rpc_server_{srv.port}_interop_echo_service_echo_count"
        pages = await asyncio.to_thread(_browse, base, var)
    finally:
        stop.set()
        await asyncio.gather(*callers)
        await srv.stop()
        await srv.join(timeout=5)
    assert done[1] == 0, done[2:]
    for path, page in pages.items():
        assert page.status == 200, (path, page.status, page.text[:200])
        assert page.errors == [], (path, page.errors)
        assert page.screenshot.startswith(b"\x89PNG"), path
    index = pages["/"]
    links = [urllib.parse.urlsplit(u) for u in index.links]
    assert {f"/{p}" for p in builtin._LISTED} <= {u.path for u in links}
    assert "Echo latency (us)" in pages["/status"].text and "last 60 minutes" in pages["/status"].text
    plot = pages[f"/vars/{var}"]
    assert "last 60 seconds" in plot.text and "now:" in plot.text
    assert f"/vars/{var}" in {urllib.parse.urlsplit(u).path for u in pages["/vars"].links}
    assert "Echo" in pages["/rpcz"].text and "http" in pages["/connections"].text


def _browse(base: str, var: str) -> dict:
    os.makedirs(SHOTS, exist_ok=True)
    pages = {}
    with Browser() as b:
        index = pages["/"] = b.open(base + "/")
        wanted = [urllib.parse.urlsplit(u).path for u in index.links if u.startswith(base)]
        wanted += ["/status", "/vars", f"/vars/{var}", "/connections", "/rpcz", "/flags"]
        for path in dict.fromkeys(wanted):
            if path not in pages:
                pages[path] = b.open(base + path)
    for path, page in pages.items():
        name = path.strip("/").replace("/", "_") or "index"
        with open(os.path.join(SHOTS, f"{name[:80]}.png"), "wb") as f:
            f.write(page.screenshot)
    return pages
