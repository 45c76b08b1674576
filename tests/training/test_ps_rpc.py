"""aiobrpc.training.ps over the network, servers and workers in this process: training converges in
every mode, keys live on their shard, bad input fails with EREQUEST naming it, a pull that
waits for a missing worker ends within its deadline naming it, a restart is reported and the
worker resumes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiobrpc
from aiobrpc import tensor
from aiobrpc._proto import ps_pb2
from aiobrpc.training.ps import SGD, Adam, ParameterServer, PsWorker, ServerRestarted, Sum, shard_of
from aiobrpc.training.ps import server as ps_server
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
from tests.training.ps_helpers import INITIAL, TRUE_B, TRUE_W, regression_data, regression_step, running_ps

f32 = np.float32


async def train(addresses, rank: int, steps: int) -> list[float]:
    x, y = regression_data(rank)
    losses = []
    async with PsWorker(addresses, rank, timeout_s=5) as w:
        await w.init(INITIAL)
        for _ in range(steps):
            loss, grads = regression_step(await w.pull(), x, y)
            losses.append(loss)
            await w.push(grads)
    return losses


@pytest.mark.parametrize("mode, staleness, optimizer", [
    ("sync", 0, SGD(lr=0.1)), ("async", 0, SGD(lr=0.1)), ("bounded", 2, SGD(lr=0.1)), ("sync", 0, Adam(lr=0.1)),
], ids=["sync-sgd", "async-sgd", "bounded-sgd", "sync-adam"])
async def test_two_workers_converge_on_two_shards(mode, staleness, optimizer):
    async with running_ps(2, num_workers=2, mode=mode, staleness=staleness, optimizer=optimizer) as ps:
        addresses = [server.address for server, _ in ps]
        curves = await asyncio.gather(train(addresses, 0, 60), train(addresses, 1, 60))
        for curve in curves:
            assert curve[-1] < curve[0] / 100, curve[::10]
        async with PsWorker(addresses, 0) as w:
            final = await w.pull(["w", "b"])
        np.testing.assert_allclose(final["w"], TRUE_W, atol=0.05)
        assert abs(float(final["b"]) - TRUE_B) < 0.05


async def test_each_key_lives_on_its_shard():
    keys = {f"layer{i}.weight": np.full(3, i, f32) for i in range(12)}
    async with running_ps(3, num_workers=1) as ps:
        async with PsWorker([server.address for server, _ in ps], 0) as w:
            assert sorted(await w.init(keys)) == sorted(keys)
            pulled = await w.pull()
        for i, (_, servicer) in enumerate(ps):
            assert sorted(servicer.store.keys) == sorted(k for k in keys if shard_of(k, 3) == i)
        assert all(pulled[k].tolist() == v.tolist() for k, v in keys.items())


async def test_rows_are_pushed_and_pulled_by_id():
    async with running_ps(2, num_workers=1, mode="sync", optimizer=Sum()) as ps:
        async with PsWorker([server.address for server, _ in ps], 0) as w:
            await w.init({"emb": np.zeros((10, 2), f32), "w": np.zeros(2, f32)})
            await w.push({"emb": np.ones((3, 2), f32), "w": np.ones(2, f32)}, rows={"emb": [7, 1, 7]})
            got = await w.pull(["w"], rows={"emb": [7, 1, 0]})
            assert got["emb"][:, 0].tolist() == [2, 1, 0] and got["w"].tolist() == [1, 1]
            dest = np.empty(2, f32)
            assert (await w.pull(["w"], out={"w": dest}))["w"] is dest and dest.tolist() == [1, 1]


async def test_a_large_key_pulled_into_an_array_is_received_in_place(monkeypatch):
    """pull(out=...) of one whole key: the kernel writes the weights into the caller's array
    (Controller.response_attachment_into), and get_response_tensors copies nothing."""
    copies = []
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda *a, **k: (copies.append(a[0].nbytes), real_copyto(*a, **k)))
    value = np.arange(300_000, dtype=f32)
    async with running_ps(1, num_workers=1) as ps:
        async with PsWorker([ps[0][0].address], 0) as w:
            await w.init({"big": value})
            dest = np.zeros_like(value)
            got = await w.pull(["big"], out={"big": dest})
    assert got["big"] is dest and np.array_equal(dest, value)
    assert copies == []


class SlowSum(Sum):
    def apply(self, value, grad, state, rows=None):
        time.sleep(0.01)  # an update still running when the next call comes
        super().apply(value, grad, state, rows)


@pytest.mark.parametrize("where", ["thread", "after-reply", "after-reply-in-slices"])
@pytest.mark.parametrize("mode", ["sync", "async", "bounded"])
async def test_large_pushes_apply_later_once_each_and_before_any_later_pull(mode, where, monkeypatch):
    if where == "thread":  # every push of `big` is applied on the server's thread
        monkeypatch.setattr(ps_server, "BACKGROUND_BYTES", ps_server.AFTER_REPLY_BYTES)
    elif where == "after-reply-in-slices":  # taken 1 KiB at a time, the loop reading between slices
        monkeypatch.setattr(ps_server, "STEP_SLICE_BYTES", 1024)
    big = ps_server.AFTER_REPLY_BYTES // 4  # float32s: answered before their step is taken
    async with running_ps(1, num_workers=2, mode=mode, optimizer=SlowSum()) as ps:
        address = [ps[0][0].address]

        async def work(rank: int) -> None:
            async with PsWorker(address, rank, timeout_s=10) as w:
                await w.init({"big": np.zeros(big, f32), "small": np.zeros(2, f32)})
                for step in range(6):
                    got = await w.pull()
                    if mode != "async":  # every step before this one is in
                        done = step * (1.5 if mode == "sync" else 3)
                        assert got["big"][[0, -1]].tolist() == [done] * 2 and got["small"].tolist() == [done] * 2
                    grads = {"big": np.full(big, rank + 1, f32), "small": np.full(2, rank + 1, f32)}
                    await w.push({"big": grads["big"]})
                    w.step -= 1
                    await w.push({"small": grads["small"]})  # small, maybe behind a large one
                    w.step -= 1
                    await w.push(grads)  # a retry of the step: applied once

        await asyncio.gather(work(0), work(1))
        async with PsWorker(address, 0) as w:
            w.step = 6
            final = await w.pull(["big", "small"])
        assert (ps[0][1]._executor is not None) == (where == "thread")
    want = 9 if mode == "sync" else 18  # sync averages the two workers' pushes
    assert np.all(final["big"] == want) and final["small"].tolist() == [want] * 2


@pytest.mark.parametrize("optimizer, thread", [(SGD(), False), (Sum(), False), (Adam(), True)],
                         ids=["sgd", "sum", "adam"])
async def test_a_costly_rule_takes_its_step_on_the_thread_a_cheap_one_on_the_loop(optimizer, thread):
    n = (1 << 20) // 4  # 1 MiB of float32: past AFTER_REPLY_BYTES; Adam's step there is tens of ms
    async with running_ps(1, num_workers=1, optimizer=optimizer) as ps:
        async with PsWorker([ps[0][0].address], 0, timeout_s=10) as w:
            await w.init({"w": np.zeros(n, f32)})
            await w.push({"w": np.ones(n, f32)})
            got = (await w.pull())["w"]
        assert (ps[0][1]._executor is not None) == thread
    assert got[0] != 0 and np.all(got == got[0])  # the step was taken, on every element


class FailingSGD(SGD):
    def apply(self, value, grad, state, rows=None):
        if grad.nbytes >= 4096:  # a large push's step, or a slice of it
            raise MemoryError("no room for the step")
        super().apply(value, grad, state, rows)


@pytest.mark.parametrize("where", ["thread", "after-reply", "after-reply-in-slices"])
async def test_a_step_that_fails_after_its_reply_fails_every_later_pull(where, monkeypatch, caplog):
    if where == "thread":
        monkeypatch.setattr(ps_server, "BACKGROUND_BYTES", ps_server.AFTER_REPLY_BYTES)
    elif where == "after-reply-in-slices":
        monkeypatch.setattr(ps_server, "STEP_SLICE_BYTES", 4096)
    big = ps_server.AFTER_REPLY_BYTES // 4
    async with running_ps(1, num_workers=1, optimizer=FailingSGD()) as ps:
        async with PsWorker([ps[0][0].address], 0, timeout_s=10) as w:
            await w.init({"big": np.zeros(big, f32)})
            await w.push({"big": np.ones(big, f32)})  # answered: its step fails later
            for _ in range(2):
                with pytest.raises(aiobrpc.RpcError) as e:
                    await w.pull()
                assert e.value.code == aiobrpc.errors.EINTERNAL and "lost an update" in str(e.value)
    assert "a push's update failed; pulls fail from now on" in caplog.text


@pytest.mark.parametrize("call, code, message", [
    (lambda w: w.pull(["nope"]), "EREQUEST", "unknown key 'nope': this server holds 2 keys"),
    (lambda w: w.push({"w": np.zeros(3, f32)}), "EREQUEST",
     r"gradient of 'w' has shape \[3\], expected \[8\] \(key shape \[8\]\)"),
    (lambda w: w.push({"w": np.zeros(8, np.float64)}), "EREQUEST", "gradient of 'w' is float64 but the key is float32"),
    (lambda w: w.push({"w": np.zeros(8, np.int32)}), "EREQUEST", "gradient of 'w' is int32 but the key is float32"),
    (lambda w: w.pull(["b"], rows={"w": [8]}), "EREQUEST", r"row id 8 of 'w' is outside 0..7"),
    (lambda w: w.init({"w": np.zeros(4, f32)}), "EREQUEST", r"key 'w' exists as float32 \[8\]; init gave float32 \[4\]"),
])
async def test_bad_input_fails_with_erequest_naming_it(call, code, message):
    async with running_ps(1, num_workers=1) as ps:
        async with PsWorker([ps[0][0].address], 0) as w:
            await w.init(INITIAL)
            with pytest.raises(aiobrpc.RpcError, match=message) as e:
                await call(w)
            assert e.value.code == getattr(aiobrpc.errors, code)
            assert w.step == 0, "a failed push does not move the step"
            await w.push({"w": np.zeros(8, f32), "b": np.float32(0)})  # the connection serves on


async def test_worker_refuses_bad_arguments_before_sending():
    async with PsWorker(["127.0.0.1:1"], 0) as w:
        with pytest.raises(ValueError, match="row ids of 'e' must be integers of one dimension"):
            await w.pull([], rows={"e": [[1]]})
        with pytest.raises(ValueError, match="'e' is asked whole and by rows"):
            await w.pull(["e"], rows={"e": [1]})
        with pytest.raises(ValueError, match="'w' is asked twice"):
            await w.pull(["w", "e", "w"])
        with pytest.raises(TypeError, match="tensor 'w' must be a numpy array or a torch CPU tensor, got list"):
            await w.init({"w": [1.0, 2.0]})
    with pytest.raises(ValueError, match="servers must be a non-empty list"):
        PsWorker("127.0.0.1:1")


# (server's max_wait_s, the worker's timeout_s, how long the pull says it waited): the wait ends at
# the server's bound, or at 0.9 of the caller's deadline, so the caller still reads who it waited
# for (a margin of 0.3 s here: a busy machine's late timer must not let the caller's deadline win).
@pytest.mark.parametrize("max_wait_s,timeout_s,waited", [(0.3, 10, r"0\.3"), (30, 3, r"2\.\d+")],
                         ids=["max_wait_s", "caller's deadline"])
async def test_a_pull_waiting_for_a_missing_worker_ends_naming_it(max_wait_s, timeout_s, waited):
    async with running_ps(1, num_workers=3, mode="sync", max_wait_s=max_wait_s) as ps:
        address = ps[0][0].address
        async with PsWorker([address], 0, timeout_s=timeout_s) as w0, \
                PsWorker([address], 2, timeout_s=timeout_s) as w2:
            await w0.init(INITIAL)
            grads = {"w": np.zeros(8, f32), "b": np.float32(0)}
            await w0.push(grads)
            await w2.push(grads)
            t0 = time.monotonic()
            with pytest.raises(aiobrpc.RpcError, match=rf"pull at step 1 waited {waited} s for worker\(s\) \[1\] "
                                                       r"to push \(sync mode\)") as e:
                await w0.pull()
            assert e.value.code == aiobrpc.errors.ERPCTIMEDOUT
            assert time.monotonic() - t0 < timeout_s  # the server's answer, not the caller's deadline


async def test_a_stopping_server_ends_waiting_pulls():
    async with running_ps(1, num_workers=2, mode="sync") as ps:
        server, servicer = ps[0]
        async with PsWorker([server.address], 0, timeout_s=5, max_retry=0) as w:
            await w.init(INITIAL)
            await w.push({"w": np.zeros(8, f32), "b": np.float32(0)})
            pull = asyncio.ensure_future(w.pull())
            await asyncio.sleep(0.05)
            assert not pull.done()
            servicer.stop()
            with pytest.raises(aiobrpc.RpcError, match="the parameter server is stopping"):
                await pull


async def until_back(call, within_s: float = 3.0):
    """`call()`, again while the channel still counts the server down (its health check
    reconnects within a few hundred ms)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except aiobrpc.RpcError as e:
            if e.code not in (aiobrpc.errors.EHOSTDOWN, aiobrpc.errors.ECONNREFUSED) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_a_restart_is_reported_and_the_worker_resumes_from_its_last_pull():
    restarts: list[ServerRestarted] = []
    async with running_ps(1, num_workers=1, mode="sync", optimizer=SGD(lr=0.5)) as first:
        server, _ = first[0]
        port = server.port
        w = PsWorker([server.address], 0, timeout_s=2, on_restart=restarts.append)
        await w.init({"w": np.zeros(2, f32)})
        await w.push({"w": np.ones(2, f32)})
        before = (await w.pull())["w"].tolist()
        assert before == [-0.5, -0.5] and w.step == 1
    # The same address, a new process of the server: no keys, a new generation.
    try:
        second = aiobrpc.Server()
        ps2 = ParameterServer(1, mode="sync", optimizer=SGD(lr=0.5))
        second.add_service(ps2)
        await second.start(f"127.0.0.1:{port}")
        try:
            with pytest.raises(ServerRestarted, match=r"parameter server 0 \(127.0.0.1:\d+\) restarted") as e:
                await until_back(lambda: w.push({"w": np.ones(2, f32)}))
            assert restarts == [e.value] and e.value.new_generation == ps2.generation
            assert w.step == 1, "the push was not taken"
            assert await w.resume() == ["w"]
            assert (await w.pull())["w"].tolist() == before
            await w.push({"w": np.ones(2, f32)})
            assert (await w.pull())["w"].tolist() == [-1.0, -1.0] and w.step == 2
        finally:
            ps2.stop()
            await second.stop()
            await second.join(timeout=2)
    finally:
        await w.close()


async def test_a_push_naming_a_key_twice_is_refused_each_time():
    async with running_ps(1, num_workers=1) as ps:
        async with PsWorker([ps[0][0].address], 0, timeout_s=10) as w:
            await w.init({"w": np.zeros(2, f32)})
            for step in range(2):  # the second time through the layout kept for the meta
                meta, buffers = tensor.pack([np.ones(2, f32), np.ones(2, f32)])
                meta.tensors[0].name = meta.tensors[1].name = "w"
                cntl = aiobrpc.Controller(request_attachment=buffers)
                request = ps_pb2.PushRequest(worker=0, step=step, grads=meta)
                with pytest.raises(aiobrpc.RpcError) as e:
                    await w._stubs[0].Push(request, cntl)
                assert e.value.code == aiobrpc.errors.EREQUEST and "key 'w' is given twice" in str(e.value)
            assert (await w.pull())["w"].tolist() == [0, 0]  # nothing of it applied
