"""Packet faults from nftables in a private network namespace: docs/hostile_inputs.md rows E6-E8.

Each test runs an aiobrpc Server and Channel in one process inside `unshare --net`, where the
loopback is ours to break. The scenario runs the compiled twin on uvloop and the pure twin on
asyncio: both twins and both loops in two runs instead of four. Without root, unshare, ip and
nft the tests skip, saying why and what to install; with AIOBRPC_REQUIRE_TOOLS=1 (set by
.ci/run, which installs them) they fail instead.
"""

from __future__ import annotations

import os

import pytest

from aiobrpc import errors
from tests.helpers.netns import netns_available, run_in_netns

SERVER_PORT = 9000  # the server's port inside the namespace
DEAD_PORT = 9999  # where nothing listens, or every packet is dropped

# Prepended to every scenario: `async def main() -> dict` is defined by the scenario.
PRELUDE = r'''
import asyncio, json, os
import aiobrpc
from aiobrpc import _fast
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.netns import nft

def channel(port, **opts):
    ch = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(**opts))
    return ch, aiobrpc.Stub(ch, SERVICE)

async def call(stub):
    """(error code or 0, seconds)"""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await stub.Echo(interop_pb2.EchoRequest(message="m"))
        code = 0
    except aiobrpc.RpcError as e:
        code = e.code
    return code, loop.time() - t0

async def server():
    srv = aiobrpc.Server(aiobrpc.ServerOptions())
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:%(server_port)d")
    return srv

async def stop(srv):
    await srv.stop()
    await srv.join(timeout=2)

async def established_then(rules, **opts):
    """One call on a fresh connection, then `rules`, then one more call on the same one."""
    srv = await server()
    opts.setdefault("max_retry", 0)
    ch, stub = channel(%(server_port)d, **opts)
    first = await call(stub)
    nft(rules)
    after = await call(stub)
    out = {"first": first, "after": after, "connections": ch.stats.connections_made}
    await ch.close()
    await stop(srv)
    return out

async def _run():
    loop = asyncio.get_running_loop()
    loop_errors = []
    loop.set_exception_handler(lambda lp, ctx: loop_errors.append(repr(ctx.get("exception", ctx["message"]))))
    result = await main()
    await asyncio.sleep(0)
    result["loop_errors"] = loop_errors
    return result
'''

EPILOGUE = r'''
if _fast.IMPLEMENTATION == "cython":  # this process's build (AIOBRPC_NO_EXTENSIONS is inherited)
    import uvloop
    result = uvloop.run(_run())
else:
    result = asyncio.run(_run())
print(json.dumps(result))
'''


def drop_rule(port: int, verdict: str = "drop") -> str:
    return ("table inet fault {\n chain out {\n  type filter hook output priority 0; policy accept;\n"
            f"  tcp dport {port} {verdict}\n }}\n}}\n")


@pytest.fixture
def netns(twin):
    reason = netns_available()
    if reason is not None:
        if os.environ.get("AIOBRPC_REQUIRE_TOOLS") == "1":
            pytest.fail(f"network namespace faults are unavailable: {reason}")
        pytest.skip(f"network namespace faults need root, unshare, ip and nft: {reason}")

    def run(body: str, nft_rules: str | None = None, timeout: float = 60.0) -> dict:
        script = PRELUDE % {"server_port": SERVER_PORT} + body + EPILOGUE
        result = run_in_netns(script, nft_rules, timeout)
        assert result.pop("loop_errors") == []
        return result
    return run


def test_e6_syn_dropped_fails_at_connect_timeout(netns):
    r = netns(f'''
async def main():
    out = {{}}
    for max_retry in (0, 3):
        ch, stub = channel({DEAD_PORT}, timeout_ms=2000, connect_timeout_ms=100, max_retry=max_retry)
        out[f"retry{{max_retry}}"] = await call(stub)
        await ch.close()
    # the call's deadline comes before connect_timeout_ms
    ch, stub = channel({DEAD_PORT}, timeout_ms=100, connect_timeout_ms=1000, max_retry=0)
    out["deadline_first"] = await call(stub)
    await ch.close()
    return out
''', drop_rule(DEAD_PORT))
    # ETIMEDOUT: the connect's timer (100 ms) ended it, not the call's deadline (2 s: ERPCTIMEDOUT).
    code, elapsed = r["retry0"]
    assert code == errors.ETIMEDOUT and elapsed >= 0.09, r
    # The timed-out connect marks the only server failed, so the retries (ETIMEDOUT is
    # retryable) find it down and fail at once with EHOSTDOWN, as brpc's do (brpc's docs/en/client.md):
    # a retry that connected again would end with ETIMEDOUT.
    code, elapsed = r["retry3"]
    assert code == errors.EHOSTDOWN and elapsed >= 0.09, r
    # ERPCTIMEDOUT: the deadline (100 ms) ended it, not the connect's timer (1 s: ETIMEDOUT).
    code, elapsed = r["deadline_first"]
    assert code == errors.ERPCTIMEDOUT and elapsed >= 0.09, r


def test_e6_established_connection_then_dropped_times_out_at_the_deadline(netns):
    r = netns(f"""
async def main():
    return await established_then({drop_rule(SERVER_PORT)!r}, timeout_ms=200, max_retry=3)
""")
    assert r["first"][0] == 0, r
    code, elapsed = r["after"]
    assert code == errors.ERPCTIMEDOUT and elapsed >= 0.19, r  # at the deadline, not before
    assert r["connections"] == 1, r  # never retried on a new connection


def test_e7_rst_on_syn_is_refused_at_once(netns):
    r = netns(f'''
async def main():
    out = {{}}
    for max_retry in (0, 3):
        ch, stub = channel({DEAD_PORT}, timeout_ms=2000, max_retry=max_retry)
        out[f"retry{{max_retry}}"] = await call(stub)
        await ch.close()
    return out
''', drop_rule(DEAD_PORT, "reject with tcp reset"))
    # At once: refused (the deadline, 2 s, would say ERPCTIMEDOUT).
    code, elapsed = r["retry0"]
    assert code == errors.ECONNREFUSED, r
    code, elapsed = r["retry3"]  # refused, then the retries find the server marked down
    assert code == errors.EHOSTDOWN, r


def test_e7_rst_on_an_established_connection_fails_the_call_at_once(netns):
    r = netns(f"""
async def main():
    return await established_then({drop_rule(SERVER_PORT, "reject with tcp reset")!r}, timeout_ms=2000)
""")
    assert r["first"][0] == 0, r
    code, elapsed = r["after"]
    assert code == errors.EFAILEDSOCKET, r  # at once: the reset, not the deadline (2 s: ERPCTIMEDOUT)


# E8: 20 connections each make 10 sequential calls at once, 200 calls in all. Strictly one after
# another the 200 calls take 20-30 s at 20 % loss (measured), as each lost segment waits for the
# 200 ms minimum RTO. The connections are made before the loss starts.
LOSS_RULES = ("table inet loss {\n chain out {\n  type filter hook output priority 0; policy accept;\n"
              "  meta l4proto tcp numgen random mod 100 < 20 drop\n }\n}\n")
LANES, CALLS_PER_LANE, TIMEOUT_MS = 20, 10, 3000


def test_e8_random_loss_every_call_completes_or_times_out(netns):
    r = netns(f'''
async def lane(stub, latencies, codes):
    for _ in range({CALLS_PER_LANE}):
        code, elapsed = await call(stub)
        latencies.append(elapsed)
        codes[str(code)] = codes.get(str(code), 0) + 1

async def main():
    srv = await server()
    chans = [channel({SERVER_PORT}, timeout_ms={TIMEOUT_MS}, max_retry=0) for _ in range({LANES})]
    warm = [await call(stub) for _, stub in chans]
    nft({LOSS_RULES!r})
    loop = asyncio.get_running_loop()
    latencies, codes = [], {{}}
    t0 = loop.time()
    await asyncio.gather(*(lane(stub, latencies, codes) for _, stub in chans))
    total = loop.time() - t0
    nft("flush ruleset")
    for ch, _ in chans:
        await ch.close()
    await stop(srv)
    latencies.sort()
    n = len(latencies)
    return {{"warm": warm, "codes": codes, "total": total, "n": n,
            "p50": latencies[n // 2], "p99": latencies[int(n * 0.99) - 1], "max": latencies[-1]}}
''', timeout=120)
    print(f"E8 at 20 % loss: p50 {r['p50'] * 1000:.2f} ms, p99 {r['p99'] * 1000:.0f} ms, "
          f"max {r['max'] * 1000:.0f} ms, {r['codes']}, {r['total']:.1f} s")
    assert all(code == 0 for code, _ in r["warm"]), r
    # nothing lost: every call ended, with success or a timeout at its deadline
    assert r["n"] == LANES * CALLS_PER_LANE, r
    assert set(r["codes"]) <= {"0", str(errors.ERPCTIMEDOUT)}, r
    assert sum(r["codes"].values()) == LANES * CALLS_PER_LANE, r
    assert r["codes"].get("0", 0) >= LANES * CALLS_PER_LANE // 2, r
    # no hang: no call outlives its deadline (by twice it: a loaded machine's loop is late, not hung)
    assert r["max"] < 2 * TIMEOUT_MS / 1000, r


def test_e13_a_client_gone_without_fin_or_rst_is_found_by_keepalive(netns):
    """After a served call, every packet from the server to the client is dropped (the client's
    host is gone, and no RST comes back): with keepalive probes unanswered the server's kernel
    drops the connection, and the server ends it with its streams and calls (no idle timeout)."""
    r = netns(f"""
async def main():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(socket_keepalive_idle_s=1, socket_keepalive_interval_s=1,
                                               socket_keepalive_count=2))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:{SERVER_PORT}")
    ch, stub = channel({SERVER_PORT}, max_retry=0, timeout_ms=2000)
    first = await call(stub)
    before = len(srv.connections)
    nft({drop_rule_from(SERVER_PORT)!r})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while srv.connections and loop.time() - t0 < 20:
        await asyncio.sleep(0.1)
    out = {{"first": first, "before": before, "after": len(srv.connections), "seconds": loop.time() - t0}}
    await ch.close()
    await stop(srv)
    return out
""")
    assert r["first"][0] == 0 and r["before"] == 1, r
    assert r["after"] == 0, r  # found: 1 s idle + 2 probes 1 s apart, and the kernel's retransmits


def drop_rule_from(port: int) -> str:
    """Every packet the server on `port` sends (its replies and its keepalive probes) is dropped."""
    return ("table inet fault {\n chain out {\n  type filter hook output priority 0; policy accept;\n"
            f"  tcp sport {port} drop\n }}\n}}\n")
