"""SelectiveChannel (brpc's docs/en/combo_channel.md): balancing over sub-channels, retries
onto another sub-channel, a failed sub-channel left out and revived, the backup request, the
deadline, cancellation, and the errors a bad argument raises."""

from __future__ import annotations

import asyncio
import time

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc.client.combo import SelectiveChannel, sub_controller, sub_count
from aiobrpc.client.lb import LoadBalancer
from aiobrpc.errors import RpcError
from tests.client.test_combo_parallel import HANG_S, held, until
from tests.client.test_combo_parallel import Shard, channel_to, dead_port, echo, shards  # noqa: F401  (fixture)


class InOrder(LoadBalancer):
    """Takes the first available, not excluded server in the order added (the excluded ones
    last): a deterministic balancer for the tests."""

    name = "in_order"

    def __init__(self) -> None:
        super().__init__()
        self.feedback_seen: list[tuple[str, int]] = []

    def select(self, *, excluded=(), available=lambda s: True, request_code=None):
        if not self._servers:
            raise RpcError(errors.ENODATA, "empty")
        for server in sorted(self._servers, key=lambda s: s in excluded):
            if available(server):
                return server
        raise RpcError(errors.EHOSTDOWN, "none available")

    def feedback(self, server, error_code, latency_us):
        self.feedback_seen.append((server.host, error_code))


def schan_over(servers, lb="rr", *, check_s: float = 1.0, **options) -> SelectiveChannel:
    schan = SelectiveChannel(lb, aiobrpc.ChannelOptions(**options), channel_check_interval_s=check_s)
    for server in servers:
        schan.add_channel(server if isinstance(server, aiobrpc.Channel) else channel_to(server, max_retry=0))
    return schan


async def test_calls_are_balanced_over_sub_channels_round_robin(shards):
    async with schan_over([s for s, _ in shards]) as schan:
        for _ in range(30):
            cntl = aiobrpc.Controller()
            resp = await echo(schan, cntl, message="b")
            assert resp.message == "b" and cntl.retried_count == 0
            sub = sub_controller(cntl, 0)
            assert sub_count(cntl) == 1 and not sub.failed and cntl.remote_side == sub.remote_side
    assert [len(s.messages) for _, s in shards] == [10, 10, 10]


async def test_a_failed_sub_call_is_retried_on_another_sub_channel_which_is_then_left_out(shards):
    dead = aiobrpc.Channel(f"127.0.0.1:{dead_port()}", aiobrpc.ChannelOptions(max_retry=0))
    lb = InOrder()
    async with schan_over([dead, shards[0][0]], lb) as schan:
        cntl = aiobrpc.Controller()
        assert (await echo(schan, cntl, message="r")).message == "r"
        assert cntl.retried_count == 1 and cntl.remote_side == f"127.0.0.1:{shards[0][0].port}"
        # ECONNREFUSED: retried, not yet a sign that the sub-channel has no server.
        assert lb.feedback_seen[0] == ("sub-channel-1", errors.ECONNREFUSED)
        cntl = aiobrpc.Controller()
        await echo(schan, cntl)  # the dead server is marked down: EHOSTDOWN marks the sub-channel failed
        assert cntl.retried_count == 1 and lb.feedback_seen[2] == ("sub-channel-1", errors.EHOSTDOWN)
        for _ in range(3):
            cntl = aiobrpc.Controller()
            await echo(schan, cntl)
            assert cntl.retried_count == 0  # left out: no attempt on it
    assert len(shards[0][1].messages) == 5


async def test_a_failed_sub_channel_is_revived_by_its_health_check(shards):
    port = dead_port()
    later = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(max_retry=0, health_check_interval_s=0.05))
    async with schan_over([later, shards[0][0]], InOrder(), check_s=0.05) as schan:
        await echo(schan)  # refused, retried on the other
        await echo(schan)  # EHOSTDOWN: the sub-channel is marked failed
        cntl = aiobrpc.Controller()
        await echo(schan, cntl)
        assert cntl.retried_count == 0  # left out
        assert schan.check_health()  # the other sub-channel serves
        server = aiobrpc.Server()
        server.add_service(Shard())
        await server.start(f"127.0.0.1:{port}")
        try:
            for _ in range(60):  # the Channel's health check revives the server, then ours the sub-channel
                cntl = aiobrpc.Controller()
                await echo(schan, cntl)
                if cntl.remote_side == f"127.0.0.1:{port}":
                    break
                await asyncio.sleep(0.05)
            assert cntl.remote_side == f"127.0.0.1:{port}" and cntl.retried_count == 0
        finally:
            await later.close()
            await server.stop()
            await server.join(timeout=2)


async def test_retries_stop_at_max_retry_with_brpc_retry_marks(shards):
    async with schan_over([s for s, _ in shards], max_retry=2) as schan:
        cntl = aiobrpc.Controller()
        with pytest.raises(RpcError) as info:
            await echo(schan, cntl, fail_code=errors.ELIMIT, fail_text="busy")  # retryable
        assert info.value.code == errors.ELIMIT and cntl.retried_count == 2
        text = info.value.text
        assert text.startswith(f"[E{errors.ELIMIT}]") and " [R1][E2004]" in text and " [R2][E2004]" in text
        assert sorted(len(s.messages) for _, s in shards) == [1, 1, 1]  # each sub-channel tried once
        with pytest.raises(RpcError) as info:
            await echo(schan, fail_code=errors.EINTERNAL, fail_text="bug")  # not retried
        assert info.value.code == errors.EINTERNAL and "[R1]" not in info.value.text
    assert sum(len(s.messages) for _, s in shards) == 4


async def test_the_deadline_covers_every_sub_call(shards):
    async with schan_over([s for s, _ in shards], timeout_ms=100) as schan:
        cntl = aiobrpc.Controller()
        t = time.monotonic()
        with held(shards, 0, 1, 2), pytest.raises(RpcError) as info:  # no answer: only the deadline ends it
            await asyncio.wait_for(echo(schan, cntl), HANG_S)
        elapsed = time.monotonic() - t
        assert (info.value.code, info.value.text) == (errors.ERPCTIMEDOUT, "Reached timeout=100ms @SelectiveChannel")
        assert elapsed >= 0.09  # not before the deadline
        assert sub_controller(cntl, 0).timeout_ms == -1  # no deadline of its own
        cntl = aiobrpc.Controller(timeout_ms=10_000)  # the controller's wins: the answer after 300 ms is in time
        assert (await echo(schan, cntl, sleep_ms=300)).message == "m"


async def test_the_backup_request_goes_to_another_sub_channel_and_the_first_answer_wins(shards):
    lb = InOrder()
    async with schan_over([s for s, _ in shards[:2]], lb, backup_request_ms=50) as schan:
        with held(shards, 0):  # the first sub-channel never answers: only the backup request can
            cntl = aiobrpc.Controller()
            assert (await asyncio.wait_for(echo(schan, cntl, message="k"), HANG_S)).message == "k"
            assert cntl.has_backup_request and cntl.retried_count == 1
            assert cntl.remote_side == f"127.0.0.1:{shards[1][0].port}"
            assert shards[0][1].messages == ["k"] and shards[1][1].messages == ["k"]
            no_retry = aiobrpc.Controller(max_retry=0)
            with pytest.raises(RpcError) as info:
                await asyncio.wait_for(echo(schan, no_retry), HANG_S)
            assert info.value.code == errors.EBACKUPREQUEST  # brpc: the backup timer with no retry left
    # The balancer hears every attempt's end once: the winner, the loser of the race, the last one.
    assert lb.feedback_seen == [("sub-channel-2", 0), ("sub-channel-1", errors.EBACKUPREQUEST),
                                ("sub-channel-1", errors.EBACKUPREQUEST)]


async def test_cancelling_the_caller_cancels_the_sub_call(shards):
    async with schan_over([s for s, _ in shards]) as schan:
        cntl = aiobrpc.Controller()
        with held(shards, 0, 1, 2):  # no answer while held: the sub-call is in flight when cancelled
            task = asyncio.ensure_future(echo(schan, cntl))
            await until(lambda: any(s.messages for _, s in shards))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, HANG_S)
            await asyncio.sleep(0)
    assert cntl.error_code == errors.ECANCELED and sub_controller(cntl, 0).error_code == errors.ECANCELED


async def test_attachment_log_id_and_user_fields_reach_the_sub_call_and_the_reply_comes_back(shards):
    async with schan_over([shards[0][0]]) as schan:
        cntl = aiobrpc.Controller(log_id=9, request_attachment=b"xyz")
        cntl.request_user_fields["k"] = "v"
        resp = await echo(schan, cntl, echo_attachment=True)
    assert resp.log_id == 9 and resp.request_attachment_size == 3 and list(resp.user_fields) == ["k=v"]
    assert bytes(cntl.response_attachment) == b"xyz" and cntl.response_user_fields == {"k": "v"}


async def test_sub_channels_come_and_go(shards):
    schan = schan_over([])
    cntl = aiobrpc.Controller()
    with pytest.raises(RpcError) as info:
        await echo(schan, cntl)
    assert info.value.code == errors.ENODATA and "Fail to select channel" in info.value.text
    handles = [schan.add_channel(channel_to(s)) for s, _ in shards]
    assert schan.channel_count == 3
    removed = schan.remove_channel(handles[0])
    async with schan:
        for _ in range(4):
            await echo(schan)
    await removed.close()
    assert [len(s.messages) for _, s in shards] == [0, 2, 2]
    with pytest.raises(KeyError):
        schan.remove_channel(handles[0])


def test_bad_arguments_raise_saying_what_is_wrong():
    with pytest.raises(ValueError, match="unknown load balancer"):
        SelectiveChannel("no-such-lb")
    with pytest.raises(TypeError, match="load_balancer"):
        SelectiveChannel(42)
    with pytest.raises(TypeError, match="ChannelOptions"):
        SelectiveChannel("rr", {"timeout_ms": 1})
    with pytest.raises(ValueError, match="channel_check_interval_s"):
        SelectiveChannel("rr", channel_check_interval_s=0)
    schan = SelectiveChannel()
    ch = aiobrpc.Channel("127.0.0.1:1")
    schan.add_channel(ch)
    with pytest.raises(ValueError, match="added to this SelectiveChannel already"):
        schan.add_channel(ch)
    with pytest.raises(TypeError, match="call_method"):
        schan.add_channel("127.0.0.1:1")
    with pytest.raises(TypeError, match="tag"):
        schan.add_channel(aiobrpc.Channel("127.0.0.1:2"), tag=3)
    with pytest.raises(ValueError, match="cycle"):
        schan.add_channel(schan)
