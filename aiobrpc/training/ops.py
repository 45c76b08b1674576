"""The collectives as ring state machines, without I/O.

A collective is started, then fed the segments its left neighbour sends (`receive`); it hands
what it sends to its right neighbour to `emit(step, segment, array)` as soon as the data is
ready, which is what pipelines sending, receiving and reducing. It is complete when it has
received `expected` segments (and the group has delivered what it emitted). The group
(group.py) carries segments between processes; tests drive a whole ring in one process.

Sent arrays are views of the tensor or of the working copy, never modified again by this rank
while they may still be in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np

from ..tensor import _WIRE
from . import reduce as R
from .ring import Layout, all_gather_chunks

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, BARRIER = 1, 2, 3, 4, 5
KIND_NAMES = {ALL_REDUCE: "all_reduce", REDUCE_SCATTER: "reduce_scatter", ALL_GATHER: "all_gather",
              BROADCAST: "broadcast", BARRIER: "barrier"}

Emit = Callable[[int, int, np.ndarray], None]


class RingOp(ABC):
    """Common bookkeeping: which (step, segment) pairs are expected and which arrived."""

    kind = 0

    def __init__(self, rank: int, world: int, code: int, numel: int, segment_elems: int) -> None:
        self.rank = rank
        self.world = world
        self.code = code            # the tensor's DataType
        self.numel = numel          # elements of the tensor, as both sides must agree
        self.layout = Layout(world, numel, segment_elems)
        self.expected = 0
        self.received = 0
        self._seen: set[tuple[int, int]] = set()
        # (step, segment) pairs received straight into their place (destination()): touched on
        # the loop only, where _seen may be updated on the group's reduce thread.
        self.placed: set[tuple[int, int]] = set()
        self.emit: Emit = _no_emit

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def complete(self) -> bool:
        return self.received == self.expected

    @abstractmethod
    def start(self) -> None:
        """Emit what this rank sends first."""

    def receive(self, step: int, segment: int, data) -> None:
        """Take one segment from the left neighbour; ValueError names what does not fit."""
        key = (step, segment)
        if key in self._seen:
            raise ValueError(f"segment {segment} of step {step} arrived twice")
        a, b, dtype = self._target(step, segment)
        incoming = np.frombuffer(data, dtype) if len(data) else np.empty(0, dtype)
        if incoming.size != b - a:
            raise ValueError(f"segment {segment} of step {step} has {memoryview(data).nbytes} bytes, "
                             f"expected {(b - a) * np.dtype(dtype).itemsize}")
        self._seen.add(key)
        self.received += 1
        self._take(step, segment, a, b, incoming)

    def destination(self, step: int, segment: int, nbytes: int) -> np.ndarray | None:
        """Where segment `segment` of step `step` (`nbytes`) may be received directly, once:
        the slice it is copied to anyway; None for one that is combined with what is there
        (reduce-scatter) or that does not fit."""
        key = (step, segment)
        if key in self.placed:
            return None
        try:
            a, b, _ = self._target(step, segment)
        except ValueError:
            return None
        dest = self._copy_target(step)
        if dest is None or (b - a) * dest.itemsize != nbytes:
            return None
        self.placed.add(key)
        return dest[a:b]

    def _copy_target(self, step: int) -> np.ndarray | None:
        """The array a received segment of `step` is copied into, if it is copied."""
        return None

    @abstractmethod
    def _target(self, step: int, segment: int) -> tuple[int, int, np.dtype]:
        """Where segment `segment` of step `step` lands: (first, end) elements and dtype."""

    @abstractmethod
    def _take(self, step: int, segment: int, a: int, b: int, incoming: np.ndarray) -> None:
        """Use a received segment (reduce or copy it) and emit what follows from it."""

    def _emit_chunk(self, step: int, chunk: int, source: np.ndarray) -> None:
        lay = self.layout
        for s in range(lay.segments(chunk)):
            a, b = lay.segment(chunk, s)
            self.emit(step, s, source[a:b])

    def _segment(self, chunk: int, step: int, segment: int) -> tuple[int, int]:
        try:
            return self.layout.segment(chunk, segment)
        except IndexError:
            raise ValueError(f"step {step} has no segment {segment} (chunk {chunk} of "
                             f"{self.numel} elements)") from None

    def _count_steps(self, recv_chunk: Callable[[int], int], steps: range) -> int:
        return sum(self.layout.segments(recv_chunk(t)) for t in steps)


def _copy(dest: np.ndarray, incoming: np.ndarray) -> None:
    """dest[:] = incoming, unless it was received there (destination())."""
    if incoming.size and incoming.ctypes.data == dest.ctypes.data:
        return
    dest[...] = incoming


def _no_emit(step: int, segment: int, data: np.ndarray) -> None:
    raise RuntimeError("the collective was started before the group set its emit")


class AllReduce(RingOp):
    """In place on `raw` (the tensor's bytes as its wire dtype, 1-D): reduce-scatter then
    all-gather; half-precision tensors are reduced in a float32 copy and rounded once."""

    kind = ALL_REDUCE

    def __init__(self, rank: int, world: int, code: int, raw: np.ndarray, op: R.ReduceOp,
                 segment_elems: int, shift: int = 0) -> None:
        R.check_op(op, code)
        super().__init__(rank, world, code, raw.size, segment_elems)
        self.raw = raw
        self.op = op
        self.wide = R.accumulates_wide(code)
        self.work = R.widen(raw, code) if self.wide else raw
        self.shift = shift  # reduce_scatter ends with chunk r on rank r, all_reduce with r + 1
        n = world
        self.rs_steps = n - 1
        self.ag_steps = n - 1 if self.kind == ALL_REDUCE else 0
        self.expected = (self._count_steps(lambda t: (rank - 1 - t + shift) % n, range(self.rs_steps))
                         + self._count_steps(lambda t: all_gather_chunks(rank, n, t)[1], range(self.ag_steps)))

    def start(self) -> None:
        if self.world == 1:
            self._finalize(0, self.numel)
            return
        self._emit_chunk(0, self.rank + self.shift, self.work)

    def _target(self, step: int, segment: int) -> tuple[int, int, np.dtype]:
        n, r = self.world, self.rank
        if 0 <= step < self.rs_steps:
            a, b = self._segment((r - 1 - step + self.shift) % n, step, segment)
            return a, b, self.work.dtype
        t = step - self.rs_steps
        if 0 <= t < self.ag_steps:
            a, b = self._segment(all_gather_chunks(r, n, t)[1], step, segment)
            return a, b, self.raw.dtype
        raise ValueError(f"{self.name} has no step {step} in a ring of {n}")

    def _take(self, step: int, segment: int, a: int, b: int, incoming: np.ndarray) -> None:
        if step < self.rs_steps:
            R.combine(self.op, self.work[a:b], incoming)
            if step < self.rs_steps - 1:
                self.emit(step + 1, segment, self.work[a:b])
                return
            self._finalize(a, b)
            if self.ag_steps:
                self.emit(self.rs_steps, segment, self.raw[a:b])
            return
        _copy(self.raw[a:b], incoming)
        if step - self.rs_steps < self.ag_steps - 1:
            self.emit(step + 1, segment, self.raw[a:b])

    def _copy_target(self, step: int) -> np.ndarray | None:
        return self.raw if step >= self.rs_steps else None

    def _finalize(self, a: int, b: int) -> None:
        if self.op is R.ReduceOp.AVG:
            self.work[a:b] /= self.world
        if self.wide:
            R.narrow_into(self.raw[a:b], self.work[a:b], self.code)


class ReduceScatter(AllReduce):
    """Reduce `raw` over the ranks; rank r keeps chunk r (`result()`); `raw` is not changed."""

    kind = REDUCE_SCATTER

    def __init__(self, rank: int, world: int, code: int, raw: np.ndarray, op: R.ReduceOp,
                 segment_elems: int) -> None:
        super().__init__(rank, world, code, raw.copy(), op, segment_elems, shift=-1)

    def result(self) -> np.ndarray:
        a, b = self.layout.chunk(self.rank)
        return self.raw[a:b]


class AllGather(RingOp):
    """Every rank's `raw` (same size everywhere) into `out`, rank after rank."""

    kind = ALL_GATHER

    def __init__(self, rank: int, world: int, code: int, raw: np.ndarray, out: np.ndarray,
                 segment_elems: int) -> None:
        super().__init__(rank, world, code, raw.size, segment_elems)
        if out.size != raw.size * world or out.dtype != raw.dtype:
            raise ValueError(f"all_gather output must hold {world} x {raw.size} {raw.dtype}, "
                             f"got {out.size} {out.dtype}")
        self.layout = Layout(world, raw.size * world, segment_elems)
        self.out = out
        a, b = self.layout.chunk(rank)
        out[a:b] = raw
        self.expected = self._count_steps(lambda t: (rank - 1 - t) % world, range(world - 1))

    def start(self) -> None:
        if self.world > 1:
            self._emit_chunk(0, self.rank, self.out)

    def _target(self, step: int, segment: int) -> tuple[int, int, np.dtype]:
        if not 0 <= step < self.world - 1:
            raise ValueError(f"{self.name} has no step {step} in a ring of {self.world}")
        a, b = self._segment((self.rank - 1 - step) % self.world, step, segment)
        return a, b, self.out.dtype

    def _copy_target(self, step: int) -> np.ndarray | None:
        return self.out

    def _take(self, step: int, segment: int, a: int, b: int, incoming: np.ndarray) -> None:
        _copy(self.out[a:b], incoming)
        if step < self.world - 2:
            self.emit(step + 1, segment, self.out[a:b])


class Barrier(AllGather):
    """An all_gather of one byte: no rank leaves before every rank has arrived."""

    kind = BARRIER

    def __init__(self, rank: int, world: int, segment_elems: int) -> None:
        from ..tensor import DataType
        super().__init__(rank, world, DataType.DT_UINT8, np.zeros(1, np.uint8),
                         np.zeros(world, np.uint8), segment_elems)


class Broadcast(RingOp):
    """`raw` of rank `root` to every rank, passed along the ring from root to root - 1."""

    kind = BROADCAST

    def __init__(self, rank: int, world: int, code: int, raw: np.ndarray, root: int,
                 segment_elems: int) -> None:
        super().__init__(rank, world, code, raw.size, segment_elems)
        self.layout = Layout(1, raw.size, segment_elems)
        self.raw = raw
        self.root = root
        self.last = (rank + 1) % world == root  # the end of the chain forwards nothing
        self.expected = 0 if rank == root else self.layout.segments(0)

    def start(self) -> None:
        if self.rank == self.root and self.world > 1:
            self._emit_chunk(0, 0, self.raw)

    def _target(self, step: int, segment: int) -> tuple[int, int, np.dtype]:
        if step != 0 or self.rank == self.root:
            raise ValueError(f"{self.name} from rank {self.root} has no step {step} for rank {self.rank}")
        a, b = self._segment(0, step, segment)
        return a, b, self.raw.dtype

    def _copy_target(self, step: int) -> np.ndarray | None:
        return self.raw

    def _take(self, step: int, segment: int, a: int, b: int, incoming: np.ndarray) -> None:
        _copy(self.raw[a:b], incoming)
        if not self.last:
            self.emit(0, segment, self.raw[a:b])


def wire_dtype(code: int) -> np.dtype:
    """The numpy dtype that carries a tensor of DataType `code`."""
    return _WIRE[code][1]
