"""aiobrpc.tensor: arrays and tensors through the attachment, byte-exact, without copies."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import aiobrpc
from aiobrpc import tensor
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from tests.helpers.interop_server import SERVICE, running_echo

NUMPY_DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 5, 1), (1001,)]


def sample(dtype: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("float"):
        return (rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def joined(buffers) -> memoryview:
    """The attachment a peer receives: a writable buffer of the views one after the other."""
    return memoryview(bytearray(b"".join(buffers)))


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_every_dtype_and_shape_round_trips_byte_exact(dtype):
    arrays = [sample(dtype, s, i) for i, s in enumerate(SHAPES)]
    meta, buffers = tensor.pack(arrays)
    wire = tensor.TensorMeta.FromString(meta.SerializeToString())
    got = tensor.unpack(wire, joined(buffers))
    for a, g in zip(arrays, got):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert g.tobytes() == a.tobytes()


def test_offsets_and_sizes_describe_the_attachment():
    a, b, c = np.arange(3, dtype=np.int8), np.zeros(0, np.float64), np.ones((2, 2), np.float32)
    meta, buffers = tensor.pack({"a": a, "b": b, "c": c})
    assert [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in meta.tensors] == [
        ("a", tensor.DataType.DT_INT8, [3], 0, 3),
        ("b", tensor.DataType.DT_FLOAT64, [0], 3, 0),
        ("c", tensor.DataType.DT_FLOAT32, [2, 2], 3, 16),
    ]
    assert len(buffers) == 2  # an empty tensor adds no buffer
    assert list(tensor.unpack_named(meta, joined(buffers))) == ["a", "b", "c"]


def test_pack_shares_the_arrays_memory():
    a = np.arange(1 << 16, dtype=np.float32)
    meta, (view,) = tensor.pack([a])
    a[5] = -1.0
    assert np.frombuffer(view, np.float32)[5] == -1.0
    assert view.obj is not None and np.shares_memory(np.asarray(view.obj), a)


def test_unpack_returns_views_of_the_attachment():
    att = joined(tensor.pack([np.arange(10, dtype=np.int32)])[1])
    meta = tensor.pack([np.arange(10, dtype=np.int32)])[0]
    (v,) = tensor.unpack(meta, att)
    att[0:4] = (99).to_bytes(4, "little")
    assert v[0] == 99 and v.flags.writeable


def test_unpack_into_caller_destinations():
    src = [sample("float32", (4, 5)), sample("int16", (9,)), sample("bool", (3,))]
    meta, buffers = tensor.pack(src)
    dest = [np.empty((20,), np.float32), None, np.empty((3,), bool)]
    got = tensor.unpack(meta, joined(buffers), out=dest)
    assert got[0] is dest[0] and got[2] is dest[2]
    assert dest[0].tobytes() == src[0].tobytes() and got[1].tobytes() == src[1].tobytes()
    with pytest.raises(ValueError, match=r"destination of tensor #0 is float64 x20, the tensor is float32 \[4, 5\]"):
        tensor.unpack(meta, joined(buffers), out=[np.empty(20), None, None])
    with pytest.raises(ValueError, match="out has 1 destinations for 3 tensors"):
        tensor.unpack(meta, joined(buffers), out=[None])


def test_non_contiguous_is_refused_or_copied_once_when_asked():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match=r"tensor #0 is not C-contiguous .*copy=True"):
        tensor.pack([a.T])
    meta, buffers = tensor.pack([a.T], copy=True)
    (g,) = tensor.unpack(meta, joined(buffers))
    assert np.array_equal(g, a.T)


@pytest.mark.parametrize("bad, match", [
    (np.zeros(2, np.complex64), "unsupported dtype"),
    (np.zeros(2, ">f4"), "big-endian"),
    (np.zeros(2, np.uint32), "unsupported dtype"),
    ([1, 2], "must be a numpy array or a torch CPU tensor, got list"),
])
def test_unsupported_inputs_are_named(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        tensor.pack([bad])


def test_a_meta_that_does_not_fit_its_attachment_is_refused():
    meta, buffers = tensor.pack({"w": np.zeros(4, np.float32)})
    att = joined(buffers)
    with pytest.raises(ValueError, match=r"tensor 'w': bytes 0..16 lie outside the 15-byte attachment"):
        tensor.unpack(meta, att[:15])
    meta.tensors[0].nbytes = 12
    with pytest.raises(ValueError, match=r"nbytes=12 but shape \[4\] of float32 needs 16"):
        tensor.unpack(meta, att)
    # proto2 enums are closed: a dtype this side does not know parses as absent
    wire = meta.SerializeToString().replace(bytes([0x10, tensor.DataType.DT_FLOAT32]), bytes([0x10, 77]))
    with pytest.raises(ValueError, match="tensor 'w': missing or unknown dtype"):
        tensor.unpack(tensor.TensorMeta.FromString(wire), att)


def test_bfloat16_without_a_numpy_dtype_is_explained():
    meta = tensor.TensorMeta()
    meta.tensors.add(dtype=tensor.DataType.DT_BFLOAT16, shape=[2], offset=0, nbytes=4)
    if tensor._bf16_numpy() is None:
        with pytest.raises(TypeError, match="bfloat16, which numpy has no dtype for"):
            tensor.unpack(meta, b"\x80\x3f\x00\x40")
    else:
        assert tensor.unpack(meta, b"\x80\x3f\x00\x40")[0].astype(np.float32).tolist() == [1.0, 2.0]


def test_a_list_attachment_is_framed_as_its_buffers_one_after_the_other():
    from aiobrpc import _fast
    meta = _fast.RpcMeta()
    meta.has_request, meta.service_name, meta.method_name = True, "S", "M"
    bufs = baidu_std.pack(meta, b"data", [b"ab", memoryview(b""), bytearray(b"cde")])
    assert meta.attachment_size == 5
    assert b"".join(bytes(b) for b in bufs).endswith(b"dataabcde")
    with pytest.raises(aiobrpc.LocalProtocolError, match="attachment buffer #1: buffer must be C-contiguous"):
        baidu_std.pack(meta, b"", [b"x", np.zeros((3, 3))[:, 0]])


@pytest.mark.parametrize("checksum", [False, True])
async def test_many_tensors_in_one_real_call_both_ways(checksum):
    arrays = {f"t{i}_{d}": sample(d, s, i) for i, (d, s) in
              enumerate(zip(NUMPY_DTYPES * 2, SHAPES * 3))}
    arrays["big"] = sample("float32", (1 << 20,))  # 4 MiB: the frame's own buffer on receipt
    async with running_echo() as (server, _):
        async with aiobrpc.Channel(server.address) as ch:
            cntl = aiobrpc.Controller(request_checksum=checksum, request_checksum_with_attachment=checksum)
            meta = tensor.set_request_tensors(cntl, arrays)
            if checksum:
                cntl.request_user_fields["x-interop-response-checksum"] = "crc32c+attachment"
            req = interop_pb2.EchoRequest(message="t", payload=meta.SerializeToString())
            resp = await aiobrpc.Stub(ch, SERVICE).Echo(req, cntl)
            sent = b"".join(bytes(b) for b in cntl.request_attachment)
            assert resp.request_attachment_crc32 == zlib.crc32(sent)
            got = tensor.get_response_tensors(cntl, meta)  # the echo server sends the attachment back
    for (name, a), g in zip(arrays.items(), got):
        assert g.dtype == a.dtype and g.shape == a.shape and g.tobytes() == a.tobytes(), name


def test_the_metas_kept_for_repeated_calls_are_those_built_and_their_tables_are_bounded(monkeypatch):
    monkeypatch.setattr(tensor, "_PACKED", tensor._Kept(4))
    monkeypatch.setattr(tensor, "_PLANS", tensor._Kept(4))
    step = {"w": sample("float32", (2, 3)), "b": sample("int64", (4,)), "s": np.float64(2.5)}
    built, _ = tensor._pack_fields(list(step.items()), True, False)
    for _ in range(3):  # the first builds and keeps the meta, the next ones parse what was kept
        meta, buffers = tensor.pack(step)
        assert meta == built
        meta.tensors[0].offset += 100  # a caller's change to its meta stays its own
        att = joined(buffers)
        for views in (tensor.unpack(built, att), list(tensor.unpack_named(built, att).values())):
            assert [v.tobytes() for v in views] == [np.asarray(a).tobytes() for a in step.values()]
            assert [v.shape for v in views] == [np.shape(a) for a in step.values()]
    assert tensor.pack({"w": sample("float32", (3, 2))})[0].tensors[0].shape == [3, 2]
    # a kept layout still refuses an attachment it does not fit, naming why
    with pytest.raises(ValueError, match=r"tensor 'w': bytes 0..24 lie outside the 23-byte attachment"):
        tensor.unpack(built, att[:23])
    for n in range(40):  # a peer sending a new meta every call fills nothing past the cap
        meta, buffers = tensor.pack({f"k{n}": np.zeros(n, np.float32)})
        assert tensor.unpack(meta, joined(buffers))[0].shape == (n,)
    assert len(tensor._PACKED.table) <= 4 and len(tensor._PLANS.table) <= 4


@pytest.mark.parametrize("many, long_name", [(tensor.KEPT_TENSORS + 1, False), (2, True)])
def test_a_meta_too_large_to_keep_is_read_each_time(many, long_name):
    name = "n" * tensor.MAX_KEPT_META if long_name else "x"
    arrays = {f"{name}{i}": np.full(1, i, np.int16) for i in range(many)}
    before_packed, before_plans = dict(tensor._PACKED.table), dict(tensor._PLANS.table)
    for _ in range(2):
        meta, buffers = tensor.pack(arrays)
        assert [int(v[0]) for v in tensor.unpack(meta, joined(buffers))] == list(range(many))
        assert list(tensor.unpack_named(meta, joined(buffers))) == list(arrays)
    assert tensor._PACKED.table.keys() == before_packed.keys()
    assert tensor._PLANS.table.keys() == before_plans.keys()
