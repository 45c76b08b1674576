"""The ring collectives' state machines, a whole ring driven in one process.

Segments are delivered in a random order (what a pipelined ring allows), so results must not
depend on arrival order; the multi-process tests (test_collectives.py) then check the same over
real connections for a few cases.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from aiobrpc.tensor import DataType, raw_array
from aiobrpc.training import ops
from aiobrpc.training import reduce as R
from aiobrpc.training.ring import Layout

SIZES = [0, 1, 5, 7, 1000, 1001]


def drive(made: list[ops.RingOp], seed: int = 1, place: bool = False) -> int:
    """Run the ring; with `place`, a segment whose op offers a destination is written there
    first (as the kernel would) and handed over as a view of it. Returns how many were."""
    n = len(made)
    q: collections.deque = collections.deque()
    for r, op in enumerate(made):
        op.emit = lambda step, seg, arr, r=r: q.append(((r + 1) % n, step, seg, bytearray(arr.tobytes())))
    for op in made:
        op.start()
    rng = np.random.default_rng(seed)
    placed = 0
    while q:
        q.rotate(-int(rng.integers(len(q))))
        dst, step, seg, data = q.popleft()
        view = memoryview(data)
        if place:
            dest = made[dst].destination(step, seg, len(data))
            if dest is not None:
                dest_bytes = memoryview(dest).cast("B")
                dest_bytes[:] = data
                view = dest_bytes
                placed += 1
                assert made[dst].destination(step, seg, len(data)) is None  # once only
        made[dst].receive(step, seg, view)
    assert [op.received for op in made] == [op.expected for op in made]
    return placed


@pytest.mark.parametrize("n", [2, 3, 4])
def test_segments_received_in_place_give_the_same_results(n):
    """destination(): the all-gather half of all_reduce, all_gather and broadcast take their
    segments where they would copy them; the reduce-scatter half never (it combines)."""
    numel = 1001
    xs = inputs(n, numel, "float64")
    ys = [x.copy() for x in xs]
    placed = drive([ops.AllReduce(r, n, *raw_array(ys[r]), R.ReduceOp.SUM, 100) for r in range(n)], place=True)
    want = np.sum(np.stack(xs), axis=0)
    for y in ys:
        np.testing.assert_allclose(y, want, rtol=1e-12)
    segments_per_chunk = -(-(numel // n) // 100)
    assert placed >= n * (n - 1) * (segments_per_chunk - 1)  # every all-gather step's segments
    outs = [np.zeros(numel * n) for _ in range(n)]
    assert drive([ops.AllGather(r, n, *raw_array(xs[r]), outs[r], 100) for r in range(n)], place=True) > 0
    for out in outs:
        assert np.array_equal(out, np.concatenate(xs))
    bs = [x.copy() for x in xs]
    assert drive([ops.Broadcast(r, n, *raw_array(bs[r]), 1, 100) for r in range(n)], place=True) > 0
    for b in bs:
        assert np.array_equal(b, xs[1])


def test_a_reduce_scatter_step_or_a_wrong_size_is_never_placed():
    op = ops.AllReduce(0, 3, *raw_array(np.zeros(30)), R.ReduceOp.SUM, 100)
    assert op.destination(0, 0, 80) is None  # reduce-scatter: combined with what is there
    assert op.destination(2, 0, 79) is None  # all-gather, but not its size
    assert op.destination(2, 0, 80) is not None and op.destination(2, 0, 80) is None
    assert op.destination(9, 0, 80) is None  # no such step


def inputs(n: int, numel: int, dtype: str) -> list[np.ndarray]:
    rngs = [np.random.default_rng(r) for r in range(n)]
    if dtype.startswith("float"):
        return [(g.standard_normal(numel) * 10).astype(dtype) for g in rngs]
    return [g.integers(-1000, 1000, numel).astype(dtype) for g in rngs]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("op", list(R.ReduceOp))
def test_all_reduce_equals_numpy_and_is_identical_on_every_rank(n, numel, op):
    bitwise = op in (R.ReduceOp.BAND, R.ReduceOp.BOR, R.ReduceOp.BXOR)
    dtype = "int32" if bitwise or op in (R.ReduceOp.MAX, R.ReduceOp.MIN) and numel % 2 else "float64"
    xs = inputs(n, numel, dtype)
    if op is R.ReduceOp.PRODUCT:
        xs = [x / 1000 for x in xs]
    ys = [x.copy() for x in xs]
    drive([ops.AllReduce(r, n, *raw_array(ys[r]), op, 3) for r in range(n)])
    want = {R.ReduceOp.SUM: np.sum, R.ReduceOp.AVG: np.mean, R.ReduceOp.MAX: np.max,
            R.ReduceOp.MIN: np.min, R.ReduceOp.PRODUCT: np.prod, R.ReduceOp.BAND: np.bitwise_and.reduce,
            R.ReduceOp.BOR: np.bitwise_or.reduce,
            R.ReduceOp.BXOR: np.bitwise_xor.reduce}[op](np.stack(xs), axis=0) if numel else np.zeros(0)
    for y in ys:
        np.testing.assert_allclose(y, want, rtol=1e-12)
        assert y.tobytes() == ys[0].tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_half_precision_sums_accumulate_in_float32_and_round_once(dtype, n):
    numel = 1001
    wide = [np.random.default_rng(r).standard_normal(numel).astype(np.float32) * 100 for r in range(n)]
    if dtype == "float16":
        xs = [w.astype(np.float16) for w in wide]
        code = DataType.DT_FLOAT16
        as_f32 = lambda a: a.astype(np.float32)  # noqa: E731
    else:
        xs = [(w.view(np.uint32) >> 16).astype(np.uint16) for w in wide]  # truncated to bfloat16
        code = DataType.DT_BFLOAT16
        as_f32 = lambda a: (a.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    ys = [x.copy() for x in xs]
    drive([ops.AllReduce(r, n, code, ys[r], R.ReduceOp.SUM, 64) for r in range(n)])
    exact = np.sum([as_f32(x).astype(np.float64) for x in xs], axis=0)
    rounded = np.empty(numel, xs[0].dtype)
    R.narrow_into(rounded, exact.astype(np.float32), code)
    for y in ys:
        assert y.tobytes() == ys[0].tobytes()
        # within one rounding of the exact sum: equal to it rounded, but for float32's own ties
        assert np.mean(y == rounded) > 0.99
        np.testing.assert_allclose(as_f32(y), exact, rtol=2 ** -7 if dtype == "bfloat16" else 2 ** -10)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    f = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, np.nan, 3.0e38], np.float32)
    out = np.empty(f.size, np.uint16)
    R.narrow_into(out, f, DataType.DT_BFLOAT16)
    back = (out.astype(np.uint32) << 16).view(np.float32)
    assert back[:5].tolist() == [1.0, 1.0, 1.015625, -2.5, np.inf]  # 1+2^-8 ties to even (1.0)
    assert np.isnan(back[5]) and np.isfinite(back[6])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", SIZES)
def test_reduce_scatter_leaves_chunk_r_on_rank_r_and_the_input_unchanged(n, numel):
    xs = inputs(n, numel, "int64")
    before = [x.copy() for x in xs]
    made = [ops.ReduceScatter(r, n, *raw_array(xs[r]), R.ReduceOp.SUM, 2) for r in range(n)]
    drive(made)
    total = np.sum(np.stack(xs), axis=0) if numel else np.zeros(0, np.int64)
    for r, op in enumerate(made):
        assert op.result().tolist() == np.array_split(total, n)[r].tolist()
        assert xs[r].tolist() == before[r].tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", SIZES)
def test_all_gather_and_broadcast(n, numel):
    xs = inputs(n, numel, "int16")
    outs = [np.empty(n * numel, np.int16) for _ in range(n)]
    drive([ops.AllGather(r, n, *raw_array(xs[r]), outs[r], 3) for r in range(n)])
    for o in outs:
        assert o.tolist() == np.concatenate(xs).tolist()
    for root in range(n):
        ys = [x.copy() for x in xs]
        drive([ops.Broadcast(r, n, *raw_array(ys[r]), root, 4) for r in range(n)])
        assert all(y.tolist() == xs[root].tolist() for y in ys)


def test_barrier_completes_only_when_every_rank_took_part():
    made = [ops.Barrier(r, 3, 1) for r in range(3)]
    drive(made)
    lonely = ops.Barrier(0, 3, 1)
    lonely.emit = lambda *a: None
    lonely.start()
    assert not lonely.complete


def test_what_does_not_fit_the_ring_is_named():
    op = ops.AllReduce(0, 2, *raw_array(np.zeros(10, np.float32)), R.ReduceOp.SUM, 4)
    op.emit = lambda *a: None
    with pytest.raises(ValueError, match="step 0 has no segment 5"):
        op.receive(0, 5, b"")
    with pytest.raises(ValueError, match="segment 0 of step 0 has 8 bytes, expected 16"):
        op.receive(0, 0, bytes(8))
    with pytest.raises(ValueError, match="all_reduce has no step 7 in a ring of 2"):
        op.receive(7, 0, b"")
    op.receive(0, 0, bytes(16))
    with pytest.raises(ValueError, match="segment 0 of step 0 arrived twice"):
        op.receive(0, 0, bytes(16))
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        ops.AllReduce(0, 2, *raw_array(np.zeros(3, np.int32)), R.ReduceOp.AVG, 4)
    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        R.reduce_op("prod")


def test_layout_cuts_uneven_sizes_into_near_equal_chunks():
    lay = Layout(4, 10, 2)
    assert [lay.chunk(c) for c in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [lay.segments(c) for c in range(4)] == [2, 2, 1, 1]
    assert lay.segment(0, 1) == (2, 3)
