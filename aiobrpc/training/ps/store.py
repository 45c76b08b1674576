"""The keys of one parameter server: values, optimizer state, and the clocks of the modes.

No I/O here: the servicer (server.py) decodes calls into these methods and waits on
`changed` for pulls that are not ready yet.

Clocks, per key: each worker's last pushed step, and in sync mode the number of steps applied.
A pull at step t is ready when
  sync:    every worker's push of every step < t has been applied (steps are applied whole:
           the pushes of one step from all workers are combined, then one optimizer step);
  bounded: every worker has pushed every step < t - staleness (pushes apply on arrival);
  async:   always (pushes apply on arrival).

Pulls are served from the key's current array without a copy; the array is marked lent, and
the next update works on a fresh copy, so a reply still being written never changes under it.

Updates: a push's optimizer steps are collected while the push is checked and its clocks
moved, then taken at once, or handed back (`push(..., later=True)`) for the servicer to take
later, whole (on a thread) or a slice at a time (on its loop, between reads): the servicer
then keeps every read and later update after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import EREQUEST, RpcError
from .optim import SGD, Optimizer

__all__ = ["MODES", "KeyStore"]

MODES = ("sync", "async", "bounded")
VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# The most bytes of rows one pull copies (keys pulled whole are lent, not copied): 8 bytes of
# row id ask for a row of any size.
MAX_PULL_BYTES = 1 << 30


KEY_BYTES = 512  # what a key costs beside its arrays (its entry, clocks, name), counted in max_bytes


def key_bytes(key: str) -> int:
    """What `key` costs in max_bytes beside its arrays."""
    return KEY_BYTES + len(key)


def _bad(text: str) -> RpcError:
    return RpcError(EREQUEST, text)


def _shape(a: Any) -> list[int]:
    return list(a.shape)


class _Key:
    __slots__ = ("value", "state", "lent", "clock", "last_step", "acc", "acc_rows", "seen")

    def __init__(self, value: np.ndarray, state: Any, step: int, num_workers: int) -> None:
        self.value = value
        self.state = state
        self.lent = False
        self.clock = step  # sync: steps applied
        self.last_step = np.full(num_workers, step - 1, np.int64)
        self.acc: np.ndarray | None = None  # sync: the dense pushes of step `clock`, summed
        self.acc_rows: list[tuple[np.ndarray, np.ndarray]] = []  # sync: its row pushes, at most one per worker
        self.seen: set[int] = set()  # sync: workers that pushed step `clock`


class KeyStore:
    """The keys of one server.

    >>> store = KeyStore(num_workers=1, mode="sync", optimizer=SGD(lr=0.5))
    >>> store.init({"w": np.zeros(2, np.float32)}, step=0)
    ['w']
    >>> store.push(0, 0, {"w": np.array([1, -1], np.float32)})
    >>> store.ready(["w"], 1), store.read(["w"], {})[0].tolist()
    (True, [-0.5, 0.5])
    """

    def __init__(self, num_workers: int, *, mode: str = "async", staleness: int = 0,
                 optimizer: Optimizer | None = None, average: bool = True, max_bytes: int = 1 << 34,
                 max_pull_bytes: int = MAX_PULL_BYTES) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
        if mode != "bounded" and staleness:
            raise ValueError(f"staleness={staleness} applies to mode='bounded' only, not {mode!r}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an aiobrpc.training.ps Optimizer (Sum, SGD, Adam), got {type(optimizer).__name__}")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if not isinstance(max_pull_bytes, int) or isinstance(max_pull_bytes, bool) or max_pull_bytes < 0:
            raise ValueError(f"max_pull_bytes must be an int >= 0, got {max_pull_bytes!r}")
        self.max_pull_bytes = max_pull_bytes
        self.num_workers = num_workers
        self.mode = mode
        self.staleness = staleness
        self.optimizer = optimizer if optimizer is not None else SGD()
        self.average = average
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the keys may hold: values, optimizer state, sync sums and rows, the keys themselves
        self.keys: dict[str, _Key] = {}
        self.changed = asyncio.Event()  # set on every update; a waiting pull clears it and re-checks
        self._updates: list[tuple[_Key, np.ndarray, np.ndarray | None]] = []  # of the push in hand

    # -- init ------------------------------------------------------------------------------

    def init(self, values: Mapping[str, np.ndarray], step: int = 0) -> list[str]:
        """Create the keys not held yet from `values` (copied), at `step`; those held must match."""
        if not isinstance(step, int) or step < 0:
            raise _bad(f"init step must be >= 0, got {step}")
        new: dict[str, np.ndarray] = {}
        for key, v in values.items():
            if not key:
                raise _bad("a key must be a non-empty name")
            if v.dtype not in VALUE_DTYPES:
                raise _bad(f"key {key!r}: parameters are float32 or float64, got {v.dtype}")
            held = self.keys.get(key)
            if held is None:
                new[key] = v
            elif held.value.shape != v.shape or held.value.dtype != v.dtype:
                raise _bad(f"key {key!r} exists as {held.value.dtype} {_shape(held.value)}; "
                           f"init gave {v.dtype} {_shape(v)}")
        # The value, its optimizer state, and in sync mode the sum of a step's pushes; and each
        # key's own cost, so that max_bytes bounds the table too (keys of no elements are free).
        copies = 1 + self.optimizer.state_copies + (self.mode == "sync")
        extra = sum(v.nbytes * copies + key_bytes(key) for key, v in new.items())
        if self.nbytes + extra > self.max_bytes:
            raise RpcError(EREQUEST, f"init of {len(new)} keys needs {extra} bytes; this server holds "
                                     f"{self.nbytes} of max_bytes {self.max_bytes}")
        for key, v in new.items():
            value = np.array(v, copy=True)
            self.keys[key] = _Key(value, self.optimizer.new_state(value), step, self.num_workers)
        self.nbytes += extra
        return list(new)

    # -- push ------------------------------------------------------------------------------

    def _key(self, key: str) -> _Key:
        k = self.keys.get(key)
        if k is None:
            held = sorted(self.keys)
            listed = ", ".join(map(repr, held[:8])) + (", ..." if len(held) > 8 else "")
            raise _bad(f"unknown key {key!r}: this server holds {len(held)} keys ({listed}); "
                       f"init it first, or check that the worker lists the servers in the same order")
        return k

    def _check_rows(self, key: str, k: _Key, ids: np.ndarray) -> None:
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise _bad(f"row ids of {key!r} must be int64 of one dimension, got {ids.dtype} {_shape(ids)}")
        if k.value.ndim == 0:
            raise _bad(f"key {key!r} is a scalar; it has no rows")
        if ids.size and (ids.min() < 0 or ids.max() >= k.value.shape[0]):
            bad = ids[(ids < 0) | (ids >= k.value.shape[0])][0]
            raise _bad(f"row id {bad} of {key!r} is outside 0..{k.value.shape[0] - 1}")

    def check_push(self, worker: int, step: int, grads: Mapping[str, np.ndarray],
                   row_ids: Mapping[str, np.ndarray]) -> None:
        """Raise RpcError(EREQUEST) naming what is wrong with a push; changes nothing."""
        if not 0 <= worker < self.num_workers:
            raise _bad(f"worker {worker} is outside 0..{self.num_workers - 1} (num_workers={self.num_workers})")
        if step < 0:
            raise _bad(f"step must be >= 0, got {step}")
        for key in row_ids:
            if key not in grads:
                raise _bad(f"row ids of {key!r} without its gradient rows")
        for key, g in grads.items():
            k = self._key(key)
            if g.dtype != k.value.dtype:
                raise _bad(f"gradient of {key!r} is {g.dtype} but the key is {k.value.dtype}")
            ids = row_ids.get(key)
            if ids is None:
                want = k.value.shape
            else:
                self._check_rows(key, k, ids)
                want = ids.shape + k.value.shape[1:]
            if g.shape != want:
                what = f"{len(ids)} rows of {key!r}" if ids is not None else f"gradient of {key!r}"
                raise _bad(f"{what} has shape {_shape(g)}, expected {list(want)} (key shape {_shape(k.value)})")
            if self.mode == "sync" and step > k.clock:
                raise _bad(f"worker {worker} pushed step {step} of {key!r} but the server is at step "
                           f"{k.clock} in sync mode (pull before pushing the next step)")
        held = self._rows_held(worker, step, grads, row_ids)
        if held and self.nbytes + held > self.max_bytes:
            raise RpcError(EREQUEST, f"the rows of this push, held until every worker pushed step {step} "
                                     f"(sync mode), need {held} bytes; this server holds {self.nbytes} of "
                                     f"max_bytes {self.max_bytes}")

    def _rows_held(self, worker: int, step: int, grads: Mapping[str, np.ndarray],
                   row_ids: Mapping[str, np.ndarray]) -> int:
        """Sync mode: the bytes of the row pushes `push` would keep until their step is whole
        (not those of the push that makes it whole: they are applied at once)."""
        if self.mode != "sync":
            return 0
        held = 0
        for key, ids in row_ids.items():
            k = self.keys[key]
            if step > k.last_step[worker] and len(k.seen | {worker}) < self.num_workers:
                held += ids.nbytes + grads[key].nbytes
        return held

    def push(self, worker: int, step: int, grads: Mapping[str, np.ndarray],
             row_ids: Mapping[str, np.ndarray] | None = None, *,
             later: bool = False) -> Callable[[], None] | None:
        """Apply (or, in sync mode, gather) a worker's push; a step already pushed is ignored.

        With `later`, the optimizer steps are returned as one function instead of taken (None
        when there are none): call it before any read or update of these keys. The clocks have
        moved already, and the gradients must stay unchanged until it ran.
        """
        row_ids = row_ids or {}
        self.check_push(worker, step, grads, row_ids)
        self._updates = []
        for key, g in grads.items():
            k = self.keys[key]
            if step <= k.last_step[worker]:
                continue  # a retry of a push already taken
            k.last_step[worker] = step
            ids = row_ids.get(key)
            if self.mode == "sync":
                self._gather(k, worker, g, ids)
            elif ids is None:
                self._apply(k, g, None)
            else:
                self._apply_rows(k, [(ids, g)], 1)
        self.changed.set()
        updates, self._updates = self._updates, []
        if not updates:
            return None
        steps = Steps(self, updates)
        if later:
            return steps
        steps()
        return None

    def _gather(self, k: _Key, worker: int, g: np.ndarray, ids: np.ndarray | None) -> None:
        if ids is None:
            if k.acc is None:
                k.acc = np.array(g, copy=True)
            else:
                k.acc += g
        else:
            k.acc_rows.append((ids.copy(), g.copy()))
            self.nbytes += ids.nbytes + g.nbytes  # held until the step is whole (check_push bounds it)
        k.seen.add(worker)
        if len(k.seen) < self.num_workers:
            return
        scale = 1 / self.num_workers if self.average else 1
        if k.acc is not None:
            for ids, rows in k.acc_rows:
                np.add.at(k.acc, ids, rows)
            if scale != 1:
                k.acc *= k.acc.dtype.type(scale)
            self._apply(k, k.acc, None)
        else:
            self._apply_rows(k, k.acc_rows, scale)
        self.nbytes -= sum(ids.nbytes + rows.nbytes for ids, rows in k.acc_rows)
        k.acc, k.acc_rows, k.seen = None, [], set()
        k.clock += 1

    def _apply_rows(self, k: _Key, parts: list[tuple[np.ndarray, np.ndarray]], scale: float) -> None:
        ids = np.concatenate([p[0] for p in parts])
        rows, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(rows),) + k.value.shape[1:], k.value.dtype)
        np.add.at(summed, inverse.reshape(-1), np.concatenate([p[1] for p in parts]))
        if scale != 1:
            summed *= summed.dtype.type(scale)
        self._apply(k, summed, rows)

    def _apply(self, k: _Key, g: np.ndarray, rows: np.ndarray | None) -> None:
        self._updates.append((k, g, rows))

    # -- pull ------------------------------------------------------------------------------

    def check_pull(self, worker: int, step: int, keys: list[str], row_ids: Mapping[str, np.ndarray]) -> None:
        if not 0 <= worker < self.num_workers:
            raise _bad(f"worker {worker} is outside 0..{self.num_workers - 1} (num_workers={self.num_workers})")
        if step < 0:
            raise _bad(f"step must be >= 0, got {step}")
        for key in keys:
            self._key(key)
        if len(set(keys)) != len(keys):  # each would be sent again: a reply of any size from a few bytes
            twice = next(key for key in keys if keys.count(key) > 1)
            raise _bad(f"key {twice!r} is pulled twice")
        copied = 0
        for key, ids in row_ids.items():
            k = self._key(key)
            self._check_rows(key, k, ids)
            copied += ids.size * (k.value.nbytes // max(1, k.value.shape[0]))
            if copied > self.max_pull_bytes:
                # 8 bytes of id ask for a whole row: without a bound, a small request makes a huge reply
                raise _bad(f"a pull of rows needs {copied} bytes or more ({ids.size} rows of {key!r}); "
                           f"a pull copies at most max_pull_bytes={self.max_pull_bytes} of rows")

    def _needed(self, step: int) -> int:
        """Pushes of steps < this must be in a pull at `step`."""
        return step if self.mode == "sync" else step - self.staleness

    def _clock(self, k: _Key) -> int:
        return k.clock if self.mode == "sync" else int(k.last_step.min()) + 1

    def ready(self, keys, step: int) -> bool:
        """Whether a pull of `keys` at `step` may be answered now."""
        if self.mode == "async":
            return True
        need = self._needed(step)
        return all(self._clock(self.keys[key]) >= need for key in keys)

    def stragglers(self, keys, step: int) -> list[int]:
        """The workers a pull of `keys` at `step` is waiting for."""
        need = self._needed(step)
        late: set[int] = set()
        for key in keys:
            k = self.keys[key]
            if self.mode == "sync":
                if k.clock < need:
                    late.update(w for w in range(self.num_workers) if w not in k.seen)
            else:
                late.update(int(w) for w in np.flatnonzero(k.last_step + 1 < need))
        return sorted(late)

    def read(self, keys: list[str], row_ids: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The values of `keys` (not copied: lent until the next update) and the rows asked."""
        out = []
        for key in keys:
            k = self.keys[key]
            k.lent = True
            out.append(k.value)
        for key, ids in row_ids.items():
            out.append(self.keys[key].value[ids])
        return out


def _own(k: _Key) -> None:
    """Before an update: a value lent to a reply being written is replaced by a copy."""
    if k.lent:
        k.value = k.value.copy()
        k.lent = False


class Steps:
    """The optimizer steps of a push, taken later: all at once (call it), or a slice at a time
    (`some`) where the rule is elementwise and the step dense; either way each element is
    updated once, in the order the whole step would."""

    __slots__ = ("_store", "_updates", "_next", "_at")

    def __init__(self, store: KeyStore, updates: list) -> None:
        self._store = store
        self._updates = updates
        self._next = 0  # the update to take next
        self._at = 0  # its elements taken already

    def __call__(self) -> None:
        self.some(None)

    def some(self, budget: int | None) -> bool:
        """Take about `budget` bytes of gradient (None: all that is left); True once all is taken."""
        opt = self._store.optimizer
        updates = self._updates
        while self._next < len(updates):
            k, g, rows = updates[self._next]
            at = self._at
            if at == 0:
                _own(k)
            if (budget is None or rows is not None or not opt.elementwise or not k.value.flags.c_contiguous
                    or not g.flags.c_contiguous):
                if at == 0:
                    opt.apply(k.value, g, k.state, rows)
                else:  # the rest of a step begun in slices
                    opt.apply(k.value.reshape(-1)[at:], g.reshape(-1)[at:], k.state, None)
                end = g.size
            else:
                end = min(g.size, at + max(1, budget // g.itemsize))
                opt.apply(k.value.reshape(-1)[at:end], g.reshape(-1)[at:end], k.state, None)
            if budget is not None:
                budget -= (end - at) * g.itemsize
            if end < g.size:
                self._at = end
                return False
            self._next += 1
            self._at = 0
            if budget is not None and budget <= 0:
                break
        if self._next == len(updates):
            updates.clear()  # the gradients may go
        return not updates
