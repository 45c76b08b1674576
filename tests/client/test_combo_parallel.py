"""ParallelChannel (brpc's docs/en/combo_channel.md): fan-out through a Stub to real servers,
mappers and mergers, fail_limit / success_limit, the one deadline over the sub-calls, a
sub-channel that is down, cancellation, and the errors a bad argument raises.

The scaffolding here (Shard, shards, Tagged, Concat, dead_port) is reused by the other
test_combo_*.py files."""

from __future__ import annotations

import asyncio
import contextlib
import doctest
import socket
import time

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client import combo
from aiobrpc.client.combo import (CallMapper, MergeResult, ParallelChannel, ParallelChannelOptions, ResponseMerger,
                                  SelectiveChannel, SubCall, sub_controller, sub_count)
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo

Req = interop_pb2.EchoRequest


class Shard(InteropEcho):
    """InteropEcho that records the messages it was sent, and may answer `delay_ms` late, or
    only once its `gate` (an asyncio.Event, None: no gate) is set."""

    def __init__(self, delay_ms: int = 0) -> None:
        super().__init__()
        self.delay_ms = delay_ms
        self.messages: list[str] = []
        self.gate: asyncio.Event | None = None

    async def Echo(self, request, cntl):
        self.messages.append(request.message)
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_ms:
            await asyncio.sleep(self.delay_ms / 1000)
        return await super().Echo(request, cntl)


@contextlib.contextmanager
def held(shards, *indices):
    """The shards at `indices` answer nothing until the block ends: a sub-call to one of them
    ends only when the channel ends it, however fast or slow the machine is."""
    gates = []
    for i in indices:
        shards[i][1].gate = asyncio.Event()
        gates.append(shards[i][1].gate)
    try:
        yield
    finally:
        for i, gate in zip(indices, gates):
            gate.set()
            shards[i][1].gate = None


# A guard against a hang only: a call that should end at once (or at its deadline) and waits
# for a held shard instead never ends.
HANG_S = 10.0


async def until(predicate, timeout: float = HANG_S) -> None:
    """Wait for `predicate()` to hold."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, f"not true within {timeout}s"
        await asyncio.sleep(0.005)


@pytest_asyncio.fixture
async def shards():
    """Three echo servers on 127.0.0.1, as (server, Shard) pairs."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_echo(servicer=Shard())) for _ in range(3)]


def dead_port() -> int:
    """A port of 127.0.0.1 nobody listens on: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def channel_to(server, **options) -> aiobrpc.Channel:
    return aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(**options))


class Tagged(CallMapper):
    """Sends sub-channel i the message "<message>-<i>", with the request fields of `extra[i]`."""

    def __init__(self, **extra: dict) -> None:
        self.extra = {int(k[1:]): v for k, v in extra.items()}  # c0=..., c1=...

    def map(self, channel_index, channel_count, method, request):
        sub = Req()
        sub.CopyFrom(request)
        sub.message = f"{request.message}-{channel_index}"
        for name, value in self.extra.get(channel_index, {}).items():
            setattr(sub, name, value)
        return SubCall(sub)


class Concat(ResponseMerger):
    """Joins the sub-responses' messages with "|", in the order merged."""

    def merge(self, response, sub_response):
        response.message = f"{response.message}|{sub_response.message}" if response.message else sub_response.message


def pchan_over(shards, mapper=None, merger=None, **options) -> ParallelChannel:
    pchan = ParallelChannel(ParallelChannelOptions(**options))
    for server, _ in shards:
        pchan.add_channel(channel_to(server), mapper, merger)
    return pchan


async def echo(channel, cntl=None, **fields):
    return await aiobrpc.Stub(channel, SERVICE).Echo(Req(message=fields.pop("message", "m"), **fields), cntl)


# -- fan-out and merging -------------------------------------------------------------------------
async def test_each_sub_channel_gets_its_request_and_responses_merge_in_channel_order(shards):
    # Channel 0 answers last: the merge order is still the sub-channels' order.
    async with pchan_over(shards, Tagged(c0={"sleep_ms": 60}), Concat()) as pchan:
        cntl = aiobrpc.Controller()
        resp = await echo(pchan, cntl, message="k")
    assert resp.message == "k-0|k-1|k-2"
    assert [s.messages for _, s in shards] == [["k-0"], ["k-1"], ["k-2"]]
    assert sub_count(cntl) == 3 and not cntl.failed
    for i, (server, _) in enumerate(shards):
        sub = sub_controller(cntl, i)
        assert not sub.failed and sub.remote_side == f"127.0.0.1:{server.port}"
    assert sub_controller(cntl, 3) is None and sub_controller(cntl, -1) is None
    assert cntl.sub_count() == 3 and all(cntl.sub(i) is sub_controller(cntl, i) for i in range(3))
    assert cntl.sub(3) is None and cntl.sub(-1) is None
    assert cntl.latency_us >= 60_000  # the call waited for channel 0's late answer


async def test_without_mapper_and_merger_the_request_is_broadcast_and_merged_with_merge_from(shards):
    async with pchan_over(shards) as pchan:
        cntl = aiobrpc.Controller(log_id=7, request_attachment=b"abc")
        cntl.request_user_fields["tenant"] = "a"
        resp = await echo(pchan, cntl, message="same")
    assert [s.messages for _, s in shards] == [["same"]] * 3
    # MergeFrom: repeated fields appended, scalars overwritten; the settings reached every server.
    assert list(resp.user_fields) == ["tenant=a"] * 3
    assert resp.message == "same" and resp.log_id == 7 and resp.request_attachment_size == 3
    assert all(sub_controller(cntl, i).log_id == 7 for i in range(3))


async def test_a_mapper_may_skip_sub_channels_and_send_another_method(shards):
    class SkipMiddle(CallMapper):
        def map(self, channel_index, channel_count, method, request):
            assert (method.service_name, method.method_name, channel_count) == (SERVICE.full_name, "Echo", 3)
            if channel_index == 1:
                return SubCall.skip()
            return SubCall(request, method_name="StartStream")  # same messages, another method

    async with pchan_over(shards, SkipMiddle(), Concat()) as pchan:
        cntl = aiobrpc.Controller()
        resp = await echo(pchan, cntl, message="s")
    assert resp.message == "s|s"
    assert [len(s.messages) for _, s in shards] == [1, 0, 1]
    assert sub_count(cntl) == 3 and sub_controller(cntl, 1) is None
    assert sub_controller(cntl, 0).method_name == "StartStream"


async def test_merger_fail_counts_as_a_failure_and_fail_all_fails_the_call(shards):
    class Refuse(ResponseMerger):
        def __init__(self, result):
            self.result = result

        def merge(self, response, sub_response):
            if sub_response.message.endswith("-1"):
                return self.result
            Concat().merge(response, sub_response)
            return MergeResult.MERGED

    async with pchan_over(shards, Tagged(), Refuse(MergeResult.FAIL)) as pchan:
        cntl = aiobrpc.Controller()
        assert (await echo(pchan, cntl, message="f")).message == "f-0|f-2"  # 1 failure < fail_limit 3
        assert sub_controller(cntl, 1).error_code == errors.ERESPONSE
    async with pchan_over(shards, Tagged(), Refuse(MergeResult.FAIL), fail_limit=1) as pchan:
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan, message="f")
        assert info.value.code == errors.ERESPONSE
        assert info.value.text.startswith("1/3 channels failed, fail_limit=1 [C1]response_merger refused")
    async with pchan_over(shards, Tagged(), Refuse(ResponseMerger.FAIL_ALL)) as pchan:
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan, message="f")
        assert (info.value.code, info.value.text) == (errors.ERESPONSE, "Fail to merge response of channel[1]")
    async with pchan_over(shards, Tagged(), Refuse("merged")) as pchan:
        with pytest.raises(aiobrpc.RpcError, match=r"returned 'merged', not a MergeResult"):
            await echo(pchan, message="f")


async def test_a_merger_that_raises_fails_the_call_with_eresponse(shards, caplog):
    class Broken(ResponseMerger):
        def merge(self, response, sub_response):
            raise KeyError("no")

    async with pchan_over(shards, None, Broken()) as pchan:
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan, cntl)
    assert info.value.code == errors.ERESPONSE and "response_merger of channel[0] raised KeyError" in info.value.text
    assert cntl.error_code == errors.ERESPONSE and "raised KeyError" in caplog.text


# -- failures and fail_limit -----------------------------------------------------------------------
async def test_partial_failures_below_fail_limit_succeed(shards):
    mapper = Tagged(c1={"fail_code": errors.EINTERNAL, "fail_text": "boom"})
    async with pchan_over(shards, mapper, Concat()) as pchan:
        cntl = aiobrpc.Controller()
        resp = await echo(pchan, cntl, message="p")
    assert resp.message == "p-0|p-2" and not cntl.failed
    failed = sub_controller(cntl, 1)
    assert failed.error_code == errors.EINTERNAL and failed.error_text.endswith("boom")


async def test_reaching_fail_limit_fails_at_once_and_cancels_the_others(shards):
    mapper = Tagged(c1={"fail_code": errors.EINTERNAL, "fail_text": "boom"})
    async with pchan_over(shards, mapper, Concat(), fail_limit=1) as pchan:
        cntl = aiobrpc.Controller()
        # Channels 0 and 2 never answer while held: the call ends only if the failure ends it.
        with held(shards, 0, 2), pytest.raises(aiobrpc.RpcError) as info:
            await asyncio.wait_for(echo(pchan, cntl), HANG_S)
    # The cancelled sub-calls count as failures; ECANCELED does not make the code.
    assert info.value.code == errors.EINTERNAL
    text = info.value.text
    assert text.startswith("3/3 channels failed, fail_limit=1 [C0]Cancelled: fail_limit=1 reached [C1]")
    assert "boom [C2]Cancelled: fail_limit=1 reached" in text
    assert (cntl.error_code, cntl.error_text) == (info.value.code, text)
    assert [sub_controller(cntl, i).error_code for i in range(3)] == [errors.ECANCELED, errors.EINTERNAL,
                                                                       errors.ECANCELED]


async def test_sub_calls_failing_differently_fail_with_etoomanyfails(shards):
    mapper = Tagged(c0={"fail_code": errors.EINTERNAL}, c1={"fail_code": errors.ENOMETHOD})
    async with pchan_over(shards, mapper, Concat(), fail_limit=2) as pchan:
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan)
    assert info.value.code == errors.ETOOMANYFAILS
    assert info.value.text.startswith("2/3 channels failed, fail_limit=2 [C0]")
    both_alike = Tagged(c0={"fail_code": errors.EINTERNAL}, c1={"fail_code": errors.EINTERNAL})
    async with pchan_over(shards, both_alike, Concat(), fail_limit=2) as pchan:
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan)
    assert info.value.code == errors.EINTERNAL


async def test_a_fail_limit_above_the_sub_calls_made_is_clamped(shards):
    class OnlyFirst(Tagged):
        def map(self, channel_index, channel_count, method, request):
            return super().map(channel_index, channel_count, method, request) if channel_index == 0 else SubCall.skip()

    mapper = OnlyFirst(c0={"fail_code": errors.EINTERNAL})
    async with pchan_over(shards, mapper, Concat(), fail_limit=5) as pchan:
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan)
    assert info.value.text.startswith("1/1 channels failed, fail_limit=1 [C0]")


async def test_success_limit_ends_the_call_early_and_finishes_the_rest(shards):
    async with pchan_over(shards, Tagged(), Concat(), success_limit=1) as pchan:
        cntl = aiobrpc.Controller()
        with held(shards, 0, 2):  # they never answer while held: the one success ends the call
            resp = await asyncio.wait_for(echo(pchan, cntl, message="s"), HANG_S)
    assert resp.message == "s-1" and not cntl.failed
    for i in (0, 2):
        sub = sub_controller(cntl, i)
        assert sub.error_code == errors.EPCHANFINISH and "success_limit=1 reached" in sub.error_text


async def test_success_limit_is_ignored_when_fail_limit_is_set(shards):
    async with pchan_over(shards, Tagged(c2={"sleep_ms": 50}), Concat(), fail_limit=3, success_limit=1) as pchan:
        assert (await echo(pchan, message="x")).message == "x-0|x-1|x-2"


# -- deadlines -------------------------------------------------------------------------------------
async def test_the_deadline_cancels_sub_calls_and_the_call_succeeds_below_fail_limit(shards):
    async with pchan_over(shards, Tagged(), Concat(), timeout_ms=100) as pchan:
        cntl = aiobrpc.Controller()
        t = time.monotonic()
        with held(shards, 2):  # channel 2 never answers: only the deadline ends its sub-call
            resp = await asyncio.wait_for(echo(pchan, cntl, message="d"), HANG_S)
        elapsed = time.monotonic() - t
    assert resp.message == "d-0|d-1" and not cntl.failed  # brpc: 1 failure < fail_limit 3
    assert elapsed >= 0.09  # not before the deadline
    late = sub_controller(cntl, 2)
    assert late.error_code == errors.ECANCELED and "deadline of the ParallelChannel" in late.error_text
    assert late.timeout_ms == -1  # sub-calls have no deadline of their own


async def test_the_deadline_fails_the_call_with_erpctimedout_at_fail_limit(shards):
    async with pchan_over(shards, Tagged(), Concat(), fail_limit=1) as pchan:
        cntl = aiobrpc.Controller(timeout_ms=100)  # the controller's timeout wins over the options'
        t = time.monotonic()
        with held(shards, 2), pytest.raises(aiobrpc.RpcError) as info:  # only the deadline ends it
            await asyncio.wait_for(echo(pchan, cntl), HANG_S)
        elapsed = time.monotonic() - t
    assert info.value.code == errors.ERPCTIMEDOUT and elapsed >= 0.09
    assert info.value.text == "Reached timeout=100ms @ParallelChannel"


# -- sub-channels down, retries --------------------------------------------------------------------
async def test_a_sub_channel_that_is_down_fails_its_part_only(shards):
    pchan = pchan_over(shards[:2], Tagged(), Concat())
    pchan.add_channel(aiobrpc.Channel(f"127.0.0.1:{dead_port()}"), Tagged(), Concat())
    async with pchan:
        cntl = aiobrpc.Controller()
        assert (await echo(pchan, cntl, message="u")).message == "u-0|u-1"
        down = sub_controller(cntl, 2)
        assert down.error_code in (errors.ECONNREFUSED, errors.EHOSTDOWN)
        assert down.retried_count == 3  # the sub-channel's own max_retry (default 3)
        pchan.options.fail_limit = 1
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan, message="u")
        assert info.value.code in (errors.ECONNREFUSED, errors.EHOSTDOWN) and "[C2]" in info.value.text


async def test_each_sub_channel_retries_as_its_options_say_unless_the_call_sets_max_retry(shards):
    pchan = ParallelChannel()
    for (server, _), max_retry in zip(shards, (0, 1, 2)):
        pchan.add_channel(channel_to(server, max_retry=max_retry))
    async with pchan:
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as info:
            await echo(pchan, cntl, fail_code=errors.ELIMIT)  # retryable
        assert info.value.code == errors.ELIMIT
        assert [sub_controller(cntl, i).retried_count for i in range(3)] == [0, 1, 2]
        cntl = aiobrpc.Controller(max_retry=1)
        with pytest.raises(aiobrpc.RpcError):
            await echo(pchan, cntl, fail_code=errors.ELIMIT)
        assert [sub_controller(cntl, i).retried_count for i in range(3)] == [1, 1, 1]


# -- cancellation ----------------------------------------------------------------------------------
async def test_cancelling_the_caller_cancels_every_sub_call(shards):
    async with pchan_over(shards, Tagged(), Concat()) as pchan:
        cntl = aiobrpc.Controller()
        with held(shards, 0, 1):  # channels 0 and 1 never answer while held
            task = asyncio.ensure_future(echo(pchan, cntl))
            # Channels 0 and 1 have the request, channel 2's sub-call is over (latency_us is set at its end).
            await until(lambda: shards[0][1].messages and shards[1][1].messages
                        and sub_controller(cntl, 2) is not None and sub_controller(cntl, 2).latency_us > 0)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, HANG_S)  # ends without the held answers
    assert cntl.error_code == errors.ECANCELED
    assert [sub_controller(cntl, i).error_code for i in range(3)] == [errors.ECANCELED, errors.ECANCELED, 0]


# -- nesting ---------------------------------------------------------------------------------------
async def test_combo_channels_nest(shards):
    inner = SelectiveChannel("rr", aiobrpc.ChannelOptions(timeout_ms=-1))
    inner.add_channel(channel_to(shards[1][0]))
    inner.add_channel(channel_to(shards[2][0]))
    middle = ParallelChannel()
    middle.add_channel(channel_to(shards[0][0]), Tagged(), Concat())
    middle.add_channel(inner, Tagged(), Concat())
    outer = ParallelChannel(ParallelChannelOptions(timeout_ms=300))
    outer.add_channel(middle, Tagged(), Concat())
    async with outer:
        cntl = aiobrpc.Controller()
        assert (await echo(outer, cntl, message="n")).message == "n-0-0|n-0-1"
        via_inner = sub_controller(sub_controller(cntl, 0), 1)
        assert sub_count(via_inner) == 1 and not sub_controller(via_inner, 0).failed
    assert sum(len(s.messages) for _, s in shards[1:]) == 1


# -- bad arguments and calls that cannot start -----------------------------------------------------
def test_bad_arguments_raise_saying_what_is_wrong():
    with pytest.raises(ValueError, match="fail_limit"):
        ParallelChannelOptions(fail_limit=0)
    with pytest.raises(ValueError, match="success_limit"):
        ParallelChannelOptions(success_limit=-1)
    with pytest.raises(ValueError, match="timeout_ms"):
        ParallelChannelOptions(timeout_ms=-2)
    with pytest.raises(TypeError, match="ParallelChannelOptions"):
        ParallelChannel(aiobrpc.ChannelOptions())
    pchan = ParallelChannel()
    with pytest.raises(TypeError, match="call_method"):
        pchan.add_channel(object())
    with pytest.raises(TypeError, match="call_mapper"):
        pchan.add_channel(pchan_over([]), call_mapper=lambda *a: None)
    with pytest.raises(TypeError, match="response_merger"):
        pchan.add_channel(pchan_over([]), response_merger=object())
    with pytest.raises(ValueError, match="cycle"):
        pchan.add_channel(pchan)
    outer = ParallelChannel()
    outer.add_channel(pchan)
    with pytest.raises(ValueError, match="cycle"):
        pchan.add_channel(outer)
    with pytest.raises(TypeError, match="SubCall.skip"):
        SubCall(None)
    with pytest.raises(ValueError, match="method_name"):
        SubCall(Req(message="x"), method_name="")


def test_at_most_max_sub_channels():
    pchan = ParallelChannel()
    sub = ParallelChannel()
    for _ in range(combo.MAX_SUB_CHANNELS):
        pchan.add_channel(sub, own=False)
    with pytest.raises(ValueError, match=f"at most {combo.MAX_SUB_CHANNELS}"):
        pchan.add_channel(sub)


async def test_calls_that_cannot_start_fail_with_brpc_codes(shards, caplog):
    cntl = aiobrpc.Controller()
    with pytest.raises(aiobrpc.RpcError) as info:
        await echo(ParallelChannel(), cntl)
    assert (info.value.code, info.value.text) == (errors.EPERM, "No channels added")
    assert sub_count(cntl) == 0

    class Mapper(CallMapper):
        def __init__(self, answer):
            self.answer = answer

        def map(self, channel_index, channel_count, method, request):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    cases = [(SubCall.bad(), errors.EREQUEST, "CallMapper of channel[0] returns Bad()"),
             (SubCall.skip(), errors.ECANCELED, "Skipped all channels(3)"),
             (Req(message="not a SubCall"), errors.EREQUEST, "not a SubCall"),
             (ValueError("oops"), errors.EREQUEST, "call_mapper of channel[0] raised ValueError('oops')")]
    for answer, code, text in cases:
        async with pchan_over(shards, Mapper(answer)) as pchan:
            cntl = aiobrpc.Controller()
            with pytest.raises(aiobrpc.RpcError) as info:
                await echo(pchan, cntl)
        assert info.value.code == code and text in info.value.text
        assert sub_count(cntl) == 3 and sub_controller(cntl, 0) is None  # no sub-call started
    assert all(not s.messages for _, s in shards)


async def test_health_needs_all_sub_channels_or_all_but_fail_limit_minus_one(shards):
    pchan = pchan_over(shards[:2])
    pchan.add_channel(aiobrpc.Channel(f"127.0.0.1:{dead_port()}"))
    async with pchan:
        assert pchan.check_health()  # nothing known to be down yet
        await echo(pchan)  # marks the dead server down
        assert not pchan.check_health()
        pchan.options.fail_limit = 2
        assert pchan.check_health()
    assert not ParallelChannel().check_health()


def test_module_examples():
    from aiobrpc.client.combo import controllers, dynpart, feed, mapping, parallel, partition, selective
    for module in (controllers, dynpart, feed, mapping, parallel, partition, selective):
        assert doctest.testmod(module).failed == 0, module.__name__
