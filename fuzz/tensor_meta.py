"""Harness: a peer's TensorMeta and attachment, read by `aiobrpc.tensor.unpack` and
`unpack_named` (what a parameter server does with every Init, Push and Pull, and any handler
that receives tensors), through the layouts kept per meta (`tensor._PLANS`) and the general path.

Input: byte 0 chooses (bit 0: the meta is built from the fuzzed fields below instead of parsed
as raw bytes; bits 1-2: the attachment is cut short by 0, 1, 7 or 64 bytes), bytes 1-2 the
meta's length (little-endian), then the meta (a serialized TensorMeta, or in built mode 10 bytes
a tensor: dtype, rank, 3 dims, offset, nbytes delta, name), then the attachment.

Expected: ValueError or TypeError naming what is wrong, or views that lie inside the
attachment; each call (the first, which keeps the layout, and the second, which uses it) gives
what the general path gives (`unpack` with `out=[None, ...]`, which keeps nothing): the same
error type, or arrays of the same dtype, shape and bytes; `unpack_named` gives the same names
and arrays. The tables of kept metas never pass KEPT_METAS.

    python -m fuzz.tensor_meta fuzz/corpus/tensor_meta -max_total_time=60
    python -m fuzz.tensor_meta --seeds fuzz/corpus/tensor_meta     # (re)write the seed corpus
"""

from __future__ import annotations

import struct

from fuzz import _harness as H

with H.instrumented():
    import numpy as np
    from google.protobuf.message import DecodeError

    from aiobrpc import tensor

_CUTS = (0, 1, 7, 64)
_TENSOR = struct.Struct("<BBBBBHhB")  # dtype, rank, 3 dims (each < 256), offset, nbytes delta, name
_NAMES = ("w", "b", "w", "layer0.weight", "", "x" * 40)


def _meta(data: bytes, built: bool) -> tensor.TensorMeta | None:
    if not built:
        try:
            return tensor.TensorMeta.FromString(data)
        except DecodeError:
            return None
    meta = tensor.TensorMeta()
    for at in range(0, len(data) - _TENSOR.size + 1, _TENSOR.size):
        dtype, rank, d0, d1, d2, offset, delta, name = _TENSOR.unpack_from(data, at)
        shape = (d0, d1, d2)[:rank % 4]
        info = meta.tensors.add(shape=shape, offset=offset)
        if dtype % 12 in tensor._ITEMSIZE:  # else absent (an unknown value comes in raw mode)
            info.dtype = dtype % 12
        count = 1
        for d in shape:
            count *= d
        info.nbytes = max(0, count * tensor._ITEMSIZE.get(info.dtype, 1) + delta % 5 - 2)
        info.name = _NAMES[name % len(_NAMES)]
    return meta


def _outcome(fn) -> tuple:
    try:
        return ("ok", fn())
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))


def _same(got: tuple, want: tuple, what: str, attachment: memoryview) -> None:
    if got[0] != want[0]:
        raise H.Finding(f"{what}: {got[0]} {got[1]!r:.200} where the general path gives {want[0]} {want[1]!r:.200}")
    if got[0] != "ok":
        return
    a, b = got[1], want[1]
    if isinstance(a, dict):
        if list(a) != list(b):
            raise H.Finding(f"{what}: names {list(a)!r:.200}, the general path {list(b)!r:.200}")
        a, b = list(a.values()), list(b.values())
    if len(a) != len(b):
        raise H.Finding(f"{what}: {len(a)} arrays, the general path {len(b)}")
    base = np.frombuffer(attachment, np.uint8) if attachment.nbytes else None
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            raise H.Finding(f"{what}: {x.dtype} {x.shape} where the general path gives {y.dtype} {y.shape}")
        if x.nbytes and (base is None or not np.shares_memory(x, base)):
            raise H.Finding(f"{what}: an array of {x.nbytes} bytes outside the attachment")


def _digest(out: tuple) -> str:
    if out[0] != "ok":
        return out[0]
    arrays = out[1].values() if isinstance(out[1], dict) else out[1]
    return "ok " + H.short(b"".join(f"{a.dtype}{a.shape}".encode() + a.tobytes() for a in arrays))


def one_input(data: bytes) -> str:
    return H.plain(_one, data)


def _one(data: bytes) -> str:
    if len(data) < 3:
        return "short"
    flags, size = data[0], int.from_bytes(data[1:3], "little")
    meta = _meta(data[3:3 + size], bool(flags & 1))
    if meta is None:
        return "unparsable"
    body = data[3 + size:]
    attachment = memoryview(bytearray(body[:max(0, len(body) - _CUTS[(flags >> 1) & 3])]))
    n = len(meta.tensors)
    want = _outcome(lambda: tensor.unpack(meta, attachment, [None] * n))
    want_named = ("ok", {info.name: v for info, v in zip(meta.tensors, want[1])}) if want[0] == "ok" else want
    for what in ("unpack (first)", "unpack (kept)"):
        _same(_outcome(lambda: tensor.unpack(meta, attachment)), want, what, attachment)
    _same(_outcome(lambda: tensor.unpack_named(meta, attachment)), want_named, "unpack_named", attachment)
    if len(tensor._PLANS.table) > tensor.KEPT_METAS:
        raise H.Finding(f"{len(tensor._PLANS.table)} metas kept, over KEPT_METAS={tensor.KEPT_METAS}")
    return f"{n} tensors {_digest(want)}"


# -- seeds ---------------------------------------------------------------------------------------
def _raw(meta: tensor.TensorMeta, attachment: bytes, cut: int = 0) -> bytes:
    blob = meta.SerializeToString()
    return bytes([cut << 1]) + len(blob).to_bytes(2, "little") + blob + attachment


def seeds() -> dict[str, bytes]:
    out = {}
    step = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float64),
            "ids": np.arange(3, dtype=np.int64), "flag": np.array(True), "empty": np.zeros((0, 5), np.int8)}
    meta, bufs = tensor.pack(step)
    att = b"".join(bytes(b) for b in bufs)
    out["training_step"] = _raw(meta, att)
    out["training_step_cut"] = _raw(meta, att, 2)
    out["unnamed"] = _raw(tensor.pack([np.arange(5, dtype=np.int16), np.zeros(3, np.uint8)])[0], b"\1" * 13)
    twice = tensor.TensorMeta()
    twice.tensors.add(name="w", dtype=tensor.DataType.DT_FLOAT32, shape=[2], offset=0, nbytes=8)
    twice.tensors.add(name="w", dtype=tensor.DataType.DT_FLOAT32, shape=[2], offset=4, nbytes=8)
    out["a_name_twice_overlapping"] = _raw(twice, bytes(range(12)))
    bf16 = tensor.TensorMeta()
    bf16.tensors.add(dtype=tensor.DataType.DT_BFLOAT16, shape=[2], offset=0, nbytes=4)
    out["bfloat16"] = _raw(bf16, b"\x80\x3f\x00\x40")
    odd = tensor.TensorMeta()
    odd.tensors.add(dtype=tensor.DataType.DT_FLOAT64, shape=[3], offset=1, nbytes=24)
    out["unaligned_offset"] = _raw(odd, bytes(25))
    two = _TENSOR.pack(2, 2, 3, 2, 0, 0, 2, 0) + _TENSOR.pack(5, 1, 4, 0, 0, 24, 2, 1)
    out["built_fields"] = bytes([1, len(two), 0]) + two + bytes(64)
    out["built_wrong_nbytes"] = bytes([1, _TENSOR.size, 0]) + _TENSOR.pack(2, 1, 4, 0, 0, 0, 0, 2) + bytes(16)
    out["built_past_the_end"] = bytes([1, _TENSOR.size, 0]) + _TENSOR.pack(5, 1, 8, 0, 0, 60000, 2, 0) + bytes(64)
    return out


if __name__ == "__main__":
    H.main(one_input, seeds)
