"""numpy arrays and torch CPU tensors as the attachment of a call, without copies.

The data of each tensor travels raw (C-contiguous, little-endian) in the call's attachment; a
`TensorMeta` message (proto/tensor.proto, package `aiobrpc`) describes each one: dtype, shape,
offset and length in the attachment. Put the meta in a field of your request or response
message (`import "tensor.proto";` ... `optional aiobrpc.TensorMeta tensors = 2;`); a C++ brpc
program reads the same call with the generated class and `IOBuf`.

Sending copies nothing in user space: `pack` returns the meta and a list of byte views of the
arrays' own memory, which the call writes to the socket as they are (an attachment may be a
list of buffers). Do not change the arrays while the call is in flight. A non-contiguous array
is refused, or copied once when `copy=True` says so.

Receiving: `unpack` returns arrays that are views of the received attachment (no copy), or,
given `out`, copies each tensor once into the caller's destination array.

>>> import numpy as np
>>> meta, buffers = pack({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.int64(7)})
>>> [(t.name, list(t.shape), t.offset, t.nbytes) for t in meta.tensors]
[('w', [2, 3], 0, 24), ('step', [], 24, 8)]
>>> received = memoryview(b"".join(buffers))  # what the peer's cntl.request_attachment holds
>>> w, step = unpack(meta, received)
>>> w.tolist(), int(step)
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 7)

dtypes: float64, float32, float16, bfloat16 (torch.bfloat16, or numpy's from ml_dtypes), int64,
int32, int16, int8, uint8, bool.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._proto.tensor_pb2 import DataType, TensorInfo, TensorMeta

__all__ = [
    "DTYPE_NAMES", "DataType", "TensorInfo", "TensorMeta", "get_request_tensors", "get_response_tensors",
    "pack", "set_request_tensors", "set_response_tensors", "unpack", "unpack_named",
]

# DataType -> (name, numpy dtype carrying the bytes). bfloat16 is carried as uint16 in numpy
# unless ml_dtypes provides a real dtype.
_WIRE: dict[int, tuple[str, np.dtype]] = {
    DataType.DT_FLOAT64: ("float64", np.dtype("<f8")),
    DataType.DT_FLOAT32: ("float32", np.dtype("<f4")),
    DataType.DT_FLOAT16: ("float16", np.dtype("<f2")),
    DataType.DT_BFLOAT16: ("bfloat16", np.dtype("<u2")),
    DataType.DT_INT64: ("int64", np.dtype("<i8")),
    DataType.DT_INT32: ("int32", np.dtype("<i4")),
    DataType.DT_INT16: ("int16", np.dtype("<i2")),
    DataType.DT_INT8: ("int8", np.dtype("i1")),
    DataType.DT_UINT8: ("uint8", np.dtype("u1")),
    DataType.DT_BOOL: ("bool", np.dtype("?")),
}
DTYPE_NAMES: dict[str, int] = {name: code for code, (name, _) in _WIRE.items()}
"""dtype name ("float32", "bfloat16", ...) -> `DataType` value."""

_ITEMSIZE = {code: dt.itemsize for code, (_, dt) in _WIRE.items()}
_BF16 = int(DataType.DT_BFLOAT16)  # a plain int: the enum wrapper's attribute lookup costs per call
# numpy dtype -> DataType for the common case (native or little-endian), looked up before the
# general path of dtype_code, which reads dtype.name (slow: computed in Python by numpy).
_NUMPY_CODES: dict[np.dtype, int] = {dt: code for code, (name, dt) in _WIRE.items() if name != "bfloat16"}
_TORCH_CODES: dict[Any, int] = {}  # torch dtype -> DataType, filled as met


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here just to ask
    return torch is not None and isinstance(x, torch.Tensor)


def _bf16_numpy() -> np.dtype | None:
    ml = sys.modules.get("ml_dtypes")
    if ml is None:
        try:
            import ml_dtypes as ml
        except ImportError:
            return None
    return np.dtype(ml.bfloat16)


def dtype_code(dtype: Any) -> int:
    """The `DataType` of a numpy dtype, a torch dtype or a name ("float32"); ValueError if none."""
    code = _NUMPY_CODES.get(dtype) if isinstance(dtype, np.dtype) else None
    if code is not None:
        return code
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str) and dtype in DTYPE_NAMES:
        name = dtype
    else:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}") from None
        name = dt.name
        if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
            raise ValueError(f"dtype {dt.str} is big-endian; tensors travel little-endian: "
                             f"send a.astype(a.dtype.newbyteorder('<'))")
    code = DTYPE_NAMES.get(name)
    if code is None:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return code


def raw_array(x: Any, *, copy: bool = False, what: str = "tensor") -> tuple[int, np.ndarray]:
    """(DataType, 1-D numpy view of x's bytes in its wire dtype), sharing x's memory.

    bfloat16 comes back as uint16. A non-contiguous x raises ValueError unless `copy` is true,
    when it is copied once into a contiguous array.
    """
    if _is_torch(x):
        torch = sys.modules["torch"]
        if x.device.type != "cpu":
            raise ValueError(f"{what} is on {x.device}; only CPU tensors can be sent (call .cpu())")
        code = _TORCH_CODES.get(x.dtype)
        if code is None:
            code = _TORCH_CODES[x.dtype] = dtype_code(x.dtype)
        if not x.is_contiguous():
            if not copy:
                raise ValueError(f"{what} is not contiguous (strides {tuple(x.stride())}): "
                                 f"pass copy=True or send x.contiguous()")
            x = x.contiguous()
        x = x.detach()
        if code == _BF16:
            x = x.view(torch.int16)
        if x.dim() == 0:
            x = x.reshape(1)
        return code, x.numpy().reshape(-1).view(_WIRE[code][1])
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array or a torch CPU tensor, got {type(x).__name__}")
    code = _NUMPY_CODES.get(x.dtype)
    if code is None:
        code = dtype_code(x.dtype)
    if not x.flags.c_contiguous:
        if not copy:
            raise ValueError(f"{what} is not C-contiguous (shape {x.shape}, strides {x.strides}): "
                             f"pass copy=True or send np.ascontiguousarray(a)")
        x = np.ascontiguousarray(x)
    return code, x.reshape(-1).view(_WIRE[code][1])


def pack(tensors: Sequence[Any] | Mapping[str, Any], *, copy: bool = False) -> tuple[TensorMeta, list[memoryview]]:
    """Describe `tensors` in a TensorMeta and return it with the byte views to send.

    `tensors`: a sequence of numpy arrays / torch CPU tensors, or a mapping name -> array
    (the names travel in the meta). The views share the arrays' memory; the offsets in the
    meta are those of each tensor in the attachment formed by the views one after the other.
    `copy=True` copies a non-contiguous array once instead of refusing it.
    """
    named = isinstance(tensors, Mapping)
    items = tensors.items() if named else ((None, t) for t in tensors)
    # The common case, contiguous numpy arrays: the same names, dtypes and shapes call after
    # call (a training step's), so the meta is parsed from the bytes kept for them, at a
    # fraction of the cost of setting each field.
    items = list(items)
    key: list = []
    buffers: list[memoryview] = []
    if len(items) > KEPT_TENSORS:
        return _pack_fields(items, named, copy)
    for name, x in items:
        if type(x) is not np.ndarray or not x.flags.c_contiguous or (code := _NUMPY_CODES.get(x.dtype)) is None \
                or (named and type(name) is not str):
            return _pack_fields(items, named, copy)
        key.append((name, code, x.shape))
        if x.nbytes:
            buffers.append(memoryview(x).cast("B"))
    known = _PACKED.get(key := tuple(key))
    if known is not None:
        return TensorMeta.FromString(known), buffers
    meta, buffers = _pack_fields(items, named, copy)
    blob = meta.SerializeToString()
    if len(blob) <= MAX_KEPT_META:
        _PACKED.put(key, blob)
    return meta, buffers


def _pack_fields(items: list, named: bool, copy: bool) -> tuple[TensorMeta, list[memoryview]]:
    meta = TensorMeta()
    add = meta.tensors.add
    buffers: list[memoryview] = []
    offset = 0
    for i, (name, x) in enumerate(items):
        if named and not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if type(x) is np.ndarray and x.flags.c_contiguous and (code := _NUMPY_CODES.get(x.dtype)) is not None:
            raw = x
        else:
            code, raw = raw_array(x, copy=copy, what=f"tensor {name!r}" if name is not None else f"tensor #{i}")
        nbytes = raw.nbytes
        info = add()  # fields set one by one: add(**fields) costs a third more per tensor
        if name is not None:
            info.name = name
        info.dtype = code
        info.shape.extend(x.shape)
        info.offset = offset
        info.nbytes = nbytes
        offset += nbytes
        if nbytes:
            buffers.append(memoryview(raw).cast("B"))
    return meta, buffers


class _Kept:
    """A table of at most `limit` entries, emptied when full: what a peer's metas fill stays
    bounded (a peer sending a new meta every call only costs the table its use)."""

    __slots__ = ("limit", "table")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.table: dict = {}

    def get(self, key: Any) -> Any:
        return self.table.get(key)

    def put(self, key: Any, value: Any) -> None:
        if len(self.table) >= self.limit:
            self.table.clear()
        self.table[key] = value


# What pack and unpack keep, each: at most KEPT_METAS metas (sets of names, dtypes and shapes),
# each of at most KEPT_TENSORS tensors and MAX_KEPT_META serialized bytes (the table stays
# under a few MiB whatever a peer sends; a training step's few metas fit many times over).
KEPT_METAS = 64
KEPT_TENSORS = 256
MAX_KEPT_META = 16 << 10
_PACKED = _Kept(KEPT_METAS)  # ((name, DataType, shape) per tensor) -> the serialized meta
_PLANS = _Kept(KEPT_METAS)  # serialized meta -> (end, ((name, DataType, shape, offset, count), ...))


def _what(info: TensorInfo, i: int) -> str:
    return f"tensor {info.name!r}" if info.name else f"tensor #{i}"


def _checked(info: TensorInfo, i: int, size: int) -> tuple[int, tuple[int, ...], int, int]:
    code = info.dtype
    itemsize = _ITEMSIZE.get(code)
    if itemsize is None:
        raise ValueError(f"{_what(info, i)}: missing or unknown dtype in TensorMeta")
    shape = tuple(info.shape[:])  # slicing first: 3x faster than tuple() of the container
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"{_what(info, i)}: negative dimension in shape {list(shape)}")
        count *= d
    nbytes = count * itemsize
    if info.nbytes != nbytes:
        raise ValueError(f"{_what(info, i)}: nbytes={info.nbytes} but shape {list(shape)} of "
                         f"{_WIRE[code][0]} needs {nbytes}")
    offset = info.offset
    if offset < 0 or offset + nbytes > size:
        raise ValueError(f"{_what(info, i)}: bytes {offset}..{offset + nbytes} lie outside the "
                         f"{size}-byte attachment")
    return code, shape, offset, count


def _view(attachment: Any, code: int, shape: tuple[int, ...], offset: int, count: int) -> np.ndarray:
    dt = _WIRE[code][1]
    if count == 0:
        return np.empty(shape, dt)
    flat = np.frombuffer(attachment, dt, count, offset)
    return flat if len(shape) == 1 else flat.reshape(shape)


def _as_numpy(raw: np.ndarray, code: int, info: TensorInfo, i: int) -> np.ndarray:
    if code != _BF16:
        return raw
    bf16 = _bf16_numpy()
    if bf16 is None:
        raise TypeError(f"{_what(info, i)} is bfloat16, which numpy has no dtype for: install ml_dtypes, "
                        f"or unpack with torch=True")
    return raw.view(bf16)


def _as_torch(raw: np.ndarray, code: int):
    import torch
    with warnings.catch_warnings():
        # A view of a read-only attachment (bytes) stays read-only in spirit, as in numpy.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        t = torch.from_numpy(raw.view(np.int16) if code == _BF16 else raw)
    return t.view(torch.bfloat16) if code == _BF16 else t


def unpack(meta: TensorMeta, attachment: Any, out: Sequence[Any] | None = None, *,
           torch: bool = False) -> list[Any]:
    """The tensors `meta` describes in the received `attachment`.

    Without `out`: numpy arrays (torch tensors with `torch=True`) that are views of the
    attachment, copying nothing; they keep the received buffer alive. With `out`, a sequence
    of one destination per tensor (numpy array or torch CPU tensor of the same dtype and number
    of elements, C-contiguous; None for a tensor to return as a view), each tensor is copied
    once into its destination, which is returned in its place (not copied when the attachment
    was received into it: `Controller(response_attachment_into=...)`). ValueError names a meta that
    does not fit the attachment or a destination that does not fit its tensor.
    """
    if not isinstance(meta, TensorMeta):
        raise TypeError(f"meta must be an aiobrpc.TensorMeta, got {type(meta).__name__}")
    if attachment is None:
        attachment = b""
    size = memoryview(attachment).nbytes
    if out is None and not torch:
        plan = _plan(meta, size)
        if plan is not None:
            return [_planned_view(attachment, dt, shape, offset, count) for _, dt, shape, offset, count in plan]
    infos = meta.tensors
    if out is not None and len(out) != len(infos):
        raise ValueError(f"out has {len(out)} destinations for {len(infos)} tensors")
    result = []
    for i, info in enumerate(infos):
        code, shape, offset, count = _checked(info, i, size)
        raw = _view(attachment, code, shape, offset, count)
        dest = None if out is None else out[i]
        if dest is not None:
            dcode, draw = raw_array(dest, what=f"destination of {_what(info, i)}")
            if dcode != code or draw.size != count:
                raise ValueError(f"destination of {_what(info, i)} is {_WIRE[dcode][0]} x{draw.size}, "
                                 f"the tensor is {_WIRE[code][0]} {list(shape)}")
            flat = raw.reshape(-1)
            if count and flat.ctypes.data != draw.ctypes.data:  # equal: received in place
                np.copyto(draw, flat)
            result.append(dest)
        elif torch:
            result.append(_as_torch(raw, code))
        else:
            result.append(_as_numpy(raw, code, info, i))
    return result


def _plan(meta: TensorMeta, size: int) -> tuple | None:
    """Where each tensor of `meta` lies ((name, numpy dtype, shape, offset, count) each), kept
    per serialized meta; None where the general path must look (a meta that does not fit
    `size`, is wrong, holds bfloat16 or is too large to keep): it says what is wrong."""
    if len(meta.tensors) > KEPT_TENSORS:
        return None
    blob = meta.SerializeToString()
    kept = _PLANS.get(blob)
    if kept is None:
        if len(blob) > MAX_KEPT_META:
            return None
        steps, end = [], 0
        for i, info in enumerate(meta.tensors):
            try:
                code, shape, offset, count = _checked(info, i, 1 << 62)
            except ValueError:
                return None
            if code == _BF16:
                return None
            steps.append((info.name, _WIRE[code][1], shape, offset, count))
            end = max(end, offset + count * _ITEMSIZE[code])
        kept = (end, tuple(steps))
        _PLANS.put(blob, kept)
    return kept[1] if kept[0] <= size else None


def _planned_view(attachment: Any, dt: np.dtype, shape: tuple[int, ...], offset: int, count: int) -> np.ndarray:
    if not count:
        return np.empty(shape, dt)
    flat = np.frombuffer(attachment, dt, count, offset)
    return flat if len(shape) == 1 else flat.reshape(shape)


def unpack_named(meta: TensorMeta, attachment: Any, *, torch: bool = False) -> dict[str, Any]:
    """`unpack` as a dict name -> view (tensors packed from a mapping; of a name given twice,
    the last)."""
    if not torch and isinstance(meta, TensorMeta):
        plan = _plan(meta, memoryview(attachment if attachment is not None else b"").nbytes)
        if plan is not None:
            return {name: _planned_view(attachment, dt, shape, offset, count)
                    for name, dt, shape, offset, count in plan}
    views = unpack(meta, attachment, torch=torch)
    return {info.name: v for info, v in zip(meta.tensors, views)}


def set_request_tensors(cntl: Any, tensors: Sequence[Any] | Mapping[str, Any], *,
                        copy: bool = False) -> TensorMeta:
    """Client: make `tensors` the request attachment of `cntl`; returns the TensorMeta to put
    in the request message."""
    meta, buffers = pack(tensors, copy=copy)
    cntl.request_attachment = buffers
    return meta


def get_request_tensors(cntl: Any, meta: TensorMeta, out: Sequence[Any] | None = None, *,
                        torch: bool = False) -> list[Any]:
    """Server: the request's tensors, described by `meta` (from the request message)."""
    return unpack(meta, cntl.request_attachment, out, torch=torch)


def set_response_tensors(cntl: Any, tensors: Sequence[Any] | Mapping[str, Any], *,
                         copy: bool = False) -> TensorMeta:
    """Server: make `tensors` the response attachment of `cntl`; returns the TensorMeta to put
    in the response message."""
    meta, buffers = pack(tensors, copy=copy)
    cntl.response_attachment = buffers
    return meta


def get_response_tensors(cntl: Any, meta: TensorMeta, out: Sequence[Any] | None = None, *,
                         torch: bool = False) -> list[Any]:
    """Client, after a successful call: the response's tensors, described by `meta`."""
    return unpack(meta, cntl.response_attachment, out, torch=torch)
