"""Harness: the parameter server's calls (aiobrpc/training/ps/server.py and store.py) from hostile
workers: Init, Push and Pull with fuzzed fields and tensors, some of them left running while
the next calls come.

Each input makes a fresh `ParameterServer` (byte 0: mode async, sync or bounded; rule Sum, SGD
or Adam; 1-3 workers; averaged or not; byte 1: staleness 0-3), with max_bytes 4 KiB,
max_pull_bytes 256 and max_wait_s 0.05 s, and thresholds lowered (a push of 64 bytes or more
is stepped after its reply, one of 512 bytes times its rule's cost on the update thread) so
that every path of a push is reached with small tensors. Then up to 16 calls, each from a recipe: Init, Push or
Pull; awaited at once or left running (awaited at the end); generation 0, the server's, or
another; worker and step near their bounds; 0-3 tensors named from a few keys (float32,
float64, int64 or float16, 0-3 dimensions of 0-4), row ids or not; the meta and attachment
as `tensor.pack` makes them, the attachment cut short, or the meta raw bytes.

Checked: every call ends (a pull waits at most max_wait_s) with its response or an RpcError
of EREQUEST, ERPCTIMEDOUT, ELOGOFF or EINTERNAL, nothing else raised and no traceback logged; a
pull's response tensors unpack from its attachment, one per key and row list asked, of the
key's dtype and shape (rows: the ids' count), the rows copied within max_pull_bytes; the
memory the store counts stays within max_bytes and is what its keys hold (sync rows included); in async mode with
Sum, each key holds exactly its first Init plus every push the store took (step past the
worker's last), rows added with repeats; once stopped, nothing is left running and the
update thread has ended.

    python -m fuzz.ps_server fuzz/corpus/ps_server -max_total_time=60
    python -m fuzz.ps_server --seeds fuzz/corpus/ps_server     # (re)write the seed corpus
"""

from __future__ import annotations

import asyncio

from fuzz import _harness as H

with H.instrumented():
    import numpy as np
    from google.protobuf.message import DecodeError

    import aiobrpc
    from aiobrpc import tensor
    from aiobrpc.errors import EINTERNAL, ELOGOFF, EREQUEST, ERPCTIMEDOUT, RpcError
    from aiobrpc._proto import ps_pb2
    from aiobrpc.training.ps import SGD, Adam, ParameterServer, Sum
    from aiobrpc.training.ps import server as server_mod
    from aiobrpc.training.ps import store as store_mod

# A pull waits on a real timer (max_wait_s) for a push left running: which one ends first may
# differ between runs on a busy machine; tests/fuzz/test_twins_differential.py leaves it out.
DIFFERENTIAL = False
# Small tensors reach every path of a push (inline, after the reply in slices, on the update
# thread):
# the server's thresholds, set for each input and put back after it (a test process imports
# this module too, and its own parameter servers must keep theirs).
THRESHOLDS = {"AFTER_REPLY_BYTES": 64, "BACKGROUND_BYTES": 512, "STEP_SLICE_BYTES": 24}
MAX_BYTES = 4096  # room for 7 keys of no elements, fewer of some
MAX_WAIT_S = 0.05
MAX_PULL_BYTES = 256
MAX_CALLS = 16
KEYS = ("w", "b", "e", "", "x" * 40)
DTYPES = (np.float32, np.float64, np.int64, np.float16)
MODES = ("async", "sync", "bounded")
ALLOWED = {EREQUEST, ERPCTIMEDOUT, ELOGOFF, EINTERNAL}


class _Model:
    """Async mode with Sum: what each key must hold (its first Init plus every push taken)."""

    def __init__(self, num_workers: int) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.last: dict[str, np.ndarray] = {}
        self.num_workers = num_workers

    def init(self, named: dict, step: int) -> None:
        for key, v in named.items():
            if key not in self.values:
                self.values[key] = np.array(v, copy=True)
                self.last[key] = np.full(self.num_workers, step - 1, np.int64)

    def push(self, worker: int, step: int, grads: dict, ids: dict) -> None:
        for key, g in grads.items():
            if step <= self.last[key][worker]:
                continue
            self.last[key][worker] = step
            if key in ids:
                np.add.at(self.values[key], ids[key], g)
            else:
                self.values[key] += g


def _tensors(p: H._Provider, count: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for _ in range(count):
        dtype = DTYPES[p.byte() % len(DTYPES)] if p.byte() % 4 == 0 else np.float32
        shape = tuple(p.int_in(0, 4) for _ in range(p.int_in(0, 3)))
        values = np.array([p.int_in(-8, 8) for _ in range(int(np.prod(shape)))], dtype).reshape(shape)
        out[p.pick(KEYS)] = values
    return out


def _row_ids(p: H._Provider, keys: list[str]) -> dict[str, np.ndarray]:
    if not keys or p.byte() % 3:
        return {}
    key = p.pick(keys)
    return {key: np.array([p.int_in(-1, 4) for _ in range(p.int_in(0, 4))],
                          np.int64 if p.byte() % 8 else np.int32)}


def _packed(p: H._Provider, named: dict[str, np.ndarray]) -> tuple[tensor.TensorMeta, bytes]:
    """(meta, attachment): as a worker packs them, the attachment cut short, or a raw meta."""
    how = p.byte() % 8
    if how == 7:
        try:
            return tensor.TensorMeta.FromString(p.blob(60)), p.blob(64)
        except DecodeError:
            return tensor.TensorMeta(), b""
    meta, views = tensor.pack(named) if named else (tensor.TensorMeta(), [])
    attachment = b"".join(bytes(v) for v in views)
    if how == 6 and attachment:
        attachment = attachment[:p.int_in(0, len(attachment) - 1)]
    return meta, attachment


def _after(a_bytes: bytes, b: tensor.TensorMeta, b_bytes: bytes) -> tuple:
    """b's meta and one attachment, b's tensors placed after a's bytes (as a push of gradients
    and row ids)."""
    for info in b.tensors:
        info.offset += len(a_bytes)
    return b, a_bytes + b_bytes


class _Call:
    def __init__(self, kind: str, request, attachment: bytes, named: dict, ids: dict) -> None:
        self.kind, self.request, self.named, self.ids = kind, request, named, ids
        self.cntl = aiobrpc.Controller(request_attachment=attachment)
        self.task: asyncio.Task | None = None


async def _call(ps: ParameterServer, call: _Call):
    try:
        return await getattr(ps, call.kind)(call.request, call.cntl)
    except RpcError as e:
        if e.code not in ALLOWED:
            raise H.Finding(f"{call.kind} raised RpcError {e.code} {e.text!r:.200}") from None
        return e
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        raise H.Finding(f"{call.kind} raised {e!r:.300}") from e


def _check_pull(ps: ParameterServer, call: _Call, resp) -> None:
    keys = list(call.request.keys)
    try:
        att = call.cntl.response_attachment  # the views set_response_tensors gives the server to write
        if isinstance(att, (list, tuple)):
            att = b"".join(bytes(v) for v in att)
        values = tensor.unpack(resp.values, att)
    except (ValueError, TypeError) as e:
        raise H.Finding(f"a pull's response does not unpack from its attachment: {e}") from None
    # the rows the server read (a raw meta or a cut attachment may name others than meant)
    ids = {}
    if call.request.row_ids.tensors:
        ids = tensor.unpack_named(call.request.row_ids, call.cntl.request_attachment)
    if len(values) != len(keys) + len(ids):
        raise H.Finding(f"a pull of {keys} and rows of {list(ids)} got {len(values)} tensors")
    for key, v in zip(keys, values):
        held = ps.store.keys[key].value
        if v.dtype != held.dtype or v.shape != held.shape:
            raise H.Finding(f"pulled {key!r} as {v.dtype} {v.shape}, the key is {held.dtype} {held.shape}")
    for (key, rows), v in zip(ids.items(), values[len(keys):]):
        held = ps.store.keys[key].value
        if v.shape != (len(rows),) + held.shape[1:]:
            raise H.Finding(f"pulled {len(rows)} rows of {key!r} as {v.shape}")
    copied = sum(v.nbytes for v in values[len(keys):])
    if copied > MAX_PULL_BYTES:
        raise H.Finding(f"a pull copied {copied} bytes of rows, past max_pull_bytes={MAX_PULL_BYTES}")


def _check_store(ps: ParameterServer) -> None:
    store = ps.store
    copies = 1 + store.optimizer.state_copies + (store.mode == "sync")
    held = sum(k.value.nbytes * copies + store_mod.key_bytes(name)
               + sum(ids.nbytes + rows.nbytes for ids, rows in k.acc_rows) for name, k in store.keys.items())
    if store.nbytes > MAX_BYTES or store.nbytes != held:
        raise H.Finding(f"the store counts {store.nbytes} bytes (max_bytes {MAX_BYTES}); its keys hold {held}")


async def drive(data: bytes) -> str:
    kept = {name: getattr(server_mod, name) for name in THRESHOLDS}
    for name, value in THRESHOLDS.items():
        setattr(server_mod, name, value)
    try:
        return await _drive(data)
    finally:
        for name, value in kept.items():
            setattr(server_mod, name, value)


async def _drive(data: bytes) -> str:
    p = H._Provider(data)
    conf = p.byte()
    mode = MODES[conf % 3]
    rule = (Sum(), SGD(lr=0.5), Adam())[(conf >> 2) % 3]
    workers = 1 + (conf >> 4) % 3
    staleness = p.byte() % 4
    ps = ParameterServer(workers, mode=mode, staleness=staleness if mode == "bounded" else 0, optimizer=rule,
                         average=bool(conf & 64), max_wait_s=MAX_WAIT_S, max_bytes=MAX_BYTES,
                         max_pull_bytes=MAX_PULL_BYTES)
    model = _Model(workers) if mode == "async" and isinstance(rule, Sum) else None
    if model is not None:
        _record(ps.store, model)
    calls: list[_Call] = []
    out: list[str] = []
    try:
        for _ in range(p.int_in(1, MAX_CALLS)):
            if not p.remaining():
                break
            kind = ("Init", "Push", "Pull")[p.byte() % 3]
            gen = (0, ps.generation, ps.generation ^ 1)[p.byte() % 3]
            worker = p.int_in(-1, workers)
            step = p.int_in(-1, 6) if p.byte() % 16 else p.pick((1 << 40, -(1 << 40)))
            if kind == "Init":
                named = _tensors(p, p.int_in(0, 3))
                meta, att = _packed(p, named)
                call = _Call(kind, ps_pb2.InitRequest(generation=gen, values=meta, step=step), att, named, {})
            elif kind == "Push":
                named = _tensors(p, p.int_in(0, 3))
                ids = _row_ids(p, list(named))
                meta, att = _packed(p, named)
                id_meta, id_att = _packed(p, ids)
                id_meta, att = _after(att, id_meta, id_att)
                call = _Call(kind, ps_pb2.PushRequest(generation=gen, worker=worker, step=step, grads=meta,
                                                      row_ids=id_meta), att, named, ids)
            else:
                keys = [p.pick(KEYS) for _ in range(p.int_in(0, 2))]
                ids = _row_ids(p, [p.pick(KEYS)])
                id_meta, att = _packed(p, ids)
                call = _Call(kind, ps_pb2.PullRequest(generation=gen, worker=worker, step=step, keys=keys,
                                                      row_ids=id_meta), att, {}, ids)
            calls.append(call)
            call.task = asyncio.ensure_future(_call(ps, call))
            if p.byte() % 4:  # else left running beside the next calls
                await call.task
        results = [await c.task for c in calls]
        for call, res in zip(calls, results):
            stale = call.request.generation not in (0, ps.generation)
            if isinstance(res, RpcError):
                out.append(f"{call.kind} E{res.code}")
                continue
            out.append(f"{call.kind} ok" + (" stale" if stale else ""))
            if call.kind == "Pull" and not stale:
                _check_pull(ps, call, res)
        await asyncio.sleep(0)  # a step left after a reply runs one iteration later
        ps._take_after_reply()
        while ps._background:  # steps on the update thread
            await asyncio.wait(list(ps._background))
        _check_store(ps)
        if model is not None:
            for key, want in model.values.items():
                got = ps.store.keys[key].value
                if got.shape != want.shape or not np.array_equal(got, want):
                    raise H.Finding(f"key {key!r} holds {got.ravel()[:8]} where Init plus the pushes taken give "
                                    f"{want.ravel()[:8]}")
    finally:
        ps.stop()
        for c in calls:
            if c.task is not None and not c.task.done():
                await asyncio.wait([c.task], timeout=1)
                if not c.task.done():
                    raise H.Finding(f"a {c.kind} still runs after the server stopped")
        if ps._executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, ps._executor.shutdown, True)
    return "; ".join(out)


def _record(store, model: _Model) -> None:
    """The model takes what the store took, in the order it took it (a push left running may
    wait for room on the update thread while a later one goes first)."""
    init, push = store.init, store.push

    def recorded_init(values, step=0):
        created = init(values, step)
        model.init({k: values[k] for k in created}, step)
        return created

    def recorded_push(worker, step, grads, row_ids=None, *, later=False):
        job = push(worker, step, grads, row_ids, later=later)
        model.push(worker, step, grads, row_ids or {})
        return job

    store.init, store.push = recorded_init, recorded_push


def one_input(data: bytes) -> str:
    return H.run(drive, data)


def seeds() -> dict[str, bytes]:
    """A few honest sessions; the fuzzer mutates them."""
    return {
        "async_sum_init_push_pull": bytes([0 | (0 << 2) | (0 << 4), 0, 3]) + b"\x00\x01\x01\x02\x01" * 4,
        "sync_sgd_two_workers": bytes([1 | (1 << 2) | (1 << 4), 0, 6]) + bytes(range(40)),
        "bounded_adam": bytes([2 | (2 << 2) | (2 << 4), 2, 8]) + bytes(range(7, 90, 3)),
        "async_sum_rows": bytes([0, 0, 5]) + bytes([0, 1, 2, 3, 0] * 4),
        "left_running": bytes([1 | (1 << 4), 0, 10]) + bytes([2, 1, 1, 3, 0, 0] * 6),
    }


if __name__ == "__main__":
    H.main(one_input, seeds)
