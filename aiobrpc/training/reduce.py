"""Reduction operators of the collectives, and the dtype each one accumulates in.

float16 and bfloat16 are accumulated in float32 and rounded once at the end, so a sum over
many ranks loses no more than one rounding to the dtype. bfloat16 is carried in numpy as
uint16 (its bits); it is widened by a shift and narrowed with round-to-nearest-even, as torch
does.
"""

from __future__ import annotations

import enum

import numpy as np

from ..tensor import DataType


class ReduceOp(enum.Enum):
    """How `all_reduce` and `reduce_scatter` combine the ranks' tensors."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_FUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
          ReduceOp.PRODUCT: np.multiply, ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
          ReduceOp.BXOR: np.bitwise_xor}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_HALF = (DataType.DT_FLOAT16, DataType.DT_BFLOAT16)
_FLOATS = (DataType.DT_FLOAT64, DataType.DT_FLOAT32, *_HALF)


def reduce_op(op: ReduceOp | str) -> ReduceOp:
    """`op` as a ReduceOp; "sum", "avg", "max", "min", "product", "band", "bor", "bxor" (any case) are accepted."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(o.value for o in ReduceOp)}")


def check_op(op: ReduceOp, code: int) -> None:
    """ValueError when `op` cannot apply to tensors of DataType `code`."""
    if op is ReduceOp.AVG and code not in _FLOATS:
        raise ValueError("ReduceOp.AVG needs a floating-point tensor (an integer average would be truncated)")
    if op in _BITWISE and code in _FLOATS:
        raise ValueError(f"ReduceOp.{op.name} needs an integer or bool tensor")


def accumulates_wide(code: int) -> bool:
    """Whether tensors of DataType `code` are reduced in a float32 copy."""
    return code in _HALF


def widen(raw: np.ndarray, code: int) -> np.ndarray:
    """A float32 copy of a float16 or bfloat16 (uint16 bits) array."""
    if code == DataType.DT_BFLOAT16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def narrow_into(dest: np.ndarray, wide: np.ndarray, code: int) -> None:
    """Round float32 `wide` into `dest`, a float16 or bfloat16 (uint16 bits) array."""
    if code != DataType.DT_BFLOAT16:
        np.copyto(dest, wide, casting="unsafe")
        return
    bits = wide.view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # round to nearest, ties to even
    np.copyto(dest, rounded, casting="unsafe")
    nan = np.isnan(wide)
    if nan.any():  # rounding could carry a NaN's payload into infinity
        dest[nan] = 0x7FC0


def combine(op: ReduceOp, acc: np.ndarray, incoming: np.ndarray) -> None:
    """acc = op(acc, incoming), in place."""
    _FUNCS[op](acc, incoming, out=acc)
