"""What a server does with the gradients of one step: add them, or an SGD or Adam step.

Each rule updates a key's value in place, whole or a set of distinct rows (axis 0), and keeps
its own state per key (Adam's moments and step counts, per row so that rows pushed at
different rates are corrected by their own counts, as torch's SparseAdam does).

>>> import numpy as np
>>> w = np.ones(3, np.float32)
>>> rule = SGD(lr=0.5)
>>> rule.apply(w, np.array([2, 0, -2], np.float32), rule.new_state(w))
>>> w.tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ..._fast.sgd import sub_scaled

__all__ = ["SGD", "Adam", "Optimizer", "Sum"]


def _check_number(name: str, v: Any, *, low: float, high: float = math.inf, open_low: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            v < low or (open_low and v == low) or v >= high:
        bound = f"> {low}" if open_low else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound}" + (f" and < {high}" if high != math.inf else "")
                         + f", got {v!r}")
    return float(v)


class Optimizer(ABC):
    """The update rule of a parameter server. Subclasses: `Sum`, `SGD`, `Adam`."""

    state_copies = 0  # arrays of a key's size in its state (for the server's max_bytes)
    # Its work per byte against SGD's, for where a server takes a push's step (server.py): on
    # the loop after the reply while short, else on the update thread. A rule of unknown cost
    # is taken for a costly one.
    step_cost = 100.0
    # Its dense step is element by element with no state: applied to consecutive slices of a
    # key (value and gradient alike) it gives the whole step's result, so a server may take a
    # large one a slice at a time between its reads (server.py).
    elementwise = False

    def new_state(self, value: np.ndarray) -> Any:
        """The state this rule keeps for a key holding `value`."""
        return None

    @abstractmethod
    def apply(self, value: np.ndarray, grad: np.ndarray, state: Any, rows: np.ndarray | None = None) -> None:
        """Update `value` (or its `rows`, distinct int64 ids) in place with `grad`."""


class Sum(Optimizer):
    """value += pushed (ps-lite's default server: workers push deltas)."""

    step_cost = 1.0
    elementwise = True

    def apply(self, value, grad, state, rows=None):
        if rows is None:
            value += grad
        else:
            value[rows] += grad

    def __repr__(self) -> str:
        return "Sum()"


class SGD(Optimizer):
    """value -= lr * gradient."""

    step_cost = 1.0
    elementwise = True

    def __init__(self, lr: float = 0.01) -> None:
        self.lr = _check_number("lr", lr, low=0.0, open_low=True)

    def apply(self, value, grad, state, rows=None):
        if rows is None:
            sub_scaled(value, grad, self.lr)
        else:
            value[rows] -= grad * value.dtype.type(self.lr)

    def __repr__(self) -> str:
        return f"SGD(lr={self.lr})"


class Adam(Optimizer):
    """Adam (Kingma & Ba), torch.optim.Adam's defaults; bias correction by each row's own count."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.lr = _check_number("lr", lr, low=0.0, open_low=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.beta1 = _check_number("betas[0]", betas[0], low=0.0, high=1.0)
        self.beta2 = _check_number("betas[1]", betas[1], low=0.0, high=1.0)
        self.eps = _check_number("eps", eps, low=0.0, open_low=True)

    state_copies = 2
    step_cost = 100.0  # numpy's passes and temporaries: 75x SGD's time for 4 MiB of float32 here

    def new_state(self, value):
        counts = np.zeros(value.shape[:1], np.int64)  # per row; () for a scalar
        return np.zeros_like(value), np.zeros_like(value), counts

    def apply(self, value, grad, state, rows=None):
        m_all, v_all, counts = state
        if rows is None:
            counts += 1
            m, v, t = m_all, v_all, counts
        else:
            counts[rows] += 1
            m, v, t = m_all[rows], v_all[rows], counts[rows]
        m *= self.beta1
        m += (1 - self.beta1) * grad
        v *= self.beta2
        v += (1 - self.beta2) * np.square(grad)
        t = t.reshape(t.shape + (1,) * (value.ndim - t.ndim)).astype(value.dtype)
        m_hat = m / (1 - self.beta1 ** t)
        v_hat = v / (1 - self.beta2 ** t)
        step = self.lr * m_hat / (np.sqrt(v_hat) + self.eps)
        if rows is None:
            value -= step.astype(value.dtype, copy=False)
        else:
            m_all[rows], v_all[rows] = m, v
            value[rows] -= step.astype(value.dtype, copy=False)

    def __repr__(self) -> str:
        return f"Adam(lr={self.lr}, betas=({self.beta1}, {self.beta2}), eps={self.eps})"
