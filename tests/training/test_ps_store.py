"""aiobrpc.training.ps without the network: placement of keys, update rules, the clocks of the modes,
bad input, the memory bound."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import aiobrpc
from aiobrpc import _compiled
from aiobrpc._fast import sgd
from aiobrpc.training.ps import optim, server, sharding, store, worker
from aiobrpc.training.ps.optim import SGD, Adam, Sum
from aiobrpc.training.ps.sharding import key_hash, shard_of
from aiobrpc.training.ps.store import KEY_BYTES, KeyStore

f32 = np.float32


@pytest.mark.parametrize("module", [optim, sharding, store, server, worker])
def test_docstring_examples_run(module):
    failed, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failed == 0


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C by its definition (reflected polynomial 0x82F63B78), as a C++ port would write it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_placement_is_crc32c_of_the_utf8_key():
    # The CRC-32C check value, as butil::crc32c::Value("123456789", 9) gives in C++.
    assert key_hash("123456789") == 0xE3069283
    for key in ("w", "embedding", "layer1.weight", "ключ", "x" * 1000):
        assert key_hash(key) == crc32c_bitwise(key.encode("utf-8")) == key_hash(key.encode("utf-8"))
    # Pinned: a change here moves every key of every deployed model.
    assert [shard_of(k, 4) for k in ("w", "b", "embedding", "layer1.weight", "layer1.bias")] == [3, 0, 2, 1, 3]
    keys = [f"layer{i}.weight" for i in range(200)]
    counts = np.bincount([shard_of(k, 4) for k in keys], minlength=4)
    assert counts.min() > 30, "keys spread over the shards"
    with pytest.raises(ValueError, match="num_shards must be an int >= 1"):
        shard_of("w", 0)


def test_sgd_and_sum_rules():
    w = np.ones(3, f32)
    SGD(lr=0.5).apply(w, np.array([2, 0, -2], f32), None)
    assert w.tolist() == [0, 1, 2]
    Sum().apply(w, np.array([1, 1, 1], f32), None, None)
    assert w.tolist() == [1, 2, 3]
    Sum().apply(w, np.array([10], f32), None, np.array([2]))
    assert w.tolist() == [1, 2, 13]
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        SGD(lr=0)
    with pytest.raises(ValueError, match=r"betas\[1\] must be a finite number >= 0.0 and < 1.0"):
        Adam(betas=(0.9, 1.0))


def _specials(a: np.ndarray) -> None:
    info = np.finfo(a.dtype)
    flat = a.reshape(-1)
    flat[:min(8, flat.size)] = [np.nan, np.inf, -np.inf, -0.0, info.tiny / 4, info.max, -info.max, info.tiny][
        :min(8, flat.size)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("size", [0, 1, 7, sgd.CHUNK - 1, sgd.CHUNK, 2 * sgd.CHUNK + 7])
def test_sgd_equals_numpy_bit_for_bit(size, dtype):
    """The step rounds as numpy's expression does (product, then difference), element for
    element, whichever path takes it: the compiled loop (float32, float64), numpy a scratch at
    a time (keys larger than the scratch), numpy whole; NaN, infinities, subnormals, -0.0 and
    overflow included."""
    rng = np.random.default_rng(size)
    w = rng.standard_normal(size).astype(dtype).reshape(-1, 1)  # 2-D: flattened views inside
    g = rng.standard_normal(size).astype(dtype).reshape(-1, 1)
    _specials(w)
    _specials(g[::-1])
    with np.errstate(all="ignore"):
        expected = w - g * dtype(0.37)
        SGD(lr=0.37).apply(w, g, None)
    assert w.dtype == dtype and w.tobytes() == expected.tobytes()


def test_sgd_takes_a_gradient_that_is_not_aligned_or_not_contiguous():
    raw = np.zeros(4 * 1001 + 1, np.uint8)
    g = np.frombuffer(raw.data, np.float32, 1000, 1)  # as a view of an attachment at an odd offset
    assert not g.flags.aligned
    g_values = np.arange(1000, dtype=np.float32)
    raw[1:4001] = g_values.view(np.uint8)
    w = np.ones(1000, np.float32)
    SGD(lr=0.5).apply(w, g, None)
    assert w.tobytes() == (np.ones(1000, np.float32) - g_values * np.float32(0.5)).tobytes()
    w2 = np.ones((10, 10), np.float64)
    g2 = np.arange(200, dtype=np.float64).reshape(10, 20)[:, ::2]
    SGD(lr=0.25).apply(w2, g2, None)
    assert w2.tobytes() == (np.ones((10, 10)) - g2 * 0.25).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sgd_reads_a_gradient_that_overlaps_the_value_as_if_copied_first(dtype):
    buf = np.arange(20, dtype=dtype)
    value, grad = buf[2:12], buf[0:10]  # grad[i + 2] is value[i]: a loop would read its own writes
    expected = value - grad.copy() * dtype(0.5)
    sgd.sub_scaled(value, grad, 0.5)
    assert value.tobytes() == expected.tobytes()
    same = np.arange(10, dtype=dtype)
    sgd.sub_scaled(same, same, 0.5)
    assert same.tobytes() == (np.arange(10, dtype=dtype) * dtype(0.5)).tobytes()


def test_the_compiled_sgd_step_equals_its_python_build():
    python = _compiled.load_source("aiobrpc._fast.sgd")
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float64):
        w = rng.standard_normal(3 * sgd.CHUNK + 5).astype(dtype)
        g = rng.standard_normal(w.size).astype(dtype)
        _specials(w)
        a, b = w.copy(), w.copy()
        with np.errstate(all="ignore"):
            sgd.sub_scaled(a, g, 1e-3)
            python.sub_scaled(b, g, 1e-3)
        assert a.tobytes() == b.tobytes()
    assert python.__file__.endswith("sgd.py")


def adam_reference(w, grads, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    m = np.zeros_like(w, np.float64)
    v = np.zeros_like(w, np.float64)
    w = w.astype(np.float64)
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return w


def test_adam_matches_the_paper_whole_and_by_rows():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((4, 3)) for _ in range(5)]
    rule = Adam(lr=0.1)
    w = np.zeros((4, 3))
    state = rule.new_state(w)
    for g in grads:
        rule.apply(w, g, state)
    np.testing.assert_allclose(w, adam_reference(np.zeros((4, 3)), grads), rtol=1e-12)
    # Rows: each row corrected by its own count (row 3 never pushed, row 1 pushed twice).
    w = np.zeros((4, 3))
    state = rule.new_state(w)
    rule.apply(w, grads[0][:2], state, np.array([0, 1]))
    rule.apply(w, grads[1][1:3], state, np.array([1, 2]))
    np.testing.assert_allclose(w[0], adam_reference(np.zeros(3), [grads[0][0]]), rtol=1e-12)
    np.testing.assert_allclose(w[1], adam_reference(np.zeros(3), [grads[0][1], grads[1][1]]), rtol=1e-12)
    np.testing.assert_allclose(w[2], adam_reference(np.zeros(3), [grads[1][2]]), rtol=1e-12)
    assert not w[3].any() and state[2].tolist() == [1, 2, 1, 0]


def test_sync_gathers_a_step_from_every_worker_then_applies_the_mean():
    s = KeyStore(3, mode="sync", optimizer=Sum())
    s.init({"w": np.zeros(2, f32)})
    s.push(0, 0, {"w": np.array([3, 0], f32)})
    s.push(1, 0, {"w": np.array([3, 0], f32)})
    assert not s.ready(["w"], 1) and s.stragglers(["w"], 1) == [2]
    s.push(1, 0, {"w": np.array([100, 100], f32)})  # a retried push of a step taken: ignored
    assert s.read(["w"], {})[0].tolist() == [0, 0], "nothing applied before the step is whole"
    s.push(2, 0, {"w": np.array([0, 6], f32)})
    assert s.ready(["w"], 1) and not s.ready(["w"], 2)
    assert s.read(["w"], {})[0].tolist() == [2, 2]
    with pytest.raises(aiobrpc.RpcError, match="worker 0 pushed step 3 of 'w' but the server is at step 1 in sync mode") as e:
        s.push(0, 3, {"w": np.zeros(2, f32)})
    assert e.value.code == aiobrpc.errors.EREQUEST


def test_sync_combines_rows_and_whole_pushes_of_a_step():
    s = KeyStore(2, mode="sync", optimizer=Sum(), average=False)
    s.init({"e": np.zeros((4, 2), f32)})
    s.push(0, 0, {"e": np.ones((3, 2), f32)}, {"e": np.array([0, 2, 0])})  # row 0 twice: summed
    s.push(1, 0, {"e": np.ones((4, 2), f32)})
    assert s.read(["e"], {})[0][:, 0].tolist() == [3, 1, 2, 1]
    s.push(0, 1, {"e": np.ones((1, 2), f32)}, {"e": np.array([3])})
    s.push(1, 1, {"e": np.ones((0, 2), f32)}, {"e": np.zeros(0, np.int64)})  # no rows this step
    assert s.read([], {"e": np.array([3, 1])})[0][:, 0].tolist() == [2, 1]


def test_bounded_staleness_lets_a_worker_run_ahead_by_s_steps():
    s = KeyStore(2, mode="bounded", staleness=2, optimizer=Sum())
    s.init({"w": np.zeros(1, f32)})
    one = {"w": np.ones(1, f32)}
    for step in range(3):
        assert s.ready(["w"], step)
        s.push(0, step, one)  # applied on arrival
    assert s.read(["w"], {})[0].tolist() == [3]
    assert not s.ready(["w"], 3) and s.stragglers(["w"], 3) == [1]
    s.push(1, 0, one)
    assert s.ready(["w"], 3) and not s.ready(["w"], 4)
    a = KeyStore(2, mode="async")
    a.init({"w": np.zeros(1, f32)})
    assert a.ready(["w"], 1000)


def test_a_pulled_array_never_changes_under_its_reply():
    s = KeyStore(1, mode="async", optimizer=Sum())
    s.init({"w": np.zeros(3, f32)})
    lent = s.read(["w"], {})[0]
    s.push(0, 0, {"w": np.ones(3, f32)})
    assert lent.tolist() == [0, 0, 0] and s.read(["w"], {})[0].tolist() == [1, 1, 1]
    s.push(0, 1, {"w": np.ones(3, f32)})  # not lent since: updated in place
    assert s.keys["w"].value.tolist() == [2, 2, 2]


def test_a_push_applied_later_has_moved_its_clocks_and_keeps_a_lent_array():
    s = KeyStore(1, mode="bounded", optimizer=Sum())
    s.init({"w": np.zeros(3, f32)})
    lent = s.read(["w"], {})[0]
    job = s.push(0, 0, {"w": np.ones(3, f32)}, later=True)
    assert s.ready(["w"], 1) and s.keys["w"].value.tolist() == [0, 0, 0]
    assert s.push(0, 0, {"w": np.ones(3, f32)}, later=True) is None  # a retry: nothing to apply
    job()
    assert lent.tolist() == [0, 0, 0] and s.read(["w"], {})[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize("optimizer", [SGD(lr=0.3), Sum(), Adam()], ids=["sgd", "sum", "adam"])
@pytest.mark.parametrize("budget", [4, 40, 4000, 1 << 20])
def test_a_later_step_taken_in_slices_equals_it_taken_whole(optimizer, budget):
    rng = np.random.default_rng(7)
    init = {"a": rng.standard_normal((7, 5)).astype(f32), "b": rng.standard_normal(301),
            "e": rng.standard_normal((6, 3)).astype(f32), "z": np.zeros(0, f32)}
    grads = {"a": rng.standard_normal((7, 5)).astype(f32), "b": rng.standard_normal(301),
             "e": rng.standard_normal((2, 3)).astype(f32), "z": np.zeros(0, f32)}
    rows = {"e": np.array([4, 1])}
    whole, sliced = KeyStore(1, optimizer=optimizer), KeyStore(1, optimizer=optimizer)
    for s in (whole, sliced):
        s.init({k: v.copy() for k, v in init.items()})
    lent = sliced.read(["a"], {})[0]  # a reply still being written: never changed under it
    whole.push(0, 0, grads, rows)
    steps = sliced.push(0, 0, grads, rows, later=True)
    slices = 1
    while not steps.some(budget):
        slices += 1
        assert slices < 10_000
    if budget == 4 and optimizer.elementwise:
        assert slices > 35 + 301  # a slice at a time: a's and b's elements at most one or two each
    assert lent.tolist() == init["a"].tolist()
    for k in init:
        assert sliced.keys[k].value.tobytes() == whole.keys[k].value.tobytes(), k
    assert steps.some(budget) and steps.some(None)  # nothing left: taking it again changes nothing
    for k in init:
        assert sliced.keys[k].value.tobytes() == whole.keys[k].value.tobytes(), k


def test_a_step_begun_in_slices_is_finished_whole_by_a_call():
    s = KeyStore(1, optimizer=Sum())
    s.init({"w": np.zeros(1000, f32)})
    steps = s.push(0, 0, {"w": np.ones(1000, f32)}, later=True)
    assert not steps.some(400)  # 100 elements taken
    assert s.keys["w"].value[:100].tolist() == [1] * 100 and s.keys["w"].value[100:].tolist() == [0] * 900
    steps()  # a call comes: the rest at once
    assert s.keys["w"].value.tolist() == [1] * 1000


def test_a_value_that_is_not_contiguous_takes_its_step_whole():
    s = KeyStore(1, optimizer=Sum())
    s.init({"w": np.zeros(8, f32)})
    s.keys["w"].value = np.zeros(16, f32)[::2]  # as no init makes it, but a step must not write a copy
    steps = s.push(0, 0, {"w": np.ones(8, f32)}, later=True)
    assert steps.some(4)  # all of it at once
    assert s.keys["w"].value.tolist() == [1] * 8


@pytest.mark.parametrize("grads, rows, message", [
    ({"v": np.zeros(2, f32)}, None, r"unknown key 'v': this server holds 2 keys \('e', 'w'\)"),
    ({"w": np.zeros(3, f32)}, None, r"gradient of 'w' has shape \[3\], expected \[2\] \(key shape \[2\]\)"),
    ({"w": np.zeros(2, np.float64)}, None, "gradient of 'w' is float64 but the key is float32"),
    ({"e": np.zeros((2, 3), f32)}, {"e": np.array([0, 1])}, r"2 rows of 'e' has shape \[2, 3\], expected \[2, 2\]"),
    ({"e": np.zeros((1, 2), f32)}, {"e": np.array([4])}, r"row id 4 of 'e' is outside 0..3"),
    ({"e": np.zeros((1, 2), f32)}, {"e": np.array([0], np.int32)}, "row ids of 'e' must be int64 of one dimension"),
    ({"w": np.zeros((1,), f32)}, {"w": np.array([0]), "e": np.array([0])}, "row ids of 'e' without its gradient rows"),
])
def test_bad_pushes_are_refused_whole_naming_what_is_wrong(grads, rows, message):
    s = KeyStore(2, mode="async", optimizer=Sum())
    s.init({"w": np.zeros(2, f32), "e": np.zeros((4, 2), f32)})
    before = {k: v.value.copy() for k, v in s.keys.items()}
    with pytest.raises(aiobrpc.RpcError, match=message) as e:
        s.push(0, 0, {"w": np.ones(2, f32), **grads}, rows)
    assert e.value.code == aiobrpc.errors.EREQUEST
    assert all(np.array_equal(before[k], s.keys[k].value) for k in before), "nothing applied"
    with pytest.raises(aiobrpc.RpcError, match=r"worker 2 is outside 0..1 \(num_workers=2\)"):
        s.push(2, 0, {"w": np.ones(2, f32)})


def test_init_keeps_what_exists_and_refuses_a_different_shape_or_dtype():
    s = KeyStore(1)
    assert s.init({"w": np.ones(2, f32)}) == ["w"]
    assert s.init({"w": np.zeros(2, f32), "b": np.zeros((), np.float64)}) == ["b"]
    assert s.keys["w"].value.tolist() == [1, 1], "the first init wins"
    with pytest.raises(aiobrpc.RpcError, match=r"key 'w' exists as float32 \[2\]; init gave float32 \[3\]"):
        s.init({"w": np.zeros(3, f32)})
    with pytest.raises(aiobrpc.RpcError, match="key 'i': parameters are float32 or float64, got int64"):
        s.init({"i": np.zeros(3, np.int64)})


def test_keys_take_at_most_max_bytes():
    s = KeyStore(2, mode="sync", optimizer=Adam(), max_bytes=4000 + KEY_BYTES + 1)
    s.init({"a": np.zeros(250, f32)})  # 1000 bytes: value, two moments, the sync sum; and the key
    assert s.nbytes == 4000 + KEY_BYTES + 1
    with pytest.raises(aiobrpc.RpcError, match=f"init of 1 keys needs {16 + KEY_BYTES + 1} bytes; this server "
                                               f"holds {4000 + KEY_BYTES + 1} of max_bytes {4000 + KEY_BYTES + 1}"):
        s.init({"b": np.zeros(1, f32)})
    assert list(s.keys) == ["a"]


def test_sync_rows_held_until_their_step_is_whole_count_in_max_bytes():
    s = KeyStore(2, mode="sync", optimizer=SGD(lr=1.0), max_bytes=2 * 4096 + KEY_BYTES + 1 + 2 * (1024 + 8))
    s.init({"e": np.zeros((4, 256), f32)})  # rows of 1 KiB; the value and the step's sum: 8 KiB
    base = s.nbytes
    with pytest.raises(aiobrpc.RpcError, match=r"the rows of this push, held until every worker pushed step 0 "
                                               r"\(sync mode\), need 3096 bytes"):
        s.push(0, 0, {"e": np.ones((3, 256), f32)}, {"e": np.array([0, 1, 1], np.int64)})
    s.push(0, 0, {"e": np.ones((2, 256), f32)}, {"e": np.array([0, 1], np.int64)})
    assert s.nbytes == base + 2 * (1024 + 8)
    s.push(0, 0, {"e": np.ones((2, 256), f32)}, {"e": np.array([0, 1], np.int64)})  # a retry: nothing more held
    assert s.nbytes == base + 2 * (1024 + 8)
    # no room left, but it makes the step whole: applied at once, never held
    s.push(1, 0, {"e": np.ones((1, 256), f32)}, {"e": np.array([3], np.int64)})
    assert s.nbytes == base
    assert s.read(["e"], {})[0][:, 0].tolist() == [-0.5, -0.5, 0.0, -0.5]  # the mean of the two pushes


def test_keys_of_no_elements_still_count_so_max_bytes_bounds_the_table():
    s = KeyStore(1, max_bytes=10 * (KEY_BYTES + 40))
    for i in range(10):
        s.init({f"{i:040d}": np.zeros(0, f32)})
    with pytest.raises(aiobrpc.RpcError, match="init of 1 keys needs"):
        s.init({"x" * 40: np.zeros(0, f32)})
    assert len(s.keys) == 10


def test_a_pull_copies_at_most_max_pull_bytes_of_rows_and_names_a_key_once():
    """8 bytes of row id ask for a whole row: a pull of many ids of a wide key is refused
    before anything is copied; keys pulled whole are lent and do not count."""
    s = KeyStore(1, max_pull_bytes=4096)
    s.init({"e": np.zeros((4, 256), f32), "w": np.zeros(4096, f32)})  # rows of 1 KiB; 16 KiB whole
    s.check_pull(0, 0, ["w"], {"e": np.array([0, 1, 2, 3], np.int64)})  # 4 rows: 4 KiB
    assert [a.shape for a in s.read(["w"], {"e": np.array([0, 1, 2, 3], np.int64)})] == [(4096,), (4, 256)]
    with pytest.raises(aiobrpc.RpcError, match=r"a pull of rows needs 5120 bytes or more \(5 rows of 'e'\); "
                                               r"a pull copies at most max_pull_bytes=4096 of rows"):
        s.check_pull(0, 0, [], {"e": np.zeros(5, np.int64)})  # a repeated row counts each time
    with pytest.raises(aiobrpc.RpcError, match="key 'w' is pulled twice"):  # each copy would be sent
        s.check_pull(0, 0, ["w", "e", "w"], {})


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_workers=0), "num_workers must be an int >= 1"),
    (dict(num_workers=1, max_pull_bytes=-1), "max_pull_bytes must be an int >= 0"),
    (dict(num_workers=1, mode="ssp"), "mode must be one of sync, async, bounded"),
    (dict(num_workers=1, mode="async", staleness=2), "staleness=2 applies to mode='bounded' only"),
    (dict(num_workers=1, optimizer="sgd"), "optimizer must be an aiobrpc.training.ps Optimizer"),
])
def test_bad_configuration(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        KeyStore(**kwargs)
